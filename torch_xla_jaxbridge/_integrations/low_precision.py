"""Layer norm, group norm and the sigmoid-family activations on bfloat16/float16 inside bridged
code, with torch_xla's precision.

torchax converts them in the input's dtype: `jnp.mean`/`jnp.var` rounded to bfloat16, then the
centring, the scaling and the affine each rounded again. torch_xla runs torch's decomposition:
layer and group norm as a batch norm of the input (`aten::native_batch_norm`, which XLA computes
in float32 and rounds once to the input's dtype), then the affine in the dtype of the input and
the weights together (float32 for float32 weights); here the same, through `batch_norm`'s
normalisation. GELU, SiLU and sigmoid are computed in float32 and rounded once, as torch's own
kernels compute them (their "opmath" type); torch_xla's come within one rounding of that. None
of these ops is in torch_xla's autocast lists (`autocast.XLA_POLICY`): the difference was the
conversion's, with or without autocast. float32 and float64 inputs compute as before. The
errors, against the op computed in float32, are in docs/bridge.md ("Precision").
"""
import math

import torch

from torch_xla_jaxbridge._core import runtime, tracing
from torch_xla_jaxbridge._integrations import batch_norm

_LOW = ("bfloat16", "float16")


def _tensors(*arrays):
  return tracing.to_torchax(arrays)


def _rows_normalized(x, rows, eps):
  """`x` normalised over each of its `rows` equal rows, as torch_xla's batch norm of `x` viewed as
  `(1, rows, -1)`: `(out, mean, rstd)`, `out` in `x`'s dtype, the statistics in float32 (or
  wider)."""
  jax = runtime.jax_module()
  jnp = jax.numpy
  compute = jnp.promote_types(x.dtype, jnp.float32)
  ones, zeros = jnp.ones(rows, compute), jnp.zeros(rows, compute)
  out, mean, var = batch_norm.normalize_fn()(x.reshape(1, rows, -1), ones, zeros, float(eps))
  return out.reshape(x.shape), mean, jax.lax.rsqrt(var + eps)


def _affine(out, weight, bias, shape):
  """torch's `bias.addcmul(out, weight)` (or the one of them given), in the promoted dtype."""
  jnp = runtime.jax_module().numpy
  given = [t.jax().reshape(shape) for t in (weight, bias) if t is not None]
  dtype = jnp.result_type(out, *given)
  out = out.astype(dtype)
  if weight is not None:
    out = out * given[0].astype(dtype)
  if bias is not None:
    out = out + given[-1].astype(dtype)
  return out


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
  """`aten.native_layer_norm` on torchax tensors: `(out, mean, rstd)` as torch_xla computes them.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> norm = bridge(torch.nn.functional.layer_norm)
    >>> norm(torch.tensor([[1.0, 3.0]], device="xla").bfloat16(), (2,)).cpu()
    tensor([[-1.,  1.]], dtype=torch.bfloat16)
  """
  x = input.jax()
  inner = math.prod(normalized_shape)
  out, mean, rstd = _rows_normalized(x, x.size // inner if inner else 0, eps)
  out = _affine(out, weight, bias, tuple(normalized_shape))
  stats = x.shape[:x.ndim - len(normalized_shape)] + (1,) * len(normalized_shape)
  return _tensors(out, mean.reshape(stats), rstd.reshape(stats))


def group_norm(input, weight, bias, N, C, HxW, group, eps):  # noqa: N803  (aten's names)
  """`aten.native_group_norm` on torchax tensors: `(out, mean, rstd)` as torch_xla computes them.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> norm = bridge(lambda x: torch.nn.functional.group_norm(x, 1))
    >>> norm(torch.tensor([[1.0, 3.0]], device="xla").bfloat16()).cpu()
    tensor([[-1.,  1.]], dtype=torch.bfloat16)
  """
  del C, HxW  # read from the input's shape
  x = input.jax()
  out, mean, rstd = _rows_normalized(x, N * group, eps)
  out = _affine(out, weight, bias, (1, -1) + (1,) * (x.ndim - 2))
  return _tensors(out, *(s.reshape(N, group).astype(x.dtype) for s in (mean, rstd)))


def _activation(fn):
  """An elementwise op on torchax tensors, computed in float32 and rounded to the input's dtype
  where that is bfloat16 or float16 (otherwise as torchax computes it)."""
  def activation(input, *args, **kwargs):
    x = input.jax()
    if x.dtype not in _LOW:
      return _tensors(fn(x, *args, **kwargs))[0]
    return _tensors(fn(x.astype("float32"), *args, **kwargs).astype(x.dtype))[0]
  return activation


def _gelu(x, approximate="none"):
  return runtime.jax_module().nn.gelu(x, approximate == "tanh")


def _silu(x):
  return runtime.jax_module().nn.silu(x)


def _sigmoid(x):
  return runtime.jax_module().nn.sigmoid(x)


# each overload and its packet (a direct `torch.ops.aten.native_layer_norm(...)` names the packet)
for _packet, _impl in ((torch.ops.aten.native_layer_norm, layer_norm),
                       (torch.ops.aten.native_group_norm, group_norm),
                       (torch.ops.aten.gelu, _activation(_gelu)),
                       (torch.ops.aten.silu, _activation(_silu)),
                       (torch.ops.aten.sigmoid, _activation(_sigmoid))):
  tracing.register_op_override(_packet, _impl)
  tracing.register_op_override(_packet.default, _impl)
