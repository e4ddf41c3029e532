"""The shardings of XLA tensors under SPMD, read and given: gradients sharded as their inputs.

Sharding propagation alone may leave the gradient of a sharded parameter replicated (a norm
weight's gradient is a sum over the batch); FSDP wants it sharded as the parameter, so bridged
calls, layer stacks and optimizers read their inputs' shardings and give them to what they
compute for those inputs.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_xla_private


def spmd_enabled() -> bool:
  """Whether torch_xla runs SPMD (`torch_xla.runtime.use_spmd()`), read without its imports.

  Example:
    >>> spmd_enabled()  # a single-device run
    False
  """
  return os.environ.get("XLA_USE_SPMD", "").upper() in ("ON", "1", "YES", "TRUE", "Y")


def shardings_of(tensors: Sequence[torch.Tensor]) -> tuple | None:
  """Each XLA tensor's torch_xla `OpSharding` (None where it has none, or for a tensor traced inside
  bridged code), or None when SPMD is off or no tensor is sharded: what `shard_like` gives the
  gradients.

  Example:
    >>> shardings_of([torch.ones(2, device="xla")]) is None  # without SPMD
    True
  """
  if not spmd_enabled():
    return None
  get = torch_xla_private.op_sharding_of
  # traced ones have none yet (is_xla: not in torch's stubs)
  found = tuple(get(t) if t.is_xla else None for t in tensors)  # type: ignore[attr-defined]
  return found if any(s is not None for s in found) else None


def shard_like(tensors: Sequence[torch.Tensor | None], shardings: Sequence | None) -> None:
  """Annotates each XLA tensor with the matching sharding from `shardings_of` (in place).

  Example:
    >>> shard_like([torch.ones(2, device="xla")], None)  # no shardings: nothing to do
  """
  if shardings is None:
    return
  for tensor, sharding in zip(tensors, shardings):
    if sharding is not None and tensor is not None:
      torch_xla_private.mark_sharding(tensor, sharding)


def check_mesh(mesh: Any, where: str) -> None:
  """SPMD on, and `mesh` over every device: what torch_xla asserts on, said with the fix.

  Example:
    >>> import numpy as np, torch_xla.distributed.spmd as xs
    >>> check_mesh(xs.Mesh(np.arange(1), (1,), ("fsdp",)), "f")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torch_xla_jaxbridge.errors.UsageError: f: SPMD is not enabled. ...
  """
  import torch_xla.runtime as xr

  if not spmd_enabled():
    raise errors.UsageError(
        f"{where}: SPMD is not enabled. Call torch_xla.runtime.use_spmd() at the start of the "
        f"program, before any tensor is moved to the XLA device.")
  count = xr.global_runtime_device_count()
  if mesh.size() != count:
    raise errors.UsageError(
        f"{where}: the mesh has {mesh.size()} devices (shape {tuple(mesh.mesh_shape)}) but the "
        f"program runs on {count}. Build the mesh over every device, e.g. xs.Mesh(np.arange("
        f"{count}), ({count},), ('fsdp',)).")
