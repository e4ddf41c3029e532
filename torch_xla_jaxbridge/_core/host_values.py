"""Plain values that code reads from outside its arguments and its module's attributes: the
globals of its Python module and of the helper functions it calls, its class's attributes, the
settings objects its module holds, and the environment variables it names.

A trace reads them once, as constants; plain torch_xla reads them at every step. So their values
now are part of a call's cache key (`HostValues.read`): a forward that multiplies by a global
`SCALE`, reads `self.factor` from its class, `self.config.use_cache` or branches on
`os.environ.get("FAST")` traces again when the value changes, instead of running the old one.
Found from the code (`code_names`): the globals a forward (and its methods and helpers, `DEPTH`
calls deep) loads that hold a number, string, bool or None; the class attributes it names that
do; the attributes it names of the settings objects its module holds (a config); and, for code
that names `environ` or `getenv`, the upper-case strings it holds or loads from its globals (the
keys). Code of torch, JAX, torchax and this package is not read, nor a value deeper inside an
object (a dict's entry, a config's nested object).
"""
from __future__ import annotations

import functools
import operator
import os
import types
import weakref
from typing import Any, Callable, Iterable

import torch

from torch_xla_jaxbridge._core import code_names

DEPTH = 4  # helper functions followed below a forward
_ATOMS = (type(None), bool, int, float, str)
_MISSING = object()  # a global or class attribute not (or no longer) there


class HostValues:
  """Readers of the plain values some code reads from outside: `read()` is their values now, a
  part of a cache key; `names` says where each is read from.

  Example:
    >>> import os
    >>> __name__ = "model"  # code of the user's, not of this package
    >>> found = of_functions([lambda: os.environ.get("HOME_SCALE")])
    >>> found.names, found.read() == (os.environ.get("HOME_SCALE"),)
    (['environment variable HOME_SCALE'], True)
  """
  __slots__ = ("readers", "names", "fields")

  def __init__(self, readers: list[Callable[[], Any]], names: list[str],
               fields: list[tuple[str, ...] | None] | None = None) -> None:
    self.readers, self.names = tuple(readers), names
    # per reader of several attributes of one object (a config): each value's name
    self.fields = fields or [None] * len(names)

  def read(self) -> tuple:
    """The values now: equal tuples mean a trace's constants still hold."""
    return tuple([reader() for reader in self.readers])

  def describe(self, old: tuple, new: tuple) -> list[str]:
    """`"name old -> new"` for each value that differs between two `read()`s (for re-trace
    reasons): an attribute of a config by its own name.

    Example:
      >>> found = HostValues([lambda: 1], ["global model.SCALE"])
      >>> found.describe((1.0,), (3.0,))
      ['global model.SCALE 1.0 -> 3.0']
    """
    changes = []
    for name, fields, before, after in zip(self.names, self.fields, old, new):
      if before == after:
        continue
      if (fields and len(fields) > 1 and isinstance(before, tuple) and isinstance(after, tuple)
          and len(before) == len(after) == len(fields)):
        changes += [f"{field} {_shown(b)} -> {_shown(a)}"
                    for field, b, a in zip(fields, before, after) if b != a]
      else:
        changes.append(f"{fields[0] if fields else name} {_shown(before)} -> {_shown(after)}")
    return changes


def _shown(value: object) -> str:
  return "(missing)" if value is _MISSING else repr(value)


class _Finder:
  """Collects readers while functions and classes are walked, each place once."""

  def __init__(self) -> None:
    self.readers: dict[tuple, tuple[Callable[[], Any], str]] = {}
    self.seen: set[int] = set()
    self.classes: dict[type, frozenset[str]] = {}  # a module class -> the names its code reads
    self.held: dict[int, tuple[object, str, set[str]]] = {}  # settings objects: names read

  def function(self, fn: object, depth: int = 0) -> None:
    for function in _functions(fn):
      code = function.__code__
      if id(code) in self.seen or _library(function):
        continue
      self.seen.add(id(code))
      namespace = function.__globals__
      for name in code_names.global_names(code):
        value = namespace.get(name, _MISSING)
        if type(value) in _ATOMS:
          self.add((id(namespace), name), functools.partial(namespace.get, name, _MISSING),
                   f"global {function.__module__}.{name}")
        elif depth < DEPTH and isinstance(value, (types.FunctionType, functools.partial)):
          self.function(value, depth + 1)
      if {"environ", "getenv"} & code_names.code_names(code):  # keys: constants, or globals
        keys = _upper_case_strings(code) | {
            value for name in code_names.global_names(code)
            if _env_name(value := namespace.get(name))}
        for key in sorted(keys):
          self.add(("environ", key), functools.partial(os.environ.get, key),
                   f"environment variable {key}")

  def module(self, module: torch.nn.Module) -> None:
    """The forward of `module`'s class and the methods its code names, with the plain class
    attributes they name (not those the instance holds itself: its settings), and the plain
    attributes they name of the objects the module holds (a config's `use_cache`)."""
    cls = type(module)
    if _library(cls):
      return
    names = self.classes.get(cls)
    if names is None:
      names = self.classes[cls] = self._module_class(cls, vars(module))
    for held_name, held in vars(module).items():
      if held_name in names and _settings_object(held):
        read = {a for a in names & set(vars(held)) if type(vars(held)[a]) in _ATOMS}
        if read:
          entry = self.held.setdefault(id(held), (held, f"{cls.__name__}.{held_name}", set()))
          entry[2].update(read)

  def _module_class(self, cls: type, instance: dict) -> frozenset[str]:
    """Walks `cls`'s forward and the methods it names; the names their code reads."""
    methods = code_names.method_names(cls)
    todo, named, read = ["forward"], set(), set()
    while todo:
      name = todo.pop()
      if name in named or name not in methods:
        continue
      named.add(name)
      self.function(_attribute(cls, name))
      todo.extend(methods[name])
      read |= methods[name]
      for attribute in methods[name] - set(instance):
        value = _attribute(cls, attribute)
        if type(value) in _ATOMS and not hasattr(torch.nn.Module, attribute):
          self.add((id(cls), attribute), functools.partial(getattr, cls, attribute, _MISSING),
                   f"class attribute {cls.__name__}.{attribute}")
    return frozenset(read)

  def add(self, place: tuple, reader: Callable[[], Any], name: str) -> None:
    self.readers.setdefault(place, (reader, name))

  def found(self) -> HostValues:
    fields = {}
    for held, where, names in self.held.values():  # one `itemgetter` per object
      read = sorted(names)
      self.add((id(held), ()), _attributes_reader(held, read),
               f"attributes {where}.{{{', '.join(read)}}}")
      fields[(id(held), ())] = tuple(f"{where}.{name}" for name in read)
    readers = list(self.readers.values())
    return HostValues([r for r, _ in readers], [n for _, n in readers],
                      [fields.get(place) for place in self.readers])


def of_functions(functions: Iterable[object]) -> HostValues:
  """The plain values `functions` (and the helpers they call) read from outside.

  Example:
    >>> __name__ = "model"  # code of the user's, not of this package
    >>> of_functions([lambda x: x * DEPTH]).names
    ['global model.DEPTH']
  """
  finder = _Finder()
  for fn in functions:
    finder.function(fn)
  return finder.found()


_OF_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of_modules(modules: Iterable[torch.nn.Module]) -> HostValues:
  """The plain values the forwards of `modules` read from outside the modules' own attributes.

  Example:
    >>> __name__ = "model"  # code of the user's, not of this package
    >>> class Scaled(torch.nn.Linear):
    ...   factor = 2.0
    ...   def forward(self, x):
    ...     return super().forward(x) * self.factor
    >>> of_modules([Scaled(2, 2)]).names
    ['class attribute Scaled.factor']
  """
  finder = _Finder()
  for module in modules:
    finder.module(module)
  return finder.found()


def of_callable(fn: object) -> HostValues:
  """`of_functions([fn])`, kept per function object (weakly).

  Example:
    >>> of_callable(print).names
    []
  """
  if not isinstance(fn, types.FunctionType):
    return of_functions([fn])
  found = _OF_FUNCTIONS.get(fn)
  if found is None:
    found = _OF_FUNCTIONS[fn] = of_functions([fn])
  return found


def _settings_object(value: object) -> bool:
  """Whether `value` is an object holding settings (a Hugging Face config, a namespace): one
  with attributes of its own that is not a module, tensor, class or function."""
  return (hasattr(value, "__dict__") and not callable(value)
          and not isinstance(value, (torch.nn.Module, torch.Tensor, types.ModuleType)))


def _attributes_reader(holder: object, names: list[str]) -> Callable[[], Any]:
  """Reads `holder`'s own attributes `names` now, from its `__dict__` (a Hugging Face config's
  `__getattribute__` is Python code); `_MISSING` once one is gone, or `holder` (held weakly where
  it can be)."""
  read = operator.itemgetter(*names)
  ref: Callable[[], object]
  try:
    ref = weakref.ref(holder)
  except TypeError:
    ref = lambda: holder  # noqa: E731

  def reader() -> Any:
    try:
      return read(vars(ref()))
    except (KeyError, TypeError):
      return _MISSING
  return reader


def _functions(fn: object) -> list[types.FunctionType]:
  """The Python functions behind a callable: what `functools.wraps` wrapped, a partial's
  function, a method's function, and functions in a wrapper's closure."""
  found: list[types.FunctionType] = []
  todo = [fn]
  while todo and len(found) < 16:
    value = todo.pop()
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
      value = value.__func__
    if isinstance(value, functools.partial):
      todo.append(value.func)
    elif isinstance(value, property):
      todo.append(value.fget)
    elif isinstance(value, types.FunctionType) and value not in found:
      found.append(value)
      todo.append(getattr(value, "__wrapped__", None))
      todo.extend(cell.cell_contents for cell in value.__closure__ or ()
                  if isinstance(_cell(cell), types.FunctionType))
  return found


def _cell(cell: types.CellType) -> object:
  try:
    return cell.cell_contents
  except ValueError:  # an empty cell
    return None


def _attribute(cls: type, name: str) -> object:
  """`name` as the class holds it (unbound), or `_MISSING`."""
  for klass in cls.__mro__:
    if name in vars(klass):
      return vars(klass)[name]
  return _MISSING


def _library(value: object) -> bool:
  module = getattr(value, "__module__", None) or ""
  return module.partition(".")[0] in code_names.LIBRARIES


def _upper_case_strings(code: types.CodeType) -> set[str]:
  """The string constants of `code` and its nested code that look like environment variable
  names (`FAST_PATH`)."""
  found = set()
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      found |= _upper_case_strings(const)
    elif _env_name(const):
      found.add(const)
  return found


def _env_name(value: object) -> bool:
  """Whether `value` looks like an environment variable's name (`FAST_PATH`)."""
  return isinstance(value, str) and value.isidentifier() and value.isupper()
