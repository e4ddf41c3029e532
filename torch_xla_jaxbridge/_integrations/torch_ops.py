"""The package's own conversions of torch ops inside bridged code, where torchax's differ from torch.

Always on, registered with `tracing` on import: `F.linear` (for the form of its weight
gradient), `linalg_vector_norm` and `frobenius_norm` (torch's meaning of an empty `dim`; torchax
lacks the second), `F.scaled_dot_product_attention` (torch's math form, every argument) and
`torch.allclose` (a Python bool, as torch returns), Cholesky (torch's triangle read and
gradient), `polygamma` and `digamma` (right for negative inputs), `searchsorted` (every
argument), `_safe_softmax` (no NaN gradient for a row all -inf).
Batch norm has its own module (`batch_norm`).
"""
import math
import weakref

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import dtypes, runtime, threads, tracing


def linear(input, weight, bias=None):
  """`F.linear` whose weight gradient is one 2-D matmul over the input's leading dimensions folded
  together, as torch computes it. From torchax's einsum, JAX's weight gradient contracts two
  dimensions at once, and XLA:CPU copied the output gradient into a transposed layout for it
  (docs/performance.md has the measurement). The forward is one `dot_general`.

  Example:
    >>> import torch.nn.functional as F
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(F.linear)(torch.ones(2, 3, device="xla"), torch.ones(4, 3, device="xla")).shape
    torch.Size([2, 4])
  """
  tensor = tracing.torchax_tensor_type()
  assert tensor is not None, "an override runs while torch code is traced"
  if not all(isinstance(t, tensor) for t in (input, weight, bias) if t is not None):
    out = torch.matmul(input, weight.t())  # torchax says what is wrong with the others
    return out if bias is None else out + bias
  out = _folded_linear()(input.jax(), weight.jax())
  if bias is not None:
    out = out + bias.jax()
  return tensor(out, tracing.environment())


@threads.once
def _folded_linear():
  jax = runtime.jax_module()

  def contract(x, w):
    """x's last dimension against w's second, in their promoted dtype: what
    einsum("...a,ba->...b", x, w) computes, traced without einsum's contraction planning."""
    dtype = jax.numpy.result_type(x, w)
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype),
                               (((x.ndim - 1,), (1,)), ((), ())))

  @jax.custom_jvp
  def linear(x, w):
    return contract(x, w)

  @linear.defjvp
  def linear_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    by_weight = jax.numpy.dot(_fold(x), dw.T).reshape(*x.shape[:-1], w.shape[0])
    return contract(x, w), contract(dx, w) + by_weight

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


def vector_norm(input, ord=2, dim=None, keepdim=False, *, dtype=None):
  """`aten::linalg_vector_norm` as torch computes it: no `dim` (`None` or empty, as `torch.norm(x)`
  passes on XLA tensors) reduces every dimension, where torchax reduces none; a zero vector's
  2-norm has gradient zero, where JAX's square root gives NaN.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(lambda x: x.norm())(torch.full((4,), 2.0, device="xla")).item()
    4.0
  """
  jnp = runtime.jax_module().numpy
  x = input.jax() if dtype is None else input.jax().astype(dtypes.to_jax(dtype))
  axis = None if dim is None or dim == [] or dim == () else dim
  size = jnp.abs(x)
  if ord in (math.inf, -math.inf):
    out = (size.max if ord > 0 else size.min)(axis, keepdims=keepdim)
  elif ord == 0:
    out = (x != 0).sum(axis, keepdims=keepdim).astype(size.dtype)
  else:
    total = (size ** ord).sum(axis, keepdims=keepdim)
    safe = jnp.where(total == 0, 1, total)  # the root's gradient at zero: zero, as torch's
    out = jnp.where(total == 0, 0, safe ** (1 / ord))
  return tracing.to_torchax(out)


def frobenius_norm(input, dim, keepdim=False):
  """`aten::frobenius_norm.dim` (what `torch.norm(x)` calls on XLA tensors), which torchax lacks:
  `vector_norm` of order 2, as torch decomposes it where it is not called as one op (inside a
  `torch.while_loop` body it reaches torchax as itself).

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(torch.ops.aten.frobenius_norm.dim)(torch.full((4,), 2.0, device="xla"), [0]).item()
    4.0
  """
  return vector_norm(input, 2, dim, keepdim)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
  """`F.scaled_dot_product_attention` in torch's math form, every argument as torch takes it:
  float16/bfloat16 inputs computed in float32 and the output cast back; `enable_gqa` repeats each
  key/value head for its group of query heads; `is_causal` is the top-left aligned `tril` (query
  `i` sees keys `0..i`); a boolean `attn_mask` says which keys a query sees, a float one is added
  to the scores; a query whose every key is masked gets zeros, as from torch's `_safe_softmax`
  (the padding rows of a left-padded batch; torchax's form gave NaN there); dropout on the
  weights draws from the bridged call's random key. Inputs torch's math form refuses (`is_causal`
  with a mask among them) raise a `RuntimeError`, as in torch.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> q = torch.ones(1, 1, 2, 4, device="xla")
    >>> mask = torch.tensor([[False, False], [True, True]], device="xla")
    >>> out = bridge(torch.nn.functional.scaled_dot_product_attention)(q, q, q, attn_mask=mask)
    >>> out[0, 0, :, 0].cpu().tolist()
    [0.0, 1.0]
  """
  _refuse_what_torch_refuses(query, key, value, attn_mask, is_causal, enable_gqa)
  dtype = query.dtype
  if dtype in (torch.float16, torch.bfloat16):
    query, key, value = query.float(), key.float(), value.float()
  if enable_gqa:
    key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
    value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
  scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
  scores = query @ key.transpose(-2, -1) * scale
  masked = attn_mask is not None  # a mask may hide every key from a query; the causal one never
  if is_causal:
    attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                           device=query.device).tril()
  if attn_mask is not None and attn_mask.dtype == torch.bool:
    scores = scores.masked_fill(~attn_mask, float("-inf"))
  elif attn_mask is not None:
    scores = scores + attn_mask
  weights = _safe_softmax(scores) if masked else torch.softmax(scores, -1)
  if dropout_p > 0:
    weights = torch.dropout(weights, dropout_p, train=True)
  return (weights @ value).to(dtype)


def _safe_softmax(scores, dim=-1, dtype=None):
  """`aten::_safe_softmax`: softmax over `dim` with zeros for a row that is all -inf, where a
  plain softmax gives NaN (which would spread through the backward, as torchax's did): the row
  is made finite first, its weights zeroed after.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> scores = torch.tensor([[0.0, 0.0], [-math.inf, -math.inf]], device="xla")
    >>> bridge(torch.ops.aten._safe_softmax.default)(scores, -1).cpu().tolist()
    [[0.5, 0.5], [0.0, 0.0]]
  """
  dead = torch.isneginf(scores).all(dim, keepdim=True)
  weights = torch.softmax(torch.where(dead, 0.0, scores), dim, dtype=dtype)
  return weights.masked_fill(dead, 0.0)


def _refuse_what_torch_refuses(query, key, value, attn_mask, is_causal, enable_gqa):
  """torch's errors for inputs its math form refuses and this one would silently take."""
  if is_causal and attn_mask is not None:
    raise RuntimeError(
        "scaled_dot_product_attention: an attn_mask with is_causal=True (torch's math form, "
        "and so plain torch_xla, refuses the pair); pass one mask: attn_mask & "
        "torch.ones(L, S, dtype=torch.bool).tril() for both.")
  if not query.dtype == key.dtype == value.dtype:
    raise RuntimeError(
        f"scaled_dot_product_attention: query, key and value have dtypes {query.dtype}, "
        f"{key.dtype} and {value.dtype}; torch expects one dtype: cast them to one.")
  if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
    raise RuntimeError(
        f"scaled_dot_product_attention: attn_mask has dtype {attn_mask.dtype}; torch expects "
        f"bool (True: the key is seen), float32 or the query's dtype (added to the scores).")
  if enable_gqa and any(query.shape[-3] % t.shape[-3] for t in (key, value)):
    raise RuntimeError(
        f"scaled_dot_product_attention: enable_gqa=True with {query.shape[-3]} query heads and "
        f"{key.shape[-3]} key / {value.shape[-3]} value heads; the number of heads in key and "
        f"value must divide the number of heads in query.")


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
  """`torch.allclose` as torch gives it: a Python bool, which depends on the values, so inside a
  trace it is data-dependent (the region falls back, as for `.item()`) where torchax's gave a
  tensor.

  Example:
    >>> import warnings
    >>> from torch_xla_jaxbridge import bridge
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore")
    ...   bridge(lambda t: torch.allclose(t, t))(torch.ones(2, device="xla"))
    True
  """
  return bool(torch.isclose(input, other, rtol, atol, equal_nan).all())


def cholesky(input, upper=False):
  """`torch.cholesky` (and `torch.linalg.cholesky`, through `cholesky_ex`) as torch computes it:
  only the lower (`upper`: upper) triangle is read, and the gradient is symmetric, torch's
  convention for a function of a symmetric matrix; torchax's gave the gradient of the triangle
  read (another value wherever the input is a leaf).

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> a = torch.tensor([[4.0, 9.0], [2.0, 5.0]], device="xla")  # the upper 9 is not read
    >>> bridge(torch.linalg.cholesky)(a).cpu().tolist()
    [[2.0, 0.0], [1.0, 2.0]]
  """
  return tracing.to_torchax(_cholesky(input.jax(), upper)[0])


def _adjoint(x):
  jnp = runtime.jax_module().numpy
  return jnp.conj(jnp.swapaxes(x, -1, -2))


def _cholesky(x, upper):
  """(the factor, the Hermitian matrix torch reads from `x`'s lower or `upper` triangle)."""
  jax = runtime.jax_module()
  jnp = jax.numpy
  a = _adjoint(x) if upper else x
  read = jnp.tril(a) + _adjoint(jnp.tril(a, -1))
  symmetric = (a + _adjoint(a)) / 2  # the value read, with a symmetric gradient
  a = jax.lax.stop_gradient(read) + symmetric - jax.lax.stop_gradient(symmetric)
  factor = jax.lax.linalg.cholesky(a, symmetrize_input=False)
  return (_adjoint(factor) if upper else factor), read


def cholesky_ex(input, upper=False, check_errors=False):
  """`torch.linalg.cholesky_ex`: `cholesky` and its `info` as torch gives it (0, or the order of
  the first leading minor that is not positive-definite; the factor is then NaN, where torch
  leaves a partial one). `check_errors=True` raises on the values, so it is data-dependent: the
  region falls back.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(torch.linalg.cholesky_ex)(torch.tensor([[1.0, 2.0], [2.0, 1.0]], device="xla")
    ...                                  ).info.cpu().item()
    2
  """
  if check_errors:
    raise errors.DataDependentError(
        "torch.linalg.cholesky_ex(check_errors=True) raises depending on the values")
  jax = runtime.jax_module()
  factor, read = _cholesky(input.jax(), upper)
  failed = ~jax.numpy.isfinite(factor).all()
  no_failure = lambda a: jax.numpy.zeros(a.shape[:-2], jax.numpy.int32)  # noqa: E731
  info = jax.lax.cond(failed, _first_failed_pivot, no_failure, jax.lax.stop_gradient(read))
  return tracing.to_torchax(factor), tracing.to_torchax(info)


def _first_failed_pivot(a):
  """The order of the first leading minor of the Hermitian `a` that is not positive-definite,
  by the unblocked factorization: run only where the factor is not finite."""
  jnp = runtime.jax_module().numpy
  n = a.shape[-1]

  def step(k, carry):
    a, info = carry
    pivot = a[..., k, k].real
    bad = ~(pivot > 0)
    info = jnp.where((info == 0) & bad, k + 1, info)
    column = a[..., :, k] / jnp.sqrt(jnp.where(bad, 1, pivot))[..., None]
    column = jnp.where(jnp.arange(n) > k, column, 0)
    return a - column[..., :, None] * jnp.conj(column[..., None, :]), info

  zeros = jnp.zeros(a.shape[:-2], jnp.int32)
  return runtime.jax_module().lax.fori_loop(0, n, step, (a, zeros))[1]


def polygamma(n, input):
  """`torch.polygamma(n, x)` as torch computes it for negative `x` too, by the reflection
  formula psi_n(x) = (-1)^n psi_n(1 - x) - pi^(n+1) cot^(n)(pi x); JAX's series for negative
  `x` was off by 20% and more (and so was the gradient of `digamma`, its `n = 1`).

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> x = torch.tensor([-8.4784, 2.5], device="xla")
    >>> [round(v, 3) for v in bridge(lambda t: torch.polygamma(1, t))(x).cpu().tolist()]
    [9.804, 0.49]
  """
  return tracing.to_torchax(_polygamma(n, input.jax()))


def _polygamma(n, x):
  jax = runtime.jax_module()
  jnp = jax.numpy
  negative = x < 0
  direct = jax.lax.polygamma(jnp.asarray(n, x.dtype), jnp.where(negative, 0.5, x))
  r = jnp.where(negative, x, -0.5)  # each branch sees only values it is finite at
  cot = lambda t: jnp.cos(t) / jnp.sin(t)  # noqa: E731
  for _ in range(n):
    cot = jax.grad(cot)
  cot_n = jnp.vectorize(cot)(jnp.pi * r)
  reflected = ((-1) ** n * jax.lax.polygamma(jnp.asarray(n, x.dtype), 1 - r)
               - jnp.pi ** (n + 1) * cot_n)
  return jnp.where(negative, reflected, direct)


def digamma(input):
  """`torch.digamma`: JAX's values (-inf at 0, as torch) with the gradient `polygamma(1, x)`
  right for negative `x` too, in the input's dtype (torchax's was float32 always).

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> x = torch.tensor([1.0, 0.0], device="xla")
    >>> [round(v, 4) for v in bridge(torch.digamma)(x).cpu().tolist()]
    [-0.5772, -inf]
  """
  return tracing.to_torchax(_digamma()(input.jax()))


@threads.once
def _digamma():
  jax = runtime.jax_module()
  jnp = jax.numpy

  @jax.custom_jvp
  def digamma(x):
    return jnp.where(x == 0, -jnp.inf, jax.scipy.special.digamma(x)).astype(x.dtype)

  @digamma.defjvp
  def digamma_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return digamma(x), _polygamma(1, x) * dx

  return digamma


def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None,
                 sorter=None):
  """`torch.searchsorted` with every argument torch takes (`right`, `side`, `sorter`,
  `out_int32`, a batch of sorted rows), where torchax's took the first two and one row only.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> rows = torch.tensor([[1.0, 2.0, 2.0], [0.0, 5.0, 9.0]], device="xla")
    >>> bridge(lambda a, v: torch.searchsorted(a, v, right=True))(
    ...     rows, torch.tensor([[2.0], [5.0]], device="xla")).cpu().tolist()
    [[3], [2]]
  """
  jax = runtime.jax_module()
  jnp = jax.numpy
  rows = sorted_sequence.jax()
  values = input.jax() if tracing.is_traced(input) else jnp.asarray(input)
  if sorter is not None:
    rows = jnp.take_along_axis(rows, sorter.jax(), axis=-1)
  side = side or ("right" if right else "left")
  find = lambda row, v: jnp.searchsorted(row, v, side=side)  # noqa: E731
  if rows.ndim == 1:
    out = find(rows, values)
  else:
    flat = values.reshape(-1, values.shape[-1])
    out = jax.vmap(find)(rows.reshape(-1, rows.shape[-1]), flat).reshape(values.shape)
  return tracing.to_torchax(out.astype(jnp.int32 if out_int32 else jnp.int64))


tracing.register_op_override(torch.nn.functional.linear, linear)
tracing.register_op_override(torch.ops.aten.searchsorted.Tensor, searchsorted)
tracing.register_op_override(torch.ops.aten.searchsorted.Scalar, searchsorted)
tracing.register_op_override(torch.ops.aten.polygamma.default, polygamma)
tracing.register_op_override(torch.ops.aten.digamma.default, digamma)
tracing.register_op_override(torch.ops.aten._safe_softmax.default, _safe_softmax)
tracing.register_op_override(torch.ops.aten.cholesky.default, cholesky)
tracing.register_op_override(torch.ops.aten.linalg_cholesky_ex.default, cholesky_ex)
tracing.register_op_override(torch.allclose, allclose)
tracing.register_op_override(torch.ops.aten.linalg_vector_norm.default, vector_norm)
tracing.register_op_override(torch.ops.aten.frobenius_norm.dim, frobenius_norm)
tracing.register_op_override(torch.nn.functional.scaled_dot_product_attention,
                             scaled_dot_product_attention)
