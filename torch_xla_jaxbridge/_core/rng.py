"""Random keys across the boundary: a JAX PRNG key travels through the graph as int32[2] key data.

torch_xla tensors cannot hold JAX key types, so bridged calls take their key as an XLA int32[2]
tensor: fresh from torch_xla's generator each call, derived from a user's seed, or a constant for
code that never draws random numbers.
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
  import jax as jax_types


def key_from_data(jax: types.ModuleType, key_data: jax_types.Array) -> jax_types.Array:
  """The JAX key traced code draws from, made from the int32[2] array `key_data`: an
  `unsafe_rbg` key whose generator key is the two words (its counter words zero), so dropout and
  `torch.rand*` lower to XLA's RngBitGenerator as plain torch_xla's do. A threefry key (JAX's
  default) lowers every draw and every split to threefry's rounds, a loop in the program per
  draw: T5 with dropout compiled 1.4-1.6x longer bridged than plain (docs/performance.md).

  Example:
    >>> import jax
    >>> key_from_data(jax, jax.numpy.zeros(2, jax.numpy.int32)).dtype
    key<urbg>
  """
  words = jax.lax.bitcast_convert_type(key_data, jax.numpy.uint32)
  return jax.random.wrap_key_data(jax.numpy.concatenate([words, jax.numpy.zeros_like(words)]),
                                  impl="unsafe_rbg")


def data_from_key(jax: types.ModuleType, key: jax_types.Array) -> jax_types.Array:
  """The int32[2] key data of a JAX key: what `key_from_data` takes (a key of more words, an
  rbg one: its halves xor-ed).

  Example:
    >>> import jax
    >>> data_from_key(jax, jax.random.key(0)).dtype
    dtype('int32')
  """
  words = jax.random.key_data(key).reshape(-1)
  if words.shape[0] != 2:
    half = words.shape[0] // 2
    words = words[:half] ^ words[half:]
  return jax.lax.bitcast_convert_type(words[:2], jax.numpy.int32)


# odd 32-bit constants (the golden ratio's and a square root's fractions): a key's first two
# words advance by them at each draw
_STEPS = (0x9E3779B9, 0xBB67AE85)


def next_key(jax: types.ModuleType, key: jax_types.Array) -> jax_types.Array:
  """The key after `key` in the sequence one trace draws from: its first two words (the
  generator's key for `unsafe_rbg`, XLA's Philox taking the state's first 64 bits as its key)
  advanced by two odd constants, so the n-th draw of a trace has key words `k + n * step`, all
  distinct over 2**32 draws. Two additions per draw, where torchax splits the key: a split is a
  random-bit op of its own (threefry's rounds, or an RngBitGenerator), which XLA compiles per draw.

  Example:
    >>> import jax
    >>> key = key_from_data(jax, jax.numpy.zeros(2, jax.numpy.int32))
    >>> jax.random.key_data(next_key(jax, key)).tolist() == [0x9E3779B9, 0xBB67AE85, 0, 0]
    True
  """
  jnp = jax.numpy
  words = jax.random.key_data(key)
  steps = jnp.zeros(words.shape, jnp.uint32).at[:2].set(jnp.array(_STEPS, jnp.uint32))
  return jax.random.wrap_key_data(words + steps, impl=jax.random.key_impl(key))


def threefry_key(jax: types.ModuleType, key: jax_types.Array) -> jax_types.Array:
  """A threefry key made from `key` (any impl): for draws that differ per shard inside
  shard_map, where JAX refuses RngBitGenerator on a key that varies along a manual axis.

  Example:
    >>> import jax
    >>> threefry_key(jax, key_from_data(jax, jax.numpy.ones(2, jax.numpy.int32))).dtype
    key<fry>
  """
  data = data_from_key(jax, key)
  return jax.random.wrap_key_data(jax.lax.bitcast_convert_type(data, jax.numpy.uint32))


def key_data(seed: int | torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
  """int32[2] key data on `device`: fresh from torch_xla's RNG when `seed` is None (reproducible
  under `torch_xla.manual_seed`), else derived from the int or integer tensor `seed`.

  Example:
    >>> key_data(7, "xla").cpu().tolist()
    [0, 7]
  """
  if seed is None:
    return torch.randint(-2**31, 2**31 - 1, (2,), dtype=torch.int32, device=device)
  if isinstance(seed, int):
    seed = torch.tensor(seed, dtype=torch.int64)
  seed = seed.to(torch.int64).reshape(())
  return torch.stack([seed >> 32, seed & 0xFFFFFFFF]).to(torch.int32).to(device)


@functools.lru_cache(maxsize=None)
def constant_key_data(device: torch.device) -> torch.Tensor:
  """All-zero key data on `device`, made once: the key of code that draws no random numbers.

  Copied from the host, so it is device data from the start: made on the device it would be a
  pending op in the first step's graph only, and the second step would compile anew.

  Example:
    >>> constant_key_data(torch.device("xla:0")).cpu().tolist()
    [0, 0]
  """
  return torch.zeros(2, dtype=torch.int32).to(device)
