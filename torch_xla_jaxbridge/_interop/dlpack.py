"""Zero-copy conversions between XLA tensors, CPU tensors and `jax.Array`s, through DLPack.

On the CPU PJRT device all three share one host buffer. Each function makes the unsafe cases
safe: a tensor with pending LazyTensor work is computed first (a DLPack export of it would abort
the process), a non-contiguous CPU tensor or one whose data is not 64-byte aligned is copied
(with a warning, since the result then does not share memory). The four conversions detach (their
results are outside autograd); `to_cpu` and `to_xla` are the same moves inside autograd: the
gradient moves back through DLPack too.
"""
import warnings
from typing import Any

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import jax_private, torch_private, torch_xla_private
from torch_xla_jaxbridge._core import runtime, threads

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
  _check_cpu(tensor, "cpu_to_xla")
  _warn_if_copied(tensor, "cpu_to_xla")
  return _cpu_share(tensor)


def to_cpu(tensor: torch.Tensor, *, check_in_place: bool = True) -> torch.Tensor:
  """`xla_to_cpu` inside autograd: the CPU tensor sharing an XLA tensor's buffer, whose gradient
  moves back to the XLA side through DLPack as well (sharing memory; copied first, silently, only
  when the gradient is not contiguous or not 64-byte aligned).

  An in-place change to the result before backward raises `MutationError` there (it changes the
  XLA tensor too); `check_in_place=False` allows it, for an XLA tensor nothing else reads.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> w = torch.ones(3, device="xla", requires_grad=True)
    >>> c = jb.dlpack.to_cpu(w * 2)
    >>> c.device.type, c.requires_grad
    ('cpu', True)
    >>> (c * torch.arange(3.0)).sum().backward()
    >>> w.grad.cpu().tolist()
    [0.0, 2.0, 4.0]
  """
  _check_xla(tensor, "to_cpu", "to_xla")
  return _Move.apply(tensor, _xla_share, _cpu_share, check_in_place)


def to_xla(tensor: torch.Tensor) -> torch.Tensor:
  """`cpu_to_xla` inside autograd: the XLA tensor sharing a CPU tensor's memory (copied, with a
  warning, when it cannot), whose gradient moves back to the CPU side through DLPack as well.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> w = torch.ones(3, requires_grad=True)
    >>> x = jb.dlpack.to_xla(w * 2)
    >>> x.device.type, x.requires_grad
    ('xla', True)
    >>> (x * torch.arange(3.0, device="xla")).sum().backward()
    >>> w.grad.tolist()
    [0.0, 2.0, 4.0]
  """
  _check_cpu(tensor, "to_xla")
  _warn_if_copied(tensor, "to_xla")
  return _Move.apply(tensor, _cpu_share, _xla_share, True)


class _Move(torch.autograd.Function):
  """A tensor moved through DLPack (`there`: same memory, other device); its gradient moves back
  the other way (`back`), itself as a `_Move`, so a second derivative moves too.

  The CPU side is saved so that autograd's version check sees an in-place change to it before
  backward: the XLA side shares that memory (values it saved for backward would change unseen).
  In-place ops on the XLA side write new buffers, so they cannot change the CPU side.
  """

  @staticmethod
  def forward(ctx, tensor, there, back, check):
    ctx.there, ctx.back = there, back
    moved = there(tensor)
    if check:
      ctx.save_for_backward(tensor if tensor.device.type == "cpu" else moved)
    return moved

  @staticmethod
  def backward(ctx, grad):
    try:
      ctx.saved_tensors  # raises if the CPU side was changed in place
    except RuntimeError as e:
      if not torch_private.is_saved_tensor_modified_error(e):
        raise
      raise errors.MutationError(
          "to_cpu/to_xla: the CPU tensor of a move was changed in place before backward; it "
          "shares memory with the XLA tensor, so values saved for backward on the XLA side "
          "changed too and the gradients would be wrong. Change a copy instead: "
          "to_cpu(x).clone(), or to_xla(t.clone()).") from e
    return _Move.apply(grad, ctx.back, ctx.there, True), None, None, None


def _xla_share(tensor):
  """The CPU tensor on an XLA tensor's buffer (pending work run first)."""
  moved = torch.utils.dlpack.from_dlpack(_exported(tensor, "to_cpu"))
  if moved.device.type != "cpu":  # a GPU PJRT device: DLPack gives a CUDA tensor (docs/dlpack.md)
    raise errors.BadArgumentError(
        f"to_cpu/to_xla: the XLA tensor lives on a {moved.device.type} device, where DLPack gives "
        f"a {moved.device.type} tensor and torch_xla imports only CPU tensors through DLPack, so "
        f"the move could not be undone in backward; use xla_to_cpu (no gradient) or .cpu() (a "
        f"copy).")
  return moved


def _cpu_share(tensor):
  """The XLA tensor on a CPU tensor's memory; a silent copy when that memory cannot be shared
  (callers that the user called warn first; gradients are laid out by autograd, not the user)."""
  from torch_xla.utils import dlpack as xla_dlpack

  return xla_dlpack.from_dlpack(shareable(tensor))


def shareable(tensor):
  """A CPU tensor as XLA and JAX can import it: detached, and copied to dense memory only when
  `unshareable` says its own cannot be handed over.

  Example:
    >>> import torch
    >>> t = torch.ones(4, 4)
    >>> shareable(t).data_ptr() == t.data_ptr(), shareable(t.t()).is_contiguous()
    (True, True)
  """
  tensor = tensor.detach()
  if unshareable(tensor) is not None:
    tensor = tensor.clone(memory_format=torch.contiguous_format)
  return tensor


def _warn_if_copied(tensor, name):
  reason = unshareable(tensor)
  if reason is not None:
    warnings.warn(f"{name}: {reason}; it was copied, so the XLA tensor does not share its "
                  f"memory.", stacklevel=3)


def _check_cpu(tensor, name):
  if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
    raise errors.BadArgumentError(
        f"{name}: expected a CPU tensor, got "
        f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}.")


def _check_xla(tensor, name, cpu_name):
  if not isinstance(tensor, torch.Tensor) or not tensor.is_xla:  # type: ignore[attr-defined]
    raise errors.BadArgumentError(
        f"{name}: expected an XLA tensor, got "
        f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}; "
        f"use {cpu_name} for CPU tensors.")


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


@threads.once
def _cpu_import():
  """JAX's own DLPack import onto its CPU device, or None off CPU PJRT or where this JAX lacks it
  (`jax.dlpack.from_dlpack` wraps the same call in slower conversions; docs/performance.md)."""
  to_buffer = jax_private.dlpack_cpu_import()
  if to_buffer is None or runtime.lowering_platform() != "cpu":
    return None
  device = runtime.jax_module().devices("cpu")[0]
  return lambda capsule: to_buffer(capsule, device, None)


def _exported(tensor, name):
  """A DLPack capsule of an XLA tensor, after running any pending work that produces it."""
  from torch_xla.utils import dlpack as xla_dlpack

  _check_xla(tensor, name, "cpu_to_xla")
  tensor = tensor.detach()
  torch_xla_private.sync_tensors([tensor])  # cheap when nothing is pending
  return xla_dlpack.to_dlpack(tensor)
