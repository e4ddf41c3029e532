"""Where a bridged callable's captured modules and tensors are: its roots, the objects under them.

The roots of a callable are what it reads besides its arguments: its closure cells, the globals its
code names, `self` (of a bound method, a module or a callable object) and `self`'s attributes, and
the arguments a `functools.partial` binds (nested partials flattened). Under a root the walk follows
plain Python objects (the attributes whose names the code can read: its own names, and those of
the methods and properties it reaches), dicts, lists and tuples, `DEPTH` steps deep, to the modules
and tensors they hold; objects of torch's, JAX's and NumPy's classes (optimizers, data loaders)
and modules are not entered. A place is a path: a root key, then `(ATTR, name)` / `(ITEM, key)`
steps.

A walk is kept per function object: each call re-reads only the entries it read (a container's
keys, and each entry's kind: a tensor, a plain value, or which object) and walks again when one
differs, so a tensor replaced on an attribute is read where it is now, and one that appears where
a plain value was is found.
"""
import argparse
import collections
import functools
import types
import weakref
from typing import Any, Callable, Hashable, Sequence

import torch

from torch_xla_jaxbridge._core import code_names

CELL, GLOBAL, SELF, PARG, PKW = "cell", "global", "self", "partial arg", "partial keyword"  # roots
ATTR, ITEM, BOUND = "attr", "item", "bound"  # steps: an attribute, an item, a method's `self`
DEPTH = 4  # steps below a root the walk follows
WIDTH = 64  # entries of a dict, list or tuple it reads (a larger one is not entered)
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)
_NOT_ENTERED = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                types.ModuleType, functools.partial, torch.nn.Module, torch.Tensor)
_TENSOR, _ATOM, _MISSING = object(), object(), object()  # an entry's kind, where not its identity
_ROOTS, _OBJECT, _DICT, _SEQUENCE, _METHOD = range(5)  # what a record read
Queue = collections.deque[tuple[Any, tuple, str, tuple[int, int], int]]


def split(fn: object) -> tuple[types.FunctionType | None, object]:
  """`(function whose closure and globals are read, self or None)` of a callable.

  Example:
    >>> split(torch.nn.Linear(1, 1).forward)[0].__name__
    'forward'
  """
  if isinstance(fn, types.FunctionType):
    return fn, None
  if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
    return fn.__func__, fn.__self__
  if isinstance(fn, torch.nn.Module):
    return None, fn
  call = getattr(type(fn), "__call__", None)
  if isinstance(call, types.FunctionType) and hasattr(fn, "__dict__"):
    return call, fn
  return None, None  # builtins: nothing is read


class Target:
  """A callable taken apart: the arguments its `functools.partial` layers bind (`pargs`, `pkw`),
  the callable under them (`call`), and `split(call)`.

  Example:
    >>> t = Target(functools.partial(functools.partial(max, 1), 2))
    >>> t.call is max, t.pargs
    (True, (1, 2))
  """
  __slots__ = ("call", "pargs", "pkw", "function", "owner")

  def __init__(self, fn: Any) -> None:
    self.function: types.FunctionType | None
    self.pargs: tuple
    self.pkw: dict[str, Any]
    self.owner: object
    if type(fn) is types.FunctionType:  # the common case, first
      self.call = self.function = fn
      self.pargs, self.pkw, self.owner = (), {}, None
      return
    pargs: tuple = ()
    pkw: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
      pargs, pkw = fn.args + pargs, {**fn.keywords, **pkw}
      fn = fn.func
    self.call, self.pargs, self.pkw = fn, pargs, pkw
    self.function, self.owner = split(fn)

  def roots(self) -> list[tuple[tuple, str]]:
    """`(key, name)` of every root, in walk order."""
    found: list[tuple[tuple, str]] = []
    if self.function is not None:
      code = self.function.__code__
      found += [((CELL, i), name) for i, name in
                enumerate(code.co_freevars[:len(self.function.__closure__ or ())])]
      found += [((GLOBAL, name), name) for name in sorted(code_names.global_names(code))]
    if self.owner is not None:
      found.append(((SELF,), "self"))
    found += [((PARG, i), f"partial.args[{i}]") for i in range(len(self.pargs))]
    return found + [((PKW, k), f"partial.keywords[{k!r}]") for k in self.pkw]

  def root(self, key: tuple) -> Any:
    """The value at a root now (`_MISSING` for an empty cell or an unset global)."""
    kind, function = key[0], self.function
    if kind == CELL:
      assert function is not None, key  # a function's root
      try:
        return (function.__closure__ or ())[key[1]].cell_contents
      except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
        return _MISSING
    if kind == GLOBAL:
      assert function is not None, key  # a function's root
      return function.__globals__.get(key[1], _MISSING)
    if kind == SELF:
      return self.owner
    return self.pargs[key[1]] if kind == PARG else self.pkw[key[1]]


@functools.lru_cache(maxsize=1024)  # mypy 1.13 finds a class not Hashable: calls ignore that
def _library_class(cls: type) -> bool:
  """Whether `cls` or a base comes from Python itself or from torch, JAX, NumPy or this package:
  its objects (loggers, locks, optimizers, data loaders) hold no model the code reads there."""
  return any((getattr(k, "__module__", None) or "").split(".")[0] in code_names.LIBRARIES
             for k in cls.__mro__[:-1])


@functools.lru_cache(maxsize=1024)  # mypy 1.13 finds a class not Hashable: calls ignore that
def _enterable_class(cls: type) -> bool:
  """Whether the walk reads the attributes of objects of class `cls`: a namespace, or a class of
  the user's or of another library (a transformers Trainer, a dataclass)."""
  return issubclass(cls, _NAMESPACES) or not (
      issubclass(cls, _NOT_ENTERED) or _library_class(cls))  # type: ignore[arg-type]


def _liftable(value: object) -> bool:
  return isinstance(value, (torch.Tensor, torch.nn.Module))


def _mark(value: object) -> object:
  """What a re-validation compares an entry by: tensors and plain values by kind (a tensor
  replaced by another is read where it is), everything else by `id` (a walk holds no object: a
  containing object's type and keys are checked where it is read, so a reused `id` still finds
  the same places)."""
  if isinstance(value, torch.Tensor):
    return _TENSOR
  return _ATOM if type(value) in _ATOMS else id(value)


def step_name(step: tuple) -> str:
  """How a step reads in a path's name: `.model`, `['student']`, `[0]`, `.__self__`.

  Example:
    >>> step_name((ATTR, "model")) + step_name((ITEM, "a")) + step_name((ITEM, 0))
    ".model['a'][0]"
  """
  return f"[{step[1]!r}]" if step[0] == ITEM else f".{step[1]}"


def _kind(value: Any) -> int | None:
  """How the walk enters `value` (`_OBJECT`, `_DICT`, `_SEQUENCE`), or None."""
  cls = type(value)
  if cls in _DICTS:
    return _DICT
  if cls is types.MethodType and not isinstance(value.__self__, (torch.Tensor, tuple)):
    return _METHOD  # a bound method held in a variable: its `self`
  if cls is list or cls is tuple or (isinstance(value, tuple) and hasattr(cls, "_fields")):
    return _SEQUENCE
  if isinstance(getattr(value, "__dict__", None), dict) and (
      _enterable_class(cls)):  # type: ignore[arg-type]
    return _OBJECT
  return None


class Walk:
  """One walk from a callable's roots (see the module docstring), breadth first (a module found at
  two places is lifted at the nearer): `places` holds `(where, name)` of each module and tensor,
  `notes` the places where it stopped that may hold one, and `records` what it read, which
  `values` reads again.

  Example:
    >>> import types
    >>> holder = types.SimpleNamespace(w=torch.ones(1), n=3)
    >>> walk = Walk(Target(lambda: holder.w))
    >>> walk.places
    [((('global', 'holder'), ('attr', 'w')), 'holder.w')]
  """

  def __init__(self, target: Target) -> None:
    self.names: set[str] = set()
    if target.function is not None:
      self.names |= code_names.code_names(target.function.__code__)
    for _ in range(4):  # the names grow with the methods the walk reaches: until they settle
      size = len(self.names)
      self._walk(target)
      if len(self.names) == size:
        break
    self.places = [(where, name) for where, name, _ in self.found]
    self.positions = [at for _, _, at in self.found] + [at for _, at in self.atoms]
    self.atom_names = tuple(name for name, _ in self.atoms)

  def _walk(self, target: Target) -> None:
    self.records: list[list] = []  # what it read: `_record`'s entries
    self.found: list[tuple[tuple, str, tuple[int, int]]] = []  # (where, name, at)
    self.notes: list[str] = []
    self._seen: set[int] = set()
    # (name, at) of the plain values (numbers, strings) found
    self.atoms: list[tuple[str, tuple[int, int]]] = []
    roots = target.roots()
    values = [target.root(key) for key, _ in roots]
    self._record(None, _ROOTS, [key for key, _ in roots], None, values)
    queue: Queue = collections.deque()  # (value, where, name, at, depth): breadth first
    for i, ((key, name), value) in enumerate(zip(roots, values)):
      if isinstance(value, types.FunctionType) and key[0] != SELF:  # a helper it calls
        self.names |= code_names.code_names(value.__code__)
      queue.append((value, (key,), name, (0, i), -1 if key[0] == SELF else 0))
    while queue:
      self._visit(queue, *queue.popleft())
    del self._seen

  def _visit(self, queue: Queue, value: Any, where: tuple, name: str, at: tuple[int, int],
             depth: int) -> None:
    if isinstance(value, torch.Tensor):
      self.found.append((where, name, at))
    elif isinstance(value, torch.nn.Module):
      if id(value) not in self._seen:  # a module at two places: lifted once, at the first
        self._seen.add(id(value))
        self.found.append((where, name, at))
      if depth < 0:  # `self`, a module: its tensors and modules (not in its parameter tables)
        self._enter(queue, value, _OBJECT, where, name, at, depth)
    elif type(value) in _ATOMS:  # a module's own are not entered (`StateWalk.settings`)
      self.atoms += [(name, at)] if value is not None else []
    elif value is not _MISSING:
      kind = _OBJECT if depth < 0 and hasattr(value, "__dict__") else _kind(value)
      if kind is None:
        if not (callable(value) or hasattr(value, "__dict__")
                or _library_class(type(value))):  # type: ignore[arg-type]
          self.notes.append(f"`{name}` (of type {type(value).__name__}: no `__dict__`, so its "
                            f"attributes cannot be read)")
      elif id(value) not in self._seen:
        self._seen.add(id(value))
        self._enter(queue, value, kind, where, name, at, depth)

  def _enter(self, queue: Queue, value: Any, kind: int, where: tuple, name: str,
             at: tuple[int, int], depth: int) -> None:
    what = f"`{name}` (of type {type(value).__name__}"
    if depth >= DEPTH:
      self.notes.append(f"{what}: deeper than the {DEPTH} levels searched)")
      return
    keys: Sequence[Hashable]
    shape: Hashable
    if kind == _OBJECT:
      self._follow(type(value))
      table = vars(value)
      keys = sorted((k for k in table if k in self.names or depth < 0 and _liftable(table[k])),
                    key=str)
      shape, values = (type(value), tuple(table)), [table[k] for k in keys]
    elif kind == _METHOD:
      self.names |= code_names.function_names(value.__func__)
      keys, shape, values = ("__self__",), None, [value.__self__]
    elif len(value) > WIDTH:
      self.notes.append(f"{what}, {len(value)} entries: more than the {WIDTH} read)")
      return
    elif kind == _DICT:
      keys, shape, values = list(value), tuple(value), list(value.values())
    else:
      keys, shape, values = range(len(value)), len(value), list(value)
    record = self._record(at, kind, keys, shape, values)
    module = isinstance(value, torch.nn.Module)
    for j, (key, item) in enumerate(zip(keys, values)):
      if module and not _liftable(item):
        continue
      step = (ATTR, key) if kind == _OBJECT else (BOUND, key) if kind == _METHOD else (ITEM, key)
      queue.append((item, where + (step,), name + step_name(step), (record, j), depth + 1))

  def _follow(self, cls: type) -> None:
    """Adds the names read by the methods and properties of `cls` that the code names (and its
    `__call__`): `trainer.compute_loss(batch)` reads `self.model` there."""
    for method, names in code_names.method_names(cls).items():
      if method in self.names or method == "__call__":
        self.names |= names

  def _record(self, at: tuple[int, int] | None, kind: int, keys: Sequence[Hashable],
              shape: Hashable, values: Sequence[object]) -> int:
    # the entries' ids and types: what `values` compares first (in C); their marks where not equal
    self.records.append([at, kind, tuple(keys), shape, tuple(map(_mark, values)),
                         tuple(map(id, values)), tuple(map(type, values))])
    return len(self.records) - 1

  def values(self, target: Target) -> list | None:
    """The values at the found places now, or None where an entry it read is not what it was
    (then the callable must be walked again)."""
    read: list[list] = []
    for record in self.records:
      at, kind, keys, shape, marks, ids, types_ = record
      if kind == _ROOTS:
        now = list(map(target.root, keys))
      else:
        found = _reread(read[at[0]][at[1]], kind, keys, shape)
        if found is None:
          return None
        now = found
      now_ids, now_types = tuple(map(id, now)), tuple(map(type, now))
      if now_ids != ids or now_types != types_:  # the same id and type: the same kind of entry
        if marks != tuple(map(_mark, now)):
          return None
        record[5:] = now_ids, now_types
      read.append(now)
    return [read[r][j] for r, j in self.positions]


def _reread(container: Any, kind: int, keys: Sequence[Any], shape: Any) -> list | None:
  """The entries `keys` of a container a walk entered, or None where its type or keys changed."""
  if kind == _OBJECT:
    table = getattr(container, "__dict__", None)
    if type(container) is not shape[0] or not isinstance(table, dict) or tuple(table) != shape[1]:
      return None
    return [table[key] for key in keys]
  if kind == _DICT:
    if type(container) not in _DICTS or tuple(container) != shape:
      return None
    return list(container.values())
  if kind == _METHOD:
    return [container.__self__] if type(container) is types.MethodType else None
  if not isinstance(container, (list, tuple)) or len(container) != shape:
    return None
  return list(container)


# id(callable) -> (weak reference to it, its Walk)
_WALKS: dict[int, tuple[Callable[[], object], Walk]] = {}
walks = 0  # how many walks were made (a kept walk that holds is not walked again)


def _walk_of(fn: object, target: Target) -> tuple[Walk, list | None]:
  """`(walk, values)` for `fn`: its kept walk where that still holds, else a new one (kept while
  `fn` lives, where `fn` can be referenced weakly)."""
  entry = _WALKS.get(id(fn))
  if entry is not None and entry[0]() is fn:
    values = entry[1].values(target)
    if values is not None:
      return entry[1], values
  global walks
  walks += 1
  walk = Walk(target)
  try:
    _WALKS[id(fn)] = (weakref.ref(fn, functools.partial(_WALKS.pop, id(fn))), walk)
  except TypeError:  # not weakly referenceable: walked at every call
    pass
  return walk, walk.values(target)


def find_all(fn: object) -> tuple:
  """`(places, values, plain)`: `find(fn)`, and `(name, type, value)` of each plain value (a
  number, a string) at a place the walk read: what a trace of `fn` reads as a constant.

  Example:
    >>> scale = 2.0
    >>> find_all(lambda x: x * scale)
    ([], [], (('scale', <class 'float'>, 2.0),))
  """
  target = Target(fn)
  walk, values = _walk_of(fn, target)
  if values is None:  # read differently twice in a row (a property-like __dict__): walk again
    walk = Walk(target)
    values = walk.values(target) or [None] * len(walk.positions)
  count = len(walk.places)
  return walk.places, values[:count], tuple(
      (name, type(v), v) for name, v in zip(walk.atom_names, values[count:]))


def find(fn: object) -> tuple:
  """`(places, values)`: `(where, name)` of every module and tensor `fn` can reach from its roots,
  and the value at each, now.

  Example:
    >>> import types
    >>> cfg = types.SimpleNamespace(scale=torch.ones(1), layers=[torch.nn.Linear(1, 1)])
    >>> places, _ = find(lambda x: cfg.layers[0](x) * cfg.scale)
    >>> [name for _, name in places]  # breadth first
    ['cfg.scale', 'cfg.layers[0]']
  """
  return find_all(fn)[:2]


def notes(fn: object) -> list:
  """Where the walk from `fn`'s roots stopped at something that may hold a module or tensor: an
  object without `__dict__`, one too deep, a container too large.

  Example:
    >>> notes(lambda: [0] * 100)
    []
  """
  target = Target(fn)
  return _walk_of(fn, target)[0].notes

