"""torch dtype <-> JAX dtype."""
import numpy as np
import torch

from torch_xla_jaxbridge import errors


def _table():
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
SIXTY_FOUR_BIT = frozenset({torch.float64, torch.int64, torch.complex128})


def to_jax(dtype, where="dtype"):
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


def to_torch(dtype):
  """The torch dtype for a JAX (numpy) dtype.

  Example:
    >>> to_torch(np.dtype("float32"))
    torch.float32
  """
  return JAX_TO_TORCH[np.dtype(dtype)]
