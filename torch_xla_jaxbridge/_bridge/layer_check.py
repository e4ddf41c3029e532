"""The check that the layers of a stack (`scan_layers`, `StackedLayers`) are identical where it
matters, since the scan runs every layer as layers[0]: the same classes, parameters and buffers,
and equal values of the attributes their traced forward reads (a layer index that training never
reads may differ). The first difference that matters is an error that names it."""
from __future__ import annotations

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import modules


def identical(layers: list, caller: str = "scan_layers") -> dict:
  """Raises `errors.BadValueError` naming the first difference between `layers[0]` and another
  layer in class, parameter and buffer names, shapes and dtypes. Returns the attributes that
  differ (by path, each with a sentence naming the first layer where it does): the scan runs
  every layer with `layers[0]`'s, which is right as long as the layer's forward does not read
  them (`refuse_read`, once the forward is traced).

  Example:
    >>> import torch
    >>> identical([torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)])
    Traceback (most recent call last):
    ...
    torch_xla_jaxbridge.errors.BadValueError: scan_layers: Shape mismatch: layers[1] 'weight' is parameter (3, 2) torch.float32, but in layers[0] it is parameter (2, 2) torch.float32; every layer must have the same parameters and buffers.
    >>> conv = lambda d: torch.nn.Conv1d(2, 2, 3, padding=d, dilation=d)
    >>> list(identical([conv(1), conv(2)]))
    ['dilation', 'padding', '_reversed_padding_repeated_twice']
  """
  first = layers[0]
  reference = _describe(first)
  differences: dict = {}
  for i, layer in enumerate(layers[1:], start=1):
    if type(layer) is not type(first):
      raise errors.BadValueError(
          f"{caller}: mismatched keys: layers[{i}] is a {type(layer).__name__}, layers[0] a "
          f"{type(first).__name__}; every layer must have the same structure.")
    described = _describe(layer)
    for name in list(reference) + [k for k in described if k not in reference]:
      if reference.get(name) != described.get(name):
        what = ("mismatched keys" if name not in reference or name not in described else
                "Shape mismatch" if _shape(reference[name]) != _shape(described[name]) else
                "mismatch")
        raise errors.BadValueError(
            f"{caller}: {what}: layers[{i}] {name!r} is {described.get(name, 'missing')}, but "
            f"in layers[0] it is {reference.get(name, 'missing')}; every layer must have the "
            f"same parameters and buffers.")
    for name in modules.attribute_differences(first, layer):
      differences.setdefault(name, f"layers[{i}] {name!r} is {_attribute(layer, name)!r}, but "
                                   f"in layers[0] it is {_attribute(first, name)!r}")
  return differences


def refuse_read(differences: dict, reads: set, caller: str = "scan_layers") -> None:
  """Raises `errors.BadValueError` for the first attribute that differs between the layers
  (`identical`'s result) and that the layer's traced forward read (`reads`,
  `_core.attribute_reads`).

  Example:
    >>> refuse_read({"self_attn.layer_idx": "layers[1] 'self_attn.layer_idx' is 1, but in "
    ...              "layers[0] it is 0"}, {"mlp.act"})  # not read: nothing to refuse
  """
  for name, said in differences.items():
    if name in reads:
      raise errors.BadValueError(
          f"{caller}: {said}, and the layer's forward reads it; the scan runs every layer with "
          f"layers[0]'s attributes, so those it reads must be equal. Run layers that differ in "
          f"{name!r} unrolled (e.g. each in its own jb.BridgeModule).")


def _describe(layer: torch.nn.Module) -> dict[str, str]:
  """What must match between layers besides attributes: tensors, and each submodule's class."""
  described = {}
  for kind, items in (("parameter", layer.named_parameters()), ("buffer", layer.named_buffers())):
    for name, t in items:
      described[name] = f"{kind} {tuple(t.shape)} {t.dtype}"
  for name, sub in layer.named_modules():
    described[f"{name or '<layer>'} class"] = type(sub).__name__
  return described


def _shape(description: str) -> str:
  return description[description.find("("):description.find(")") + 1]


def _attribute(module: torch.nn.Module, path: str) -> object:
  owner, _, name = path.rpartition(".")
  return getattr(module.get_submodule(owner), name, "missing")


def unshared(layers: list) -> None:
  """Layers sharing a parameter would each get their own copy in the stack: refused.

  Example:
    >>> import torch
    >>> shared = torch.nn.Linear(2, 2)
    >>> unshared([shared, torch.nn.Linear(2, 2)])  # fine
    >>> unshared([shared, shared])
    Traceback (most recent call last):
    ...
    torch_xla_jaxbridge.errors.BadArgumentError: StackedLayers: layers[1] 'weight' is the same parameter as layers[0] 'weight'; stacking would give each layer its own copy. Use jb.scan_layers for layers that share parameters.
  """
  owner: dict[int, tuple[int, str]] = {}
  for i, layer in enumerate(layers):
    for name, param in layer.named_parameters():
      first = owner.setdefault(id(param), (i, name))
      if first[0] != i:
        raise errors.BadArgumentError(
            f"StackedLayers: layers[{i}] {name!r} is the same parameter as layers[{first[0]}] "
            f"{first[1]!r}; stacking would give each layer its own copy. Use jb.scan_layers "
            f"for layers that share parameters.")
