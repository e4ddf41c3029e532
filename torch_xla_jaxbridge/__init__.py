"""torch_xla_jaxbridge: run the heavy parts of PyTorch/XLA training as JAX, in the same graph.

Importing the package sets `PJRT_DEVICE=CPU` when no device was chosen and no TPU runtime is
installed. It changes no global JAX config: JAX options the package needs (x64 for 64-bit inputs,
the GSPMD partitioner) are set only around its own tracing.
"""
from torch_xla_jaxbridge import runtime as _runtime

_runtime.default_to_cpu()

import torch_xla  # noqa: E402,F401  (registers the 'xla' device)

from torch_xla_jaxbridge import errors  # noqa: E402
from torch_xla_jaxbridge.call import call_jax  # noqa: E402
from torch_xla_jaxbridge.lowering import CacheInfo, cache_info, clear_cache  # noqa: E402

__all__ = ["call_jax", "cache_info", "clear_cache", "CacheInfo", "errors"]
