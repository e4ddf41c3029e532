"""Batch norm inside bridged code: torch's values and running statistics, a closed-form backward.

torchax's conversion, with the running variance computed again for the update, reduced over the
activation five times in the forward, and JAX's autodiff through its `jnp.mean` and `jnp.var` five
times more in the backward, where torch's closed form (and XLA's batch-norm-grad) reduces twice
each way: on XLA:CPU a (2, 256, 56, 56) batch norm's forward and backward took 23 ms against 10
ms (docs/performance.md). Here training-mode normalisation is a `jax.custom_vjp` with that closed
form: given the cotangent `g` of the output and `x_hat = (x - mean) * rstd`,
`grad_x = weight * rstd * (g - sum(g) / n - x_hat * sum(g * x_hat) / n)` (plus the terms of any
cotangent of the batch mean and variance). Statistics are computed in float32 for lower-precision
inputs, as torch does, and the running statistics are updated in place as torch updates them
(torchax drops the update), with the unbiased batch variance for `running_var`.
"""
import functools

import torch

from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import runtime, threads, tracing


def _channel(v, ndim):
  """A per-channel vector shaped to broadcast over (batch, channel, spatial...)."""
  return v.reshape((1, -1) + (1,) * (ndim - 2))


def _statistics(x):
  """`(mean, biased variance)` per channel, in two passes as torch computes them."""
  jnp = runtime.jax_module().numpy
  axes = (0, *range(2, x.ndim))
  mean = jnp.mean(x, axis=axes)
  return mean, jnp.mean(jnp.square(x - _channel(mean, x.ndim)), axis=axes)


def _normalized(x, weight, bias, eps):
  """`((out, mean, var), residuals)` of training-mode batch norm: `out` in `x`'s dtype, the
  statistics in `weight`'s (the compute dtype, at least float32)."""
  jax = runtime.jax_module()
  mean, var = _statistics(x.astype(weight.dtype))
  rstd = jax.lax.rsqrt(var + eps)
  out = (x - _channel(mean, x.ndim)) * _channel(rstd * weight, x.ndim) + _channel(bias, x.ndim)
  return (out.astype(x.dtype), mean, var), (x, weight, mean, rstd)


def _backward(eps, residuals, cotangents):
  x_in, weight, mean, rstd = residuals
  x, g = (a.astype(weight.dtype) for a in (x_in, cotangents[0]))
  g_mean, g_var = cotangents[1:]
  n = x.size // x.shape[1]
  axes = (0, *range(2, x.ndim))
  centered = x - _channel(mean, x.ndim)
  x_hat = centered * _channel(rstd, x.ndim)
  g_bias, g_weight = g.sum(axis=axes), (g * x_hat).sum(axis=axes)
  g_x = _channel(weight * rstd, x.ndim) * (
      g - _channel(g_bias / n, x.ndim) - x_hat * _channel(g_weight / n, x.ndim))
  g_x = g_x + _channel(g_mean / n, x.ndim) + centered * _channel(2 * g_var / n, x.ndim)
  return g_x.astype(x_in.dtype), g_weight, g_bias


@threads.once
def normalize_fn():
  """Training-mode normalisation over every axis but 1 with the closed-form backward,
  `normalize(x, weight, bias, eps) -> (out, mean, var)`: `out` in `x`'s dtype, the statistics in
  `weight`'s (layer and group norm use it too: `low_precision`)."""
  jax = runtime.jax_module()

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def normalize(x, weight, bias, eps):
    return _normalized(x, weight, bias, eps)[0]

  normalize.defvjp(_normalized, _backward)
  return normalize


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
  """`aten.native_batch_norm` on torchax tensors: `(out, mean, rstd)` as torch returns them
  (empty statistics in eval mode), the running statistics updated in place in training.

  Example:
    >>> from torch_xla_jaxbridge import BridgeModule
    >>> bn = BridgeModule(torch.nn.BatchNorm1d(2).to("xla"))
    >>> _ = bn(torch.tensor([[0.0, 1.0], [2.0, 3.0]], device="xla"))
    >>> bn.running_mean.cpu().tolist()
    [0.10000000149011612, 0.20000000298023224]
  """
  jax = runtime.jax_module()
  jnp = jax.numpy
  import torchax.tensor

  x = input.jax()
  compute = jnp.promote_types(x.dtype, jnp.float32)
  channels = x.shape[1]
  w = jnp.ones(channels, compute) if weight is None else weight.jax().astype(compute)
  b = jnp.zeros(channels, compute) if bias is None else bias.jax().astype(compute)
  if training:
    out, mean, var = normalize_fn()(x, w, b, float(eps))
    rstd = jax.lax.rsqrt(var + eps)
    if running_mean is not None:
      count = x.size // channels
      unbiased = var * count / max(count - 1, 1)
      for stat, batch in ((running_mean, mean), (running_var, unbiased)):
        torchax_private.set_array(stat, ((1 - momentum) * stat.jax() + momentum * batch).astype(
            stat.jax().dtype))
  else:
    mean, rstd = (jnp.zeros((0,), compute),) * 2
    scale = jax.lax.rsqrt(running_var.jax().astype(compute) + eps) * w
    out = ((x.astype(compute) - _channel(running_mean.jax().astype(compute), x.ndim)) *
           _channel(scale, x.ndim) + _channel(b, x.ndim)).astype(x.dtype)
  env = tracing.environment()
  return tuple(torchax.tensor.Tensor(a, env) for a in (out, mean, rstd))


for _op in (torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.native_batch_norm):
  tracing.register_op_override(_op, batch_norm)
