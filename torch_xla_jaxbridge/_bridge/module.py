"""`BridgeModule`, `PureModule`: a module whose forward is bridged, still the same module.

Structurally identical modules (the layers of a decoder stack) share one bridged function, so
one trace serves them all (`auto.ModuleBridge`).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import auto, hf_checkpointing
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._compat import torch_private


class BridgeModule(torch.nn.Module):
  """Wraps a module so its forward is bridged, while it stays the same module to its callers.

  Parameters, buffers and submodules are the wrapped module's own (the same dictionaries), so
  optimizers, `state_dict()` keys, `.to()`, tied weights and `train()`/`eval()` behave as on the
  wrapped module, and other attributes are read from it. Structurally identical modules (same
  classes, shapes and attribute values, e.g. the layers of a decoder stack) share one trace.
  Non-tensor attributes are read when a signature is first traced. A module that cannot be
  bridged runs as plain LazyTensor code with its own submodules bridged (`fallback=False`:
  raise instead; docs/bridge.md).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layer = jb.BridgeModule(torch.nn.Linear(8, 8).to("xla"))
    >>> layer(torch.randn(2, 8, device="xla")).sum().backward()
    >>> layer.weight.grad.shape
    torch.Size([8, 8])
  """

  def __init__(self, module: torch.nn.Module, *, remat: remat_policies.RematArg = None,
               fallback: bool = True) -> None:
    super().__init__()
    if not isinstance(module, torch.nn.Module):
      raise errors.BadArgumentError(f"module: expected a torch.nn.Module, got {type(module)}.")
    object.__setattr__(self, "_wrapped", module)
    torch_private.share_tables(self, module)
    self.training = module.training
    remat_policies.policy_for(remat)  # validates `remat`
    object.__setattr__(self, "_settings", auto.Settings(type(module).__name__, remat, fallback,
                                                          hooks=True))
    auto.bridge_of(module, self._settings)  # its report row from now on
    hf_checkpointing.take_over(module)  # enabled before wrapping: the bridge recomputes it

  @property
  def wrapped(self) -> torch.nn.Module:
    """The module whose forward is bridged."""
    return self._wrapped

  def forward(self, *args: Any, **kwargs: Any) -> Any:
    # `gradient_checkpointing_enable()` after wrapping sets its flags on this module
    checkpointed = hf_checkpointing.requested(self._wrapped, flags=self)
    return auto.bridge_of(self._wrapped, self._settings).call(args, kwargs, checkpointed)

  def train(self, mode: bool = True) -> BridgeModule:
    self._wrapped.train(mode)
    self.training = mode
    return self

  def __getattr__(self, name: str) -> Any:
    try:
      return super().__getattr__(name)
    except AttributeError:
      return getattr(object.__getattribute__(self, "_wrapped"), name)

  def __getitem__(self, index: Any) -> Any:
    return self._wrapped[index]

  def __len__(self) -> int:
    return len(self._wrapped)

  def __iter__(self) -> Iterator[Any]:
    return iter(self._wrapped)

  def extra_repr(self) -> str:
    return f"bridged: {type(self._wrapped).__name__}"


class PureModule(BridgeModule):
  """Upstream `torch_xla.experimental.assume_pure.PureModule`'s call: a `BridgeModule`.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layer = jb.PureModule(torch.nn.Linear(4, 4).to("xla"))
  """
