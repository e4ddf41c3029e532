"""In-place aten ops write their result into the tensor they update, views included.

torchax converts some in-place ops by functional ones that return a new tensor: on a view
(`buf[1].fill_(0)`, `x[:, 0].masked_fill_(m, 0)`, `v.zero_()`, `lerp_`, `addcmul_`,
`index_fill_`) the write never reached the viewed tensor, so the caller's tensor kept its old
value, silently. Others have no conversion at all (`neg_`, `exp_`, `abs_`, `floor_`, ...: the
region fell back). Here such an op writes its result through the view, and an in-place op with no
conversion runs its functional form and writes the result into its target. An indexed
assignment (`y[0] = v`, torchax's `__setitem__`, not an op its dispatch sees) made under
`torch.no_grad()` keeps `y`'s gradient path, as the ops do (`grad_reads.keep_gradient_path`).
"""
from __future__ import annotations

from typing import Any, Callable

from torch_xla_jaxbridge._compat import torch_dispatch_private, torchax_private
from torch_xla_jaxbridge._core import grad_reads, patching, torch_dtypes, tracing


def _dispatch(dispatch: Callable, func: Any, types: Any, args: Any, kwargs: dict | None) -> Any:
  """torchax's conversion of one op; for an in-place aten op, its result written into the
  tensor it updates (its first argument).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> def zero_row(buf):
    ...   buf[1].fill_(0.0)
    ...   return buf.neg_().sum()
    >>> buf = torch.ones(2, 2, device="xla")
    >>> jb.bridge(zero_row, fallback=False)(buf).item(), buf.cpu().tolist()
    (-2.0, [[-1.0, -1.0], [-0.0, -0.0]])
  """
  functional = torch_dispatch_private.functional_of_in_place(func)
  if functional is None or not args:
    return dispatch(func, types, args, kwargs)
  target = args[0]
  try:
    out = dispatch(func, types, args, kwargs)
  except torchax_private.operator_not_found():
    out = dispatch(functional, types, args, kwargs)  # no conversion: the functional form
    _write(target, out)
    return target
  if out is not target and torchax_private.view_source(target) is not None:
    _write(target, out)  # a conversion that returned a copy of the view
    return target
  return out


def _write(target: Any, out: Any) -> None:
  """`out` written into `target`; refused as torch refuses it where `out`'s dtype cannot be cast
  to `target`'s (`int_tensor.exp_()`): the region falls back, where torch raises."""
  refusal = torch_dtypes.cast_refusal(out.dtype, target.dtype)
  if refusal is not None:
    raise RuntimeError(refusal)
  torchax_private.write_into(target, out)


def _assignment_patch(owner: Callable[[], type | None]) -> patching.Patch:
  """A patch of `owner()`'s `__setitem__` that, under `torch.no_grad()` inside a trace, keeps
  the gradient path of the tensor it writes."""
  def __setitem__(self: Any, key: Any, value: Any) -> None:
    original = patch.original("__setitem__")
    if not (patch.active() and grad_reads.cutting()):
      return original(self, key, value)
    before = grad_reads.arrays_of((self,))
    original(self, key, value)
    grad_reads.keep_gradient_path(before)
    return None

  patch = patching.Patch(lambda: [owner()], {"__setitem__": __setitem__})
  return patch


tracing.register_dispatch_wrapper(_dispatch)
_ASSIGNMENTS = (_assignment_patch(tracing.torchax_tensor_type),
                _assignment_patch(torchax_private.view_type))
tracing.register_trace_context(lambda: _ASSIGNMENTS[0])
tracing.register_trace_context(lambda: _ASSIGNMENTS[1])
