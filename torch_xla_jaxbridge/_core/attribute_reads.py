"""Which attributes of a module a traced forward reads: what its program can depend on.

`scan_layers` and `StackedLayers` run every layer with the first layer's attributes; those that
differ between the layers are fine where the forward never reads them (Hugging Face's
`self_attn.layer_idx`, read only with a cache).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from torch_xla_jaxbridge._core import modules

_RECORDING: dict = {}  # id of a module under `attribute_reads` -> (its path, the set of reads)
_RECORDING_CLASSES: dict = {}  # (class, attribute names) -> its recording subclass


@contextlib.contextmanager
def attribute_reads(module: torch.nn.Module) -> Iterator[set]:
  """Inside the block, every read (or assignment) of a plain attribute of `module` or of its
  submodules by name (`self.layer_idx`, `getattr(self, "scale")`) adds its path to the set it
  yields: what a traced forward's program can depend on. Each submodule is given, for the block,
  a subclass of its class whose properties record and pass through to its `__dict__`; a read
  through `vars(module)` is not seen.

  Example:
    >>> lin = torch.nn.Linear(2, 2)
    >>> with attribute_reads(lin) as reads:
    ...   _ = lin(torch.ones(2))
    >>> sorted(reads), type(lin) is torch.nn.Linear
    ([], True)
    >>> with attribute_reads(lin) as reads:
    ...   _ = lin.in_features
    >>> sorted(reads)
    ['in_features']
  """
  reads: set = set()
  swapped = []
  try:
    for path, sub in module.named_modules():
      names = tuple(k for k, v in modules.own_attributes(sub)
                    if not isinstance(v, (torch.Tensor, torch.nn.Module)))
      if names and id(sub) not in _RECORDING:
        _RECORDING[id(sub)] = (path, reads)
        swapped.append((sub, type(sub)))
        sub.__class__ = _recording_class(type(sub), names)
    yield reads
  finally:
    for sub, cls in swapped:
      sub.__class__ = cls
      _RECORDING.pop(id(sub), None)


def _recording_class(cls: type, names: tuple[str, ...]) -> type:
  found = _RECORDING_CLASSES.get((cls, names))
  if found is None:
    found = _RECORDING_CLASSES[(cls, names)] = type(
        cls.__name__, (cls,), {"__module__": cls.__module__,
                               **{name: _recorded(name) for name in names}})
  return found


def _recorded(name: str) -> property:
  def note(module: object) -> None:
    path, reads = _RECORDING.get(id(module), ("", None))
    if reads is not None:
      reads.add(f"{path}.{name}" if path else name)

  def get(module: object) -> Any:
    note(module)
    try:
      return vars(module)[name]
    except KeyError:
      raise AttributeError(name) from None

  def set_(module: object, value: Any) -> None:
    note(module)
    vars(module)[name] = value

  def delete(module: object) -> None:
    note(module)
    del vars(module)[name]

  return property(get, set_, delete)
