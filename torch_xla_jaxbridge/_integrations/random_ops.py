"""Random ops whose torchax conversion draws the wrong numbers, drawn as torch draws them.

torchax's `exponential_` returned its input unchanged, from a fixed key (so `F.gumbel_softmax`
gave NaN), `cauchy_` left its input as it was, `random_(from, to)` drew `to` too, and
`torch.normal(mean, std)` with tensors swapped the two: silently wrong numbers in bridged code.
`normal_(mean, std)` failed to convert (the region fell back). Here each draws from the trace's
key, as every other random op does, with torch's distribution and in the target's dtype.
"""
from typing import Any

import torch

from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import runtime, tracing


def _key() -> Any:
  return tracing.environment().get_and_rotate_prng_key()


def _fill(target: Any, draw: Any) -> Any:
  """`target` with `draw(key, shape, dtype)` written into it (a float dtype for the draw)."""
  jnp = runtime.jax_module().numpy
  dtype = target.jax().dtype
  floating = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
  values = draw(_key(), tuple(target.shape), floating).astype(dtype)
  torchax_private.write_into(target, tracing.to_torchax(values))
  return target


def exponential_(input: Any, lambd: float = 1.0, *, generator: Any = None) -> Any:
  """`Tensor.exponential_`: samples of rate `lambd`.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda x: torch.zeros(1000, device=x.device).exponential_(2.0))(
    ...     torch.ones(1, device="xla"))
    >>> bool(0.3 < out.mean().item() < 0.7)
    True
  """
  jax = runtime.jax_module()
  return _fill(input, lambda key, shape, dtype: jax.random.exponential(key, shape, dtype) / lambd)


def cauchy_(input: Any, median: float = 0.0, sigma: float = 1.0, *, generator: Any = None) -> Any:
  """`Tensor.cauchy_`: samples of a Cauchy distribution.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda x: torch.zeros(1000, device=x.device).cauchy_())(
    ...     torch.ones(1, device="xla"))
    >>> bool((out != 0).all())
    True
  """
  jax = runtime.jax_module()
  return _fill(input, lambda key, shape, dtype: median + sigma * jax.random.cauchy(key, shape,
                                                                                   dtype))


def random_from(input: Any, low: int, high: int | None, *, generator: Any = None) -> Any:
  """`Tensor.random_(from, to)`: integers in `[from, to)`. With `to` None (torch's widest range
  for the dtype) it raises, and the region falls back.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda x: torch.zeros(1000, device=x.device).random_(0, 3))(
    ...     torch.ones(1, device="xla"))
    >>> sorted(set(out.cpu().tolist()))
    [0.0, 1.0, 2.0]
  """
  if high is None:
    raise NotImplementedError("random_(from, None) inside bridged code")
  jax = runtime.jax_module()
  return _fill(input, lambda key, shape, dtype: jax.random.randint(key, shape, low, high))


def random_to(input: Any, high: int, *, generator: Any = None) -> Any:
  """`Tensor.random_(to)`: integers in `[0, to)`.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda x: torch.zeros(1000, device=x.device).random_(2))(
    ...     torch.ones(1, device="xla"))
    >>> sorted(set(out.cpu().tolist()))
    [0.0, 1.0]
  """
  return random_from(input, 0, high)


def normal_(input: Any, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> Any:
  """`Tensor.normal_(mean, std)`.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda x: torch.zeros(4000, device=x.device).normal_(2.0, 3.0))(
    ...     torch.ones(1, device="xla"))
    >>> bool(1.7 < out.mean().item() < 2.3 and 2.7 < out.std().item() < 3.3)
    True
  """
  jax = runtime.jax_module()
  return _fill(input, lambda key, shape, dtype: mean + std * jax.random.normal(key, shape, dtype))


def normal(mean: Any, std: Any = 1.0, *, generator: Any = None) -> Any:
  """`torch.normal(mean, std)` with a tensor mean or std (or both), broadcast together.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> out = bridge(lambda m, s: torch.normal(m, s))(torch.zeros(4000, device="xla"),
    ...                                              torch.full((4000,), 2.0, device="xla"))
    >>> bool(-0.3 < out.mean().item() < 0.3 and 1.7 < out.std().item() < 2.3)
    True
  """
  jax = runtime.jax_module()
  jnp = jax.numpy
  m, s = (tracing.to_jax(v) if isinstance(v, torch.Tensor) else v for v in (mean, std))
  dtype = jnp.result_type(*(v for v in (m, s) if hasattr(v, "dtype")))
  shape = jnp.broadcast_shapes(jnp.shape(m), jnp.shape(s))
  return tracing.to_torchax(m + s * jax.random.normal(_key(), shape, dtype))


tracing.register_op_override(torch.ops.aten.exponential_.default, exponential_)
tracing.register_op_override(torch.ops.aten.cauchy_.default, cauchy_)
tracing.register_op_override(getattr(torch.ops.aten.random_, "from"), random_from)
tracing.register_op_override(torch.ops.aten.random_.to, random_to)
tracing.register_op_override(torch.ops.aten.normal_.default, normal_)
for _overload in ("Tensor_Tensor", "Tensor_float", "float_Tensor"):
  tracing.register_op_override(getattr(torch.ops.aten.normal, _overload), normal)
