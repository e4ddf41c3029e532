"""The names a callable's code reads: the globals it loads, and every name it can read an
attribute by, through its own code, nested code, and the methods and properties of a class.

The walk for captured values (`_bridge.reach`) follows an object's attributes only by these
names, so a trainer's optimizer, data loaders and logger are not searched unless the code names
them; `host_values` finds the plain globals and class attributes a forward reads by them.
"""
from __future__ import annotations

import dis
import functools
import sys
import types

# the top-level packages whose code is library code, never a model's: Python's own, torch, JAX,
# NumPy and this package (`_bridge.reach` does not enter their objects, `host_values` their code)
LIBRARIES = frozenset(["torch", "torch_xla", "torchax", "jax", "jaxlib", "numpy",
                       "torch_xla_jaxbridge", *sys.stdlib_module_names])


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> frozenset:
  """The global names `code` and the code nested in it (lambdas, comprehensions) read.

  Example:
    >>> sorted(global_names((lambda: torch.ones(1) + [x for x in range(2)][0]).__code__))
    ['range', 'torch']
  """
  names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= global_names(const)
  return frozenset(names)


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> frozenset:
  """Every name `code` and its nested code can read an attribute by (and its identifier strings:
  `getattr(o, "name")`, `d["name"]`).

  Example:
    >>> sorted(code_names((lambda t: t.model(getattr(t, "scale"))).__code__))
    ['getattr', 'model', 'scale']
  """
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= code_names(const)
    elif isinstance(const, str) and const.isidentifier():
      names.add(const)
  return frozenset(names)


def function_names(value: object) -> frozenset:
  """The names a function-like value's code reads (a function, property, static or class method,
  and what `functools.wraps` wrapped), or an empty set.

  Example:
    >>> sorted(function_names(property(lambda self: self._model)))
    ['_model']
  """
  if isinstance(value, property):
    value = value.fget
  elif isinstance(value, (staticmethod, classmethod)):
    value = value.__func__
  names: frozenset[str] = frozenset()
  while isinstance(value, types.FunctionType):
    names |= code_names(value.__code__)
    value = getattr(value, "__wrapped__", None)
  return names


@functools.lru_cache(maxsize=1024)
def method_names(cls: type) -> dict:
  """`{name: names its code reads}` of the methods and properties of `cls` and its bases.

  Example:
    >>> class Trainer:
    ...   def compute_loss(self, x):
    ...     return self.model(x)
    >>> sorted(method_names(Trainer)["compute_loss"])
    ['model']
  """
  methods = {}
  for klass in reversed(cls.__mro__):
    for name, value in vars(klass).items():
      names = function_names(value)
      if names:
        methods[name] = names
  return methods
