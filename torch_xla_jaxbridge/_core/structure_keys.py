"""What makes two modules share a trace: `structure_key`, everything but tensor values and
(optionally) plain settings that a module's forward depends on.
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import Callable, Hashable

import torch

from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import plain
from torch_xla_jaxbridge._core.modules import SETTINGS, own_attributes


class _Same:
  """An attribute that is not a configuration value, in a structure key: equal only to itself.
  Held weakly where it can be (a key shared while a structure's modules live must not keep them
  alive through an attribute that refers back to them); a dead one equals nothing."""
  __slots__ = ("ref", "hash")

  def __init__(self, value: object) -> None:
    try:
      self.ref: Callable[[], object] = weakref.ref(value)
    except TypeError:  # no weak reference to it (a builtin function): held
      self.ref = lambda: value
    self.hash = id(value)

  def __eq__(self, other: object) -> bool:
    mine = self.ref()
    return isinstance(other, _Same) and mine is not None and other.ref() is mine

  def __hash__(self) -> int:
    return self.hash


def structure_key(module: torch.nn.Module, same_objects: bool = True,
                  settings_by_value: bool = True) -> tuple | None:
  """A hashable description of everything but the tensor values a module's forward depends on.
  Modules with equal keys share one trace: the same classes, tensor shapes and dtypes, and
  attributes equal by value (`plain.key(..., contents=True)`: numbers, strings, containers,
  configuration objects by their contents) or, for anything else (a function, an object with
  behaviour), the very same object. Without `same_objects`, a module holding such an attribute
  has no key (None): a key that is kept forever must not keep objects alive. Without
  `settings_by_value`, plain values (numbers, strings: `StateWalk.settings`) count by their type
  only: the calls compare those a trace read (`ReadSettings`).

  Example:
    >>> structure_key(torch.nn.Linear(2, 3)) == structure_key(torch.nn.Linear(2, 3))
    True
  """
  parts = []
  for name, sub in module.named_modules():
    attrs: list[tuple[str, Hashable]] = []
    for name_, value in own_attributes(sub):
      if isinstance(value, torch.Tensor):  # a plain tensor attribute: an input, as a buffer
        attrs.append((name_, (torch.Tensor, tuple(value.shape), value.dtype)))
        continue
      if not settings_by_value and type(value) in SETTINGS:
        attrs.append((name_, type(value).__name__))
        continue
      try:
        attrs.append((name_, plain.key(value, contents=True)))
      except plain.NotPlain:
        if not same_objects:
          return None
        attrs.append((name_, _code_key(value, sub)))
    tables = (torch_private.parameters_table(sub), torch_private.buffers_table(sub))
    tensors = [(k, tuple(t.shape), t.dtype) for table in tables for k, t in table.items()
               if t is not None]
    parts.append((name, type(sub), tuple(attrs), tuple(tensors)))
  return tuple(parts)


def _code_key(value: object, owner: torch.nn.Module) -> Hashable:
  """An attribute that is code, in a structure key: a `functools.partial` by its function and
  plain arguments (`GELUTanh.act`, made per module), a method of `owner` by its function, anything
  else only equal to itself."""
  if isinstance(value, functools.partial):
    try:
      return (functools.partial, _Same(value.func), plain.key(value.args),
              plain.key(value.keywords))
    except plain.NotPlain:
      pass
  if isinstance(value, types.MethodType) and value.__self__ is owner:
    return (types.MethodType, _Same(value.__func__))
  return _Same(value)
