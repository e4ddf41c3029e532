"""Ops whose torchax conversion is replaced inside bridged code: `F.linear` (for the form of its
weight gradient) and batch norm (for its running statistics). Registered with `tracing` on import.
"""
import functools
import weakref

import torch

from torch_xla_jaxbridge import _compat, runtime, tracing


def linear(input, weight, bias=None):
  """`F.linear` whose weight gradient is one 2-D matmul over the input's leading dimensions folded
  together, as torch computes it. From torchax's einsum, JAX's weight gradient contracts two
  dimensions at once, and XLA:CPU copied the output gradient into a transposed layout for it
  (docs/performance.md has the measurement). The forward is torchax's einsum.

  Example:
    >>> import torch.nn.functional as F
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(F.linear)(torch.ones(2, 3, device="xla"), torch.ones(4, 3, device="xla")).shape
    torch.Size([2, 4])
  """
  tensor = tracing.torchax_tensor_type()
  if not all(isinstance(t, tensor) for t in (input, weight, bias) if t is not None):
    out = torch.matmul(input, weight.t())  # torchax says what is wrong with the others
    return out if bias is None else out + bias
  out = _folded_linear()(input.jax(), weight.jax())
  if bias is not None:
    out = out + bias.jax()
  return tensor(out, tracing.environment())


@functools.cache
def _folded_linear():
  jax = runtime.jax_module()
  einsum = lambda x, w: jax.numpy.einsum("...a,ba->...b", x, w)  # noqa: E731

  @jax.custom_jvp
  def linear(x, w):
    return einsum(x, w)

  @linear.defjvp
  def linear_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    by_weight = jax.numpy.dot(_fold(x), dw.T).reshape(*x.shape[:-1], w.shape[0])
    return einsum(x, w), einsum(dx, w) + by_weight

  return linear


def _fold(x):
  """`x` with its leading dimensions folded: the same array for the same `x` within one
  `run_torch` call, so linears sharing an input (q, k, v) keep one copy of it for the backward.
  Held weakly: a traced value lives as long as the jaxpr trace that made it (which reports any
  other holder as a leak); where nothing keeps the fold alive, the next linear folds again."""
  folds = tracing.scoped_cache("linear_folds")
  cached = folds.get(id(x))
  if cached is not None and cached[0]() is x:
    folded = cached[1]()
    if folded is not None:
      return folded
  folded = x.reshape(-1, x.shape[-1])
  try:
    folds[id(x)] = (weakref.ref(x), weakref.ref(folded))
  except TypeError:  # a concrete array: nothing to share
    pass
  return folded


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
  """Batch norm that updates the running statistics in place, as torch does (torchax's drops
  the update), with the unbiased batch variance for `running_var`.

  Example:
    >>> from torch_xla_jaxbridge import BridgeModule
    >>> bn = BridgeModule(torch.nn.BatchNorm1d(2).to("xla"))
    >>> _ = bn(torch.tensor([[0.0, 1.0], [2.0, 3.0]], device="xla"))
    >>> bn.running_mean.cpu().tolist()
    [0.10000000149011612, 0.20000000298023224]
  """
  jax = runtime.jax_module()
  import torchax.tensor

  array = lambda t: None if t is None else t.jax()  # noqa: E731
  x = array(input)
  out, mean, rstd = _compat.batch_norm_forward(
      x, array(weight), array(bias), array(running_mean), array(running_var), training, momentum,
      eps)
  if training and running_mean is not None:
    axes = [0] + list(range(2, x.ndim))
    count = x.size // x.shape[1]
    unbiased = jax.numpy.var(x, axis=axes) * count / max(count - 1, 1)
    for stat, batch in ((running_mean, mean), (running_var, unbiased)):
      _compat.set_array(stat, ((1 - momentum) * stat.jax() + momentum * batch).astype(
          stat.jax().dtype))
  env = tracing.environment()
  return tuple(torchax.tensor.Tensor(a, env) for a in (out, mean, rstd))


for _op in (torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.native_batch_norm):
  tracing.register_op_override(_op, batch_norm)
tracing.register_op_override(torch.nn.functional.linear, linear)
