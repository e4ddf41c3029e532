"""torch dtype <-> JAX dtype."""
from __future__ import annotations

import types
from typing import Any, Iterable

import numpy as np
from numpy.typing import DTypeLike
import torch

from torch_xla_jaxbridge import errors


def _table() -> dict[torch.dtype, np.dtype]:
  import ml_dtypes

  return {
      torch.float32: np.dtype(np.float32),
      torch.float64: np.dtype(np.float64),
      torch.float16: np.dtype(np.float16),
      torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
      torch.int8: np.dtype(np.int8),
      torch.int16: np.dtype(np.int16),
      torch.int32: np.dtype(np.int32),
      torch.int64: np.dtype(np.int64),
      torch.uint8: np.dtype(np.uint8),
      torch.bool: np.dtype(np.bool_),
      torch.complex64: np.dtype(np.complex64),
      torch.complex128: np.dtype(np.complex128),
  }


TORCH_TO_JAX = _table()
JAX_TO_TORCH = {v: k for k, v in TORCH_TO_JAX.items()}
# torch_xla hands XLA's unsigned results to torch as signed tensors of the same width; bitcast so
# that the tensor's data and its torch dtype agree.
UNSIGNED_AS_SIGNED = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32):
                      np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.int64)}


def needs_x64(dtypes: Iterable[torch.dtype | DTypeLike]) -> bool:
  """Whether values of these dtypes (torch or JAX) need JAX's 64-bit mode: any 8-byte element
  type (float64, int64, uint64, complex128), the one rule for every trace and lowering.

  Example:
    >>> needs_x64([torch.float32, torch.int64]), needs_x64([np.dtype("complex64")])
    (True, False)
  """
  for dtype in dtypes:
    dtype = to_jax(dtype) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    if dtype.itemsize == (16 if dtype.kind == "c" else 8):
      return True
  return False


def to_jax(dtype: torch.dtype, where: str = "dtype") -> np.dtype:
  """The JAX (numpy) dtype for a torch dtype; `where` names the argument in the error.

  Example:
    >>> to_jax(torch.bfloat16)
    dtype(bfloat16)
  """
  try:
    return TORCH_TO_JAX[dtype]
  except KeyError:
    raise errors.BadArgumentError(
        f"{where}: torch dtype {dtype} has no JAX equivalent here; supported: "
        f"{', '.join(str(d) for d in TORCH_TO_JAX)}. Cast the tensor first.") from None


def to_torch(dtype: DTypeLike) -> torch.dtype:
  """The torch dtype for a JAX (numpy) dtype.

  Example:
    >>> to_torch(np.dtype("float32"))
    torch.float32
  """
  return JAX_TO_TORCH[np.dtype(dtype)]


def torch_compatible(jax: types.ModuleType, x: Any) -> Any:
  """`x` (a traced JAX value) as a dtype torch_xla represents faithfully: unsigned 16/32/64-bit
  integers are bitcast to the signed type of the same width; PRNG keys become their key data.

  Example:
    >>> jax = __import__("jax")
    >>> torch_compatible(jax, jax.numpy.uint32(7)).dtype
    dtype('int32')
  """
  if not hasattr(x, "dtype"):
    return x
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  signed = UNSIGNED_AS_SIGNED.get(np.dtype(x.dtype))
  return jax.lax.bitcast_convert_type(x, signed) if signed is not None else x


def restore(jax: types.ModuleType, x: Any, dtype: DTypeLike) -> Any:
  """Undoes `torch_compatible` for a value that was of `dtype`.

  Example:
    >>> jax = __import__("jax")
    >>> restore(jax, jax.numpy.int32(7), np.dtype("uint32")).dtype
    dtype('uint32')
  """
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(jax.lax.bitcast_convert_type(x, np.uint32))
  if np.dtype(dtype) in UNSIGNED_AS_SIGNED:
    return jax.lax.bitcast_convert_type(x, dtype)
  return x
