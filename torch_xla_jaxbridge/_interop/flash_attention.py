"""Flash attention as a Pallas kernel: softmax(q k^T * scale) v without the sequence x sequence
score matrix, forward and backward.

The forward walks the key/value blocks of one query block with an online softmax (a running row
maximum and row sum), keeping only a `[block_q, block_k]` score tile and the row log-sum-exp. The
backward (a `jax.custom_vjp`) recomputes the tiles from that log-sum-exp in two kernels: one per
query block for dq, one per key/value block for dk and dv. With `causal=True`, tiles above the
diagonal are skipped. Arrays are `[batch, heads, seq, head_dim]`; the kernel is a plain JAX
function of (q, k, v), so `jax.jit`, `jax.vmap`, `shard_map` and bridged code can call it. On a
platform other than TPU it runs in Pallas's interpret mode (the same kernel as ordinary XLA ops).

`sdpa` has `F.scaled_dot_product_attention`'s signature, for `jb.override_ops`.
"""
import functools
import math
from typing import Any

import numpy as np

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime, threads

_MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(_MASKED - m) is 0, never NaN


def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                    block_q: int = 128, block_k: int = 128, interpret: bool | None = None) -> Any:
  """Attention of `q` over `k`, `v` (`[batch, heads, seq, head_dim]` JAX arrays), blockwise.

  Args:
    q: queries, `[batch, heads, q_len, head_dim]`.
    k, v: keys and values, `[batch, heads, kv_len, head_dim]` (repeat grouped key/value heads
      first, e.g. `jnp.repeat(k, heads // kv_heads, axis=1)`).
    causal: query `i` sees keys `0..i` (top-left aligned, as torch's `is_causal`).
    scale: multiplies the scores; default `1 / sqrt(head_dim)`.
    block_q, block_k: tile sizes, capped at the sequence lengths, which they must divide.
    interpret: Pallas interpret mode; default: on unless torch_xla's device is a TPU.

  Returns:
    `[batch, heads, q_len, head_dim]` in `q`'s dtype; differentiable (`jax.grad`, `jax.vjp`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 2, 8, 4))
    >>> flash_attention(q, k, v, causal=True, block_q=4, block_k=4).shape
    (1, 2, 8, 4)
    >>> jax.grad(lambda q: flash_attention(q, k, v).sum())(q).shape
    (1, 2, 8, 4)
  """
  jnp = runtime.jax_module().numpy
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (
      q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]):
    raise errors.BadArgumentError(
        f"flash_attention: expected q [batch, heads, q_len, head_dim] and k, v [batch, heads, "
        f"kv_len, head_dim] with the same batch, heads and head_dim; got q {q.shape}, k "
        f"{k.shape}, v {v.shape}. Repeat grouped key/value heads to the query heads first.")
  block_q, block_k = min(block_q, q.shape[2]), min(block_k, k.shape[2])
  for name, length, block in (("q_len", q.shape[2], block_q), ("kv_len", k.shape[2], block_k)):
    if block < 1 or length % block:
      raise errors.BadArgumentError(
          f"flash_attention: {name} {length} is not a multiple of its block size {block}; pass "
          f"block_q / block_k dividing the sequence lengths (or pad the sequence).")
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  if interpret is None:
    interpret = runtime.lowering_platform() != "tpu"
  return _attention(q, k, v, bool(causal), float(scale), block_q, block_k, bool(interpret))


def sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
  """`F.scaled_dot_product_attention` on JAX arrays by `flash_attention`, for `jb.override_ops`.

  Grouped key/value heads are repeated when `enable_gqa=True`. An explicit `attn_mask` or
  dropout is refused: the kernel computes causal or unmasked attention only.

  Example:
    >>> import torch, torch.nn.functional as F, torch_xla_jaxbridge as jb
    >>> attend = jb.bridge(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    >>> x = torch.randn(1, 2, 8, 4, device="xla")
    >>> with jb.override_ops({F.scaled_dot_product_attention: sdpa}):
    ...   out = attend(x, x, x)
    >>> torch.allclose(out.cpu(), attend(x, x, x).cpu(), atol=1e-5)
    True
  """
  if attn_mask is not None or dropout_p:
    raise errors.BadArgumentError(
        f"flash attention (jb.flash_attention.sdpa) computes causal or unmasked attention only; "
        f"this call passed {'attn_mask' if attn_mask is not None else f'dropout_p={dropout_p}'}. "
        f"Use is_causal=True without attn_mask, dropout_p=0, or leave this call to the "
        f"reference attention (outside the override_ops scope).")
  jnp = runtime.jax_module().numpy
  if enable_gqa and key.shape[1] != query.shape[1]:
    repeat = query.shape[1] // key.shape[1]
    key, value = jnp.repeat(key, repeat, axis=1), jnp.repeat(value, repeat, axis=1)
  return flash_attention(query, key, value, causal=is_causal, scale=scale)


@threads.once
def _attention_fn():
  jax = runtime.jax_module()

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
  def attention(q, k, v, causal, scale, block_q, block_k, interpret):
    return _forward(q, k, v, causal, scale, block_q, block_k, interpret)[0]

  def forward(q, k, v, causal, scale, block_q, block_k, interpret):
    out, lse = _forward(q, k, v, causal, scale, block_q, block_k, interpret)
    return out, (q, k, v, out, lse)

  def backward(causal, scale, block_q, block_k, interpret, saved, d_out):
    q, k, v, out, lse = saved
    return _backward(q, k, v, out, lse, d_out, causal, scale, block_q, block_k, interpret)

  attention.defvjp(forward, backward)
  return attention


def _attention(*args):
  return _attention_fn()(*args)


def _pallas():
  from jax.experimental import pallas as pl

  return pl


def _dot(a, b, contract=(1, 0)):
  """`a @ b` over the given dimensions of two 2-D tiles, accumulated in float32."""
  jax = runtime.jax_module()
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=jax.numpy.float32)


def _scores(q, k, causal, scale, q_start, k_start):
  """The scaled score tile `q k^T`, masked above the diagonal when causal."""
  jax = runtime.jax_module()
  s = _dot(q, k, (1, 1)) * scale
  if causal:
    rows = q_start + jax.lax.broadcasted_iota(np.int32, s.shape, 0)
    cols = k_start + jax.lax.broadcasted_iota(np.int32, s.shape, 1)
    s = jax.numpy.where(rows >= cols, s, _MASKED)
  return s


def _kv_blocks_seen(causal, i, block_q, block_k, kv_blocks):
  """How many key blocks query block `i` attends to."""
  if not causal:
    return kv_blocks
  return runtime.jax_module().numpy.minimum(kv_blocks, ((i + 1) * block_q + block_k - 1) // block_k)


def _forward(q, k, v, causal, scale, block_q, block_k, interpret):
  jax, pl = runtime.jax_module(), _pallas()
  jnp = jax.numpy
  batch, heads, q_len, dim = q.shape
  kv_len = k.shape[2]

  def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref):
    i = pl.program_id(2)
    q_tile = q_ref[...]

    def step(j, carry):
      m, l, acc = carry
      start = j * block_k
      k_tile, v_tile = k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :]
      s = _scores(q_tile, k_tile, causal, scale, i * block_q, start)
      m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
      p = jnp.exp(s - m_new)
      alpha = jnp.exp(m - m_new)
      acc = alpha * acc + _dot(p.astype(v_tile.dtype), v_tile)
      return m_new, alpha * l + p.sum(axis=1, keepdims=True), acc

    rows = (block_q, 1)  # row statistics as columns: 2-D, as TPU kernels want them
    init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((block_q, dim), jnp.float32))
    seen = _kv_blocks_seen(causal, i, block_q, block_k, kv_len // block_k)
    m, l, acc = jax.lax.fori_loop(0, seen, step, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)

  q_block = pl.BlockSpec((None, None, block_q, dim), lambda b, h, i: (b, h, i, 0))
  kv_whole = pl.BlockSpec((None, None, kv_len, dim), lambda b, h, i: (b, h, 0, 0))
  row_block = pl.BlockSpec((None, None, block_q, 1), lambda b, h, i: (b, h, i, 0))
  return pl.pallas_call(
      kernel, grid=(batch, heads, q_len // block_q),
      in_specs=[q_block, kv_whole, kv_whole], out_specs=[q_block, row_block],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_len, 1), jnp.float32)],
      interpret=interpret, name="flash_attention_forward")(q, k, v)


def _tile_grads(causal, scale, q_tile, k_tile, v_tile, do_tile, lse_tile, delta_tile, q_start,
                k_start):
  """The probabilities and score gradients of one tile."""
  jnp = runtime.jax_module().numpy
  p = jnp.exp(_scores(q_tile, k_tile, causal, scale, q_start, k_start) - lse_tile)
  ds = p * (_dot(do_tile, v_tile, (1, 1)) - delta_tile)
  return p, ds


def _block(pl, rows, width, whole=False):
  """A block of `rows` x `width` of each (batch, head): the grid's `i`-th, or all rows."""
  if whole:
    return pl.BlockSpec((None, None, rows, width), lambda b, h, i: (b, h, 0, 0))
  return pl.BlockSpec((None, None, rows, width), lambda b, h, i: (b, h, i, 0))


def _backward(q, k, v, out, lse, d_out, causal, scale, block_q, block_k, interpret):
  jax, pl = runtime.jax_module(), _pallas()
  jnp = jax.numpy
  batch, heads, q_len, dim = q.shape
  kv_len = k.shape[2]
  delta = (out.astype(jnp.float32) * d_out.astype(jnp.float32)).sum(-1, keepdims=True)

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref):
    i = pl.program_id(2)
    q_tile, do_tile = q_ref[...], do_ref[...]

    def step(j, dq):
      start = j * block_k
      k_tile = k_ref[pl.ds(start, block_k), :]
      _, ds = _tile_grads(causal, scale, q_tile, k_tile, v_ref[pl.ds(start, block_k), :],
                          do_tile, lse_ref[...], delta_ref[...], i * block_q, start)
      return dq + _dot(ds.astype(k_tile.dtype), k_tile)

    seen = _kv_blocks_seen(causal, i, block_q, block_k, kv_len // block_k)
    dq = jax.lax.fori_loop(0, seen, step, jnp.zeros((block_q, dim), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)

  def dkv_kernel(k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref):
    j = pl.program_id(2)
    k_tile, v_tile = k_ref[...], v_ref[...]

    def step(i, carry):
      dk, dv = carry
      rows = pl.ds(i * block_q, block_q)
      q_tile, do_tile = q_ref[rows, :], do_ref[rows, :]
      p, ds = _tile_grads(causal, scale, q_tile, k_tile, v_tile, do_tile, lse_ref[rows, :],
                          delta_ref[rows, :], i * block_q, j * block_k)
      dv = dv + _dot(p.astype(do_tile.dtype), do_tile, (0, 0))
      return dk + _dot(ds.astype(q_tile.dtype), q_tile, (0, 0)), dv

    first = (j * block_k) // block_q if causal else 0  # earlier query blocks see none of these keys
    zeros = jnp.zeros((block_k, dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(first, q_len // block_q, step, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

  block = functools.partial(_block, pl)
  dq = pl.pallas_call(
      dq_kernel, grid=(batch, heads, q_len // block_q),
      in_specs=[block(block_q, dim), block(kv_len, dim, True), block(kv_len, dim, True),
                block(block_q, dim), block(block_q, 1), block(block_q, 1)],
      out_specs=block(block_q, dim), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret, name="flash_attention_dq")(q, k, v, d_out, lse, delta)
  dk, dv = pl.pallas_call(
      dkv_kernel, grid=(batch, heads, kv_len // block_k),
      in_specs=[block(block_k, dim), block(block_k, dim), block(q_len, dim, True),
                block(q_len, dim, True), block(q_len, 1, True), block(q_len, 1, True)],
      out_specs=[block(block_k, dim), block(block_k, dim)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=interpret, name="flash_attention_dkv")(k, v, q, d_out, lse, delta)
  return dq, dk, dv
