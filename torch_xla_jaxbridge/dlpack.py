"""Zero-copy conversions between XLA tensors, CPU tensors and `jax.Array`s, through DLPack.

On the CPU PJRT device all three share one host buffer. Each function makes the unsafe cases
safe: a tensor with pending LazyTensor work is computed first (a DLPack export of it would abort
the process), a non-contiguous CPU tensor or one whose data is not 64-byte aligned is copied
(with a warning, since the result then does not share memory), and a tensor that requires grad
is detached (the result is outside autograd).
"""
import functools
import warnings
from typing import Any

import torch

from torch_xla_jaxbridge import _compat, errors, runtime

_ALIGNMENT = 64  # bytes: PJRT's CPU client aliases host buffers aligned like this, copies others


def xla_to_jax(tensor: torch.Tensor) -> Any:
  """The `jax.Array` sharing `tensor`'s device buffer (an XLA tensor; pending work is run first).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> a = jb.dlpack.xla_to_jax(torch.arange(4.0, device="xla"))
    >>> a.tolist()
    [0.0, 1.0, 2.0, 3.0]
  """
  jax = runtime.jax_module()
  capsule = _exported(tensor, "xla_to_jax")
  fast = _cpu_import()
  return fast(capsule) if fast is not None else jax.dlpack.from_dlpack(capsule)


def jax_to_xla(array: Any) -> torch.Tensor:
  """The XLA tensor sharing `array`'s buffer.

  Example:
    >>> import jax.numpy as jnp, torch_xla_jaxbridge as jb
    >>> jb.dlpack.jax_to_xla(jnp.ones(2)).device.type
    'xla'
  """
  from torch_xla.utils import dlpack as xla_dlpack

  jax = runtime.jax_module()
  if not isinstance(array, jax.Array):
    raise errors.BadArgumentError(f"jax_to_xla: expected a jax.Array, got {type(array).__name__}.")
  return xla_dlpack.from_dlpack(array)


def xla_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
  """The CPU tensor sharing `tensor`'s buffer (an XLA tensor on the CPU PJRT device).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> jb.dlpack.xla_to_cpu(torch.ones(2, device="xla")).device.type
    'cpu'
  """
  return torch.utils.dlpack.from_dlpack(_exported(tensor, "xla_to_cpu"))


def cpu_to_xla(tensor: torch.Tensor) -> torch.Tensor:
  """The XLA tensor sharing a CPU tensor's memory (copied, with a warning, when it cannot).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> jb.dlpack.cpu_to_xla(torch.ones(2)).device.type
    'xla'
  """
  from torch_xla.utils import dlpack as xla_dlpack

  if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
    raise errors.BadArgumentError(
        f"cpu_to_xla: expected a CPU tensor, got "
        f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}.")
  tensor = tensor.detach()
  reason = unshareable(tensor)
  if reason is not None:
    warnings.warn(f"cpu_to_xla: {reason}; it was copied, so the XLA tensor does not share its "
                  f"memory.", stacklevel=2)
    tensor = tensor.clone(memory_format=torch.contiguous_format)
  return xla_dlpack.from_dlpack(tensor)


def unshareable(tensor):
  """Why a CPU tensor's memory cannot be handed to XLA or JAX as it is, or None when it can: both
  import only dense memory aligned to 64 bytes.

  Example:
    >>> import torch
    >>> unshareable(torch.ones(4, 4).t())
    'the tensor is not contiguous'
  """
  if not tensor.is_contiguous():
    return "the tensor is not contiguous"
  if tensor.numel() and tensor.data_ptr() % _ALIGNMENT:
    return (f"the tensor's data is not {_ALIGNMENT}-byte aligned (a view at storage offset "
            f"{tensor.storage_offset()})")
  return None


@functools.cache
def _cpu_import():
  """JAX's own DLPack import onto its CPU device, or None off CPU PJRT or where this JAX lacks it
  (`jax.dlpack.from_dlpack` wraps the same call in slower conversions; docs/performance.md)."""
  to_buffer = _compat.dlpack_cpu_import()
  if to_buffer is None or runtime.lowering_platform() != "cpu":
    return None
  device = runtime.jax_module().devices("cpu")[0]
  return lambda capsule: to_buffer(capsule, device, None)


def _exported(tensor, name):
  """A DLPack capsule of an XLA tensor, after running any pending work that produces it."""
  from torch_xla.utils import dlpack as xla_dlpack

  if not isinstance(tensor, torch.Tensor) or not tensor.is_xla:
    raise errors.BadArgumentError(
        f"{name}: expected an XLA tensor, got "
        f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}; "
        f"use cpu_to_xla for CPU tensors.")
  tensor = tensor.detach()
  _compat.xlac()._xla_sync_multi([tensor], [], True)  # cheap when nothing is pending
  return xla_dlpack.to_dlpack(tensor)
