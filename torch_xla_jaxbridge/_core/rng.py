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
  """The JAX key (threefry) whose key data is the int32[2] array `key_data`.

  Example:
    >>> import jax
    >>> key_from_data(jax, jax.numpy.zeros(2, jax.numpy.int32)).dtype
    key<fry>
  """
  return jax.random.wrap_key_data(jax.lax.bitcast_convert_type(key_data, jax.numpy.uint32))


def data_from_key(jax: types.ModuleType, key: jax_types.Array) -> jax_types.Array:
  """The int32[2] key data of a JAX key: what `key_from_data` takes.

  Example:
    >>> import jax
    >>> data_from_key(jax, jax.random.key(0)).dtype
    dtype('int32')
  """
  return jax.lax.bitcast_convert_type(jax.random.key_data(key), jax.numpy.int32)


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
