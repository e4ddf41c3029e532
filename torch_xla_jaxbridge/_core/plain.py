"""Plain values: the non-tensor values a trace may bake in, and the keys that tell them apart.

One definition serves every place that decides whether two calls may share a trace: `call_jax`'s
static arguments and closures, a bridged module's structure key, and the check that the layers of
a scan are identical. Two plain values share a trace only if their keys are equal, and keys keep
types apart (`1`, `1.0` and `True` differ; so do `(1, 2)` and `[1, 2]`).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import types
from typing import Any, Callable, Hashable

import numpy as np
import torch

from torch_xla_jaxbridge import errors

_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
          np.dtype)


class NotPlain(Exception):
  """Raised by `key` for a value that is not plain; `.value` is the offending part."""

  def __init__(self, value: object) -> None:
    super().__init__(f"{type(value).__name__} is not a plain value")
    self.value = value


def key(value: Any, *, contents: bool = False, _depth: int = 0) -> Hashable:
  """A hashable key for a plain value; raises `NotPlain` for anything else.

  Plain: None, bool, int, float, complex, str, bytes, torch/NumPy dtypes, torch.device, enum
  members, and tuples, lists, `torch.Size`s, dicts, sets and frozensets of plain values (nested).
  With `contents` (how a module's attributes are compared), also configuration objects by their
  contents: dataclasses by their fields, mappings (an OmegaConf `DictConfig`) by their items,
  and other objects that are not callable by their `vars()` (a Hugging Face config), each of
  plain values.

  Example:
    >>> key((3, 1)) == key((3, 1)), key((3, 1)) == key((1, 3)), key(1) == key(1.0)
    (True, False, False)
  """
  kind = type(value)
  if kind in _ATOMS or isinstance(value, enum.Enum):
    return (kind, value)
  if _depth > _MAX_DEPTH:
    raise NotPlain(value)
  inner = functools.partial(key, contents=contents, _depth=_depth + 1)
  if kind in (tuple, list, torch.Size):
    return (kind, tuple(inner(v) for v in value))
  if kind is dict:
    return (kind, tuple(sorted(((inner(k), inner(v)) for k, v in value.items()), key=repr)))
  if kind in (set, frozenset):
    return (kind, frozenset(inner(v) for v in value))
  if contents:
    return (kind, _contents(value, inner))
  raise NotPlain(value)


_MAX_DEPTH = 12  # nesting followed (an object that refers to itself is not plain)


def _contents(value: Any, inner: Callable[[object], Hashable]) -> tuple:
  """The key of a configuration object's contents (see `key`), or `NotPlain`."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return tuple((f.name, inner(getattr(value, f.name))) for f in dataclasses.fields(value))
  if isinstance(value, collections.abc.Mapping):
    return tuple(sorted(((inner(k), inner(v)) for k, v in value.items()), key=repr))
  state = getattr(value, "__dict__", None)
  if state is None or callable(value) or isinstance(value, (type, types.ModuleType, torch.Tensor,
                                                            torch.nn.Module)) or hasattr(
                                                                type(value), "__slots__"):
    raise NotPlain(value)  # its state is not all in `vars()`, or it is code
  return tuple(sorted((name, inner(v)) for name, v in state.items()))


def is_plain(value: object) -> bool:
  """Whether `key(value)` succeeds.

  Example:
    >>> is_plain((1, "a", None)), is_plain(object())
    (True, False)
  """
  try:
    key(value)
  except NotPlain:
    return False
  return True


def static_key(value: object) -> Hashable:
  """The cache key of a static (non-tensor) argument: its plain key, else the value itself when
  it is hashable (compared by its own `==`), else, for a NumPy array, its bytes. Raises
  `NotPlain` for an unhashable value.

  Example:
    >>> static_key(np.arange(2)) == static_key(np.arange(2))
    True
  """
  try:
    return key(value)
  except NotPlain:
    pass
  if isinstance(value, np.ndarray):
    return (np.ndarray, value.dtype.str, value.shape, value.tobytes())
  try:
    hash(value)
  except TypeError:
    raise NotPlain(value) from None
  return (type(value), value)


def unhashable_error(caller: str, path: str, value: object) -> errors.BadArgumentError:
  """The error for a static argument that cannot key the trace cache.

  Example:
    >>> str(unhashable_error("f", "args[1]", bytearray()))[:48]
    'f: args[1] is a bytearray, which is not hashable'
  """
  return errors.BadArgumentError(
      f"{caller}: {path} is a {type(value).__name__}, which is not hashable, so it cannot key the "
      f"trace cache. Pass it as a tensor, a tuple, or a hashable value.")
