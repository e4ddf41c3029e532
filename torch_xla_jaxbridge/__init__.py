"""torch_xla_jaxbridge: run the heavy parts of PyTorch/XLA training as JAX, in the same graph.

Importing the package sets `PJRT_DEVICE=CPU` when no device was chosen and no TPU runtime is
installed, imports torch_xla and creates its PJRT client. It changes no global JAX config: JAX options the package needs (x64 for 64-bit inputs,
the GSPMD partitioner) are set only around its own tracing.
"""
from torch_xla_jaxbridge import _compat
from torch_xla_jaxbridge import runtime as _runtime

_runtime.default_to_cpu()

import torch_xla  # noqa: E402,F401  (registers the 'xla' device)

# The PJRT client first: before JAX can claim the device, and before torch's autograd engine sizes
# its per-device queues (a CPU backward before any XLA device exists breaks later XLA backwards).
_compat.init_computation_client()

from torch_xla_jaxbridge import dynamo_backend as _dynamo_backend  # noqa: E402
from torch_xla_jaxbridge import hf_models as _hf_models  # noqa: E402,F401  (registers itself)
from torch_xla_jaxbridge import overrides as _overrides  # noqa: E402,F401  (registers itself)
from torch_xla_jaxbridge import autocast as _autocast  # noqa: E402,F401  (registers itself)
from torch_xla_jaxbridge import torch_xla_kernels as _torch_xla_kernels  # noqa: E402,F401  (registers itself)
from torch_xla_jaxbridge import dlpack, errors, flash_attention, optim, spmd  # noqa: E402
from torch_xla_jaxbridge.bridging import BridgeModule, PureModule, assume_pure, bridge  # noqa: E402
from torch_xla_jaxbridge.call import call_jax  # noqa: E402
from torch_xla_jaxbridge.control_flow import fori_loop  # noqa: E402
from torch_xla_jaxbridge.custom_op import jax_op  # noqa: E402
from torch_xla_jaxbridge.jaxify import jaxify  # noqa: E402
from torch_xla_jaxbridge.lowering import CacheInfo, cache_info, clear_cache  # noqa: E402
from torch_xla_jaxbridge.remat import Remat, checkpoint_name  # noqa: E402
from torch_xla_jaxbridge.inspection import lower_bridged, saved_residuals  # noqa: E402
from torch_xla_jaxbridge.memory import MemoryReport, memory_report  # noqa: E402
from torch_xla_jaxbridge.overrides import override_ops  # noqa: E402
from torch_xla_jaxbridge.scan import StackedLayers, scan_layers  # noqa: E402
from torch_xla_jaxbridge.train_step import train_step  # noqa: E402

__all__ = ["call_jax", "bridge", "assume_pure", "BridgeModule", "PureModule", "cache_info", "clear_cache",
           "Remat", "checkpoint_name", "saved_residuals", "lower_bridged", "memory_report", "MemoryReport",
           "scan_layers", "StackedLayers", "fori_loop", "CacheInfo", "errors", "dlpack", "jaxify",
           "jax_op", "optim", "spmd", "override_ops", "flash_attention", "train_step"]

_dynamo_backend.register()
