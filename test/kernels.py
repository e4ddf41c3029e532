"""A small Pallas kernel for the tests: RMSNorm over the last dimension, run with
`interpret=True` (so it runs on CPU), with a `custom_vjp` whose backward is the reference math.

Pallas kernels are not partitioned by XLA's SPMD partitioner and have no gradient of their own:
the two reasons they are called inside `shard_map` and wrapped in `custom_vjp`.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

EPS = 1e-6
BLOCK_ROWS = 2


def _kernel(x_ref, w_ref, o_ref):
  x = x_ref[...]
  o_ref[...] = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w_ref[...]


def _pallas_rms_norm(x, w):
  rows = x.reshape(-1, x.shape[-1])
  n, d = rows.shape
  block = BLOCK_ROWS if n % BLOCK_ROWS == 0 else n
  out = pl.pallas_call(
      _kernel,
      # vma: which mesh axes the value varies over inside shard_map (empty outside it)
      out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype, vma=jax.typeof(rows).vma),
      grid=(n // block,),
      in_specs=[pl.BlockSpec((block, d), lambda i: (i, 0)),
                pl.BlockSpec((1, d), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
      interpret=True)(rows, w.reshape(1, d))
  return out.reshape(x.shape)


def reference(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


@jax.custom_vjp
def rms_norm(x, w):
  """RMSNorm of `x` (any leading dimensions) with weight `w`, by the Pallas kernel."""
  return _pallas_rms_norm(x, w)


def _forward(x, w):
  return _pallas_rms_norm(x, w), (x, w)


def _backward(saved, cotangent):
  return jax.vjp(reference, *saved)[1](cotangent)


rms_norm.defvjp(_forward, _backward)


# --- as a torch module ----------------------------------------------------------------------------

import copy  # noqa: E402

import torch  # noqa: E402

import torch_xla_jaxbridge as jb  # noqa: E402

P = jax.sharding.PartitionSpec


class KernelRMSNorm(torch.nn.Module):
  """The recipe's RMSNorm computed by the Pallas kernel: through `call_jax` inside bridged code,
  per shard of the batch inside `jb.spmd.shard_map` when a mesh is given (its "fsdp" axis)."""

  def __init__(self, weight, mesh=None):
    super().__init__()
    self.weight = torch.nn.Parameter(weight.detach().clone())
    self.mesh = mesh

  def forward(self, x):
    if self.mesh is None:
      return jb.call_jax(rms_norm, (x, self.weight))
    per_shard = lambda rows, w: jb.call_jax(rms_norm, (rows, w))  # noqa: E731
    # check_vma=False: JAX 0.7.1 fails to lower an interpret-mode kernel inside shard_map with
    # its varying-axes check on ("Primitive div requires varying manual axes to match")
    return jb.spmd.shard_map(per_shard, (P("fsdp"), P()), P("fsdp"), self.mesh,
                             check_vma=False)(x, self.weight)


def kernel_decoder(layer, mesh=None):
  """A copy of a recipe `DecoderLayer` whose two norms run the kernel."""
  layer = copy.deepcopy(layer)
  layer.input_norm = KernelRMSNorm(layer.input_norm.weight, mesh)
  layer.post_norm = KernelRMSNorm(layer.post_norm.weight, mesh)
  return layer


def decoder_case(count):
  """`count` recipe decoder layers (dim 32) and their input, the same in every process."""
  from torch_xla_jaxbridge.recipes.llama import DecoderLayer

  torch.manual_seed(0)
  layers = [DecoderLayer(32, 4, 2, 64) for _ in range(count)]
  return layers, torch.randn(4, 8, 32), torch.arange(8)
