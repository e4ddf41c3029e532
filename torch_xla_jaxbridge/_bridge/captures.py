"""Captured tensors lifted: what a bridged function reads besides its arguments becomes an input.

A bridged function may read tensors and modules from its enclosing scope (closure cells), from
its module's globals, or (a bound method, a module, a callable object) from attributes of `self`.
At each call `collect` reads them where they are now and returns them as a `Lifted` pytree, which
the bridged call passes as one more argument: captured tensors are inputs of the trace (a tensor
that requires grad is differentiable, a tensor replaced or updated between calls is read fresh),
and where they were found is part of the signature. While the trace runs, `calling` puts the
traced tensors where the code reads the captured ones: a rebuilt closure and globals dict, and
the traced parameters and buffers in place of a captured module's own.

What is not lifted (a tensor reached through a list or another object's attributes, or read by a
helper function's own closure) is still refused with `CapturedTensorError`.
"""
import dis
import functools
import itertools
import types
import weakref
from typing import Callable, Optional

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import modules, runtime, threads, tracing

CELL, GLOBAL, ATTR, SELF = "cell", "global", "attr", "self"  # where a captured value was found


class CapturedKey:
  """A lifted tensor's key in the `Lifted` pytree: read as ` (captured <name>)` in paths."""
  __slots__ = ("name",)

  def __init__(self, name):
    self.name = name

  def __str__(self):
    return f" (captured {self.name})"

  def __eq__(self, other):
    return isinstance(other, CapturedKey) and other.name == self.name

  def __hash__(self):
    return hash(self.name)


class Lifted:
  """The captured tensors of one call, and where each was found (the static layout).

  `layout` holds one entry per captured value: `(where, name, kind, params, buffers, extra)`,
  `where` a `(CELL, index)`, `(GLOBAL, name)`, `(ATTR, name)` or `(SELF,)` location, `kind`
  "tensor" or "module"; a module's `params`/`buffers` are its state names and `extra` its
  identity token and training modes. Equal layouts (and tensor signatures) share a trace.

  Example:
    >>> lifted = Lifted((torch.ones(2),), (((GLOBAL, "w"), "w", "tensor", (), (), None),))
    >>> lifted.names()
    ['w']
  """
  __slots__ = ("tensors", "layout")

  def __init__(self, tensors, layout):
    self.tensors = tuple(tensors)
    self.layout = layout

  def names(self):
    """A readable name per tensor: `w`, `self.scale`, `model.fc.weight`."""
    names = []
    for _, name, kind, params, buffers, _ in self.layout:
      if kind == "tensor":
        names.append(name)
      else:
        names.extend(f"{name}.{n}" for n in params + buffers)
    return names

  def __repr__(self):
    return f"Lifted({', '.join(self.names())})"


@threads.once
def _register_pytree():
  jax = runtime.jax_module()
  jax.tree_util.register_pytree_with_keys(
      Lifted, lambda l: ([(CapturedKey(n), t) for n, t in zip(l.names(), l.tensors)], l.layout),
      lambda layout, tensors: Lifted(tensors, layout),
      flatten_func=lambda l: (l.tensors, l.layout))


_TOKENS = weakref.WeakKeyDictionary()  # module -> (identity token, StateWalk)
_COUNTER = itertools.count()
_FRESH = object()  # a place made for the trace (a new cell, a copied globals dict): no restore


def _module_state(module):
  entry = _TOKENS.get(module)
  if entry is None:
    entry = _TOKENS[module] = (next(_COUNTER), modules.StateWalk(module))
  token, walk = entry
  return (token,) + walk.state()


@functools.lru_cache(maxsize=4096)
def _global_names(code):
  """The global names `code` and the code nested in it (lambdas, comprehensions) read."""
  names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _global_names(const)
  return frozenset(names)


def _target(fn):
  """`(function whose closure and globals are read, self or None)` of a bridged callable."""
  if isinstance(fn, types.FunctionType):
    return fn, None
  if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
    return fn.__func__, fn.__self__
  if isinstance(fn, torch.nn.Module):
    return None, fn
  call = getattr(type(fn), "__call__", None)
  if isinstance(call, types.FunctionType) and hasattr(fn, "__dict__"):
    return call, fn
  return None, None  # builtins, partials, ...: nothing is lifted


def _liftable(value):
  return isinstance(value, (torch.Tensor, torch.nn.Module))


def collect(fn: Callable, fn_name: str, *, xla: bool = True) -> Optional[Lifted]:
  """The tensors and modules `fn` reads from its closure, its globals and `self`, as they are
  now; None when there are none. With `xla`, a captured tensor that is not an XLA tensor is an
  error naming it.

  Example:
    >>> w = torch.ones(3)
    >>> collect(lambda x: x * w, "f", xla=False)
    Lifted(w)
  """
  function, owner = _target(fn)
  found = []  # (where, name, value)
  if function is not None:
    code = function.__code__
    for i, (name, cell) in enumerate(zip(code.co_freevars, function.__closure__ or ())):
      try:
        value = cell.cell_contents
      except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
        continue
      if _liftable(value):
        found.append(((CELL, i), name, value))
    scope = function.__globals__
    for name in sorted(_global_names(code)):
      value = scope.get(name)
      if value is not None and _liftable(value):
        found.append(((GLOBAL, name), name, value))
  if owner is not None:
    if isinstance(owner, torch.nn.Module):
      found.append(((SELF,), "self", owner))
    for name, value in sorted(vars(owner).items()):
      if _liftable(value):
        found.append(((ATTR, name), f"self.{name}", value))
  if not found:
    return None
  _register_pytree()
  tensors, layout = [], []
  for where, name, value in found:
    if isinstance(value, torch.Tensor):
      tensors.append(value)
      layout.append((where, name, "tensor", (), (), None))
    else:
      token, params, buffers, training = _module_state(value)
      tensors.extend(params.values())
      tensors.extend(buffers.values())
      layout.append((where, name, "module", tuple(params), tuple(buffers), (token, training)))
  lifted = Lifted(tensors, tuple(layout))
  if xla and not all([t.is_xla for t in tensors]):  # names only to say which one is not
    for name, tensor in zip(lifted.names(), lifted.tensors):
      if not tensor.is_xla:
        raise errors.BadArgumentError(
            f"{fn_name} reads `{name}` (a {tensor.device.type} tensor of shape "
            f"{tuple(tensor.shape)}) from outside its arguments; bridged code runs on XLA "
            f"tensors. Move it with `.to('xla')` (a module: `module.to('xla')`).")
  return lifted


def collect_for_call(fn: Callable, fn_name: str, arguments: object) -> Optional[Lifted]:
  """`collect(fn, fn_name)` for a call of `fn` on `arguments`; None when the arguments are traced
  (a call inside bridged code: `fn` reads the enclosing trace's tensors where they are).

  Example:
    >>> w = torch.ones(3, device="xla")
    >>> collect_for_call(lambda x: x * w, "f", (torch.ones(3, device="xla"),))
    Lifted(w)
  """
  leaves = runtime.jax_module().tree.leaves(arguments)
  if any(isinstance(leaf, torch.Tensor) and tracing.is_traced(leaf) for leaf in leaves):
    return None
  return collect(fn, fn_name)


def with_captures(fn: Callable, fn_name: str, args: tuple, *, xla: bool = True) -> tuple:
  """`args` with `fn`'s captured tensors (`collect`) put first, or `args` when there are none.

  Example:
    >>> with_captures(torch.sin, "sin", (1,))
    (1,)
  """
  lifted = collect(fn, fn_name, xla=xla)
  return args if lifted is None else (lifted, *args)


def calling(fn: Callable, args: tuple) -> Callable:
  """What runs `fn` on arguments made by `with_captures`: `fn` itself when `args` holds no
  captures, else a function that takes them off and runs `fn` with the (traced) captured tensors
  put where `fn` reads them.

  Example:
    >>> calling(torch.sin, (1,)) is torch.sin
    True
  """
  if not (args and isinstance(args[0], Lifted)):
    return fn
  return lambda lifted, *a, **k: _call_with(fn, lifted, a, k)


def call_with(fn: Callable, lifted: Optional[Lifted], args: tuple, kwargs: dict) -> object:
  """`fn(*args, **kwargs)` with `lifted` (what `collect(fn, ...)` returned, its tensors now
  traced) put where `fn` reads them; a plain call when `lifted` is None. For a bridged function
  that runs `fn` itself and passes `fn`'s captures as an argument of its own.

  Example:
    >>> w = torch.ones(2)
    >>> f = lambda x: x * w
    >>> call_with(f, Lifted((torch.full((2,), 3.0),), collect(f, "f", xla=False).layout),
    ...           (torch.ones(2),), {}).tolist()
    [3.0, 3.0]
  """
  return fn(*args, **kwargs) if lifted is None else _call_with(fn, lifted, args, kwargs)


def _call_with(fn, lifted, args, kwargs):
  function, owner = _target(fn)
  tensors = iter(lifted.tensors)
  cells = list(function.__closure__ or ()) if function is not None else []
  scope = None
  placed = []  # (name, table, key, old value, traced value): put back in reverse order
  try:
    for where, name, kind, params, buffers, _ in lifted.layout:
      if kind == "tensor":
        value = next(tensors)
        if where[0] == CELL:
          cells[where[1]] = types.CellType(value)
          placed.append((name, cells[where[1]], "cell_contents", _FRESH, value))
        elif where[0] == GLOBAL:
          scope = dict(function.__globals__) if scope is None else scope
          scope[where[1]] = value
          placed.append((name, scope, where[1], _FRESH, value))
        else:
          _swap(placed, name, vars(owner), where[1], value)
        continue
      module = _read(function, owner, where)
      for names, table in ((params, torch_private.parameters_table),
                           (buffers, torch_private.buffers_table)):
        for full in names:
          prefix, _, leaf = full.rpartition(".")
          _swap(placed, f"{name}.{full}", table(module.get_submodule(prefix)), leaf,
                next(tensors))
    if function is not None and (scope is not None or cells):
      rebuilt = types.FunctionType(function.__code__, scope or function.__globals__,
                                   function.__name__, function.__defaults__, tuple(cells))
      rebuilt.__kwdefaults__ = function.__kwdefaults__
      outputs = rebuilt(*args, **kwargs) if owner is None else rebuilt(owner, *args, **kwargs)
    else:
      outputs = fn(*args, **kwargs)
    _check_not_reassigned(fn, placed)
    if scope is not None:  # other globals the code assigned, as it would have without lifting
      lifted_names = {w[1] for w, *_ in lifted.layout if w[0] == GLOBAL}
      for key, value in scope.items():
        if key not in lifted_names and function.__globals__.get(key, scope) is not value:
          function.__globals__[key] = value
    return outputs
  finally:
    for _, table, key, old, _ in reversed(placed):
      if old is not _FRESH:
        table[key] = old


def _check_not_reassigned(fn, placed):
  for name, table, key, _, value in placed:
    now = getattr(table, key) if key == "cell_contents" else table.get(key)
    if now is not value:
      fn_name = getattr(fn, "__name__", type(fn).__name__)
      raise errors.MutationError(
          f"{fn_name}: the bridged code assigned a new value to the captured `{name}`; an "
          f"assignment inside a trace cannot reach the captured tensor. Update it in place "
          f"(`{name}.copy_(new)`) or return the new value and assign it after the call.")


def read_capture(fn: Callable, where: tuple) -> object:
  """The value `fn` reads at the place `where` of a `Lifted` layout entry (a closure cell, a
  global, an attribute of `self`, or `self`).

  Example:
    >>> w = torch.ones(1)
    >>> f = lambda: w
    >>> read_capture(f, collect(f, "f", xla=False).layout[0][0]) is w
    True
  """
  function, owner = _target(fn)
  return _read(function, owner, where)


def _read(function, owner, where):
  if where[0] == CELL:
    return function.__closure__[where[1]].cell_contents
  if where[0] == GLOBAL:
    return function.__globals__[where[1]]
  if where[0] == ATTR:
    return vars(owner)[where[1]]
  return owner


def _swap(placed, name, table, key, value):
  placed.append((name, table, key, table[key], value))
  table[key] = value
