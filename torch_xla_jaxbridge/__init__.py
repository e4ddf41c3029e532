"""torch_xla_jaxbridge: run the heavy parts of PyTorch/XLA training as JAX, in the same graph.

Importing the package sets `PJRT_DEVICE=CPU` when no device was chosen and no TPU runtime is
installed, imports torch_xla and creates its PJRT client. It changes no global JAX config: JAX
options the package needs (x64 for 64-bit inputs, the GSPMD partitioner) are set only around its
own tracing. Everything public is named here; the sub-packages starting with `_` are private
(ARCHITECTURE.md).
"""
from torch_xla_jaxbridge._compat import torch_xla_private as _torch_xla_private
from torch_xla_jaxbridge._core import runtime as _runtime

_runtime.default_to_cpu()

import torch_xla  # noqa: E402,F401  (registers the 'xla' device)

# The PJRT client first: before JAX can claim the device, and before torch's autograd engine sizes
# its per-device queues (a CPU backward before any XLA device exists breaks later XLA backwards).
_torch_xla_private.init_computation_client()

from torch_xla_jaxbridge import _integrations  # noqa: E402,F401  (they register themselves)
from torch_xla_jaxbridge import dlpack as dlpack  # noqa: E402
from torch_xla_jaxbridge import errors as errors  # noqa: E402
from torch_xla_jaxbridge import flash_attention as flash_attention  # noqa: E402
from torch_xla_jaxbridge import optim as optim  # noqa: E402
from torch_xla_jaxbridge import remat as remat  # noqa: E402
from torch_xla_jaxbridge import spmd as spmd  # noqa: E402
from torch_xla_jaxbridge._bridge.api import assume_pure as assume_pure  # noqa: E402
from torch_xla_jaxbridge._bridge.api import bridge as bridge  # noqa: E402
from torch_xla_jaxbridge._bridge.auto import bridge_modules as bridge_modules  # noqa: E402
from torch_xla_jaxbridge._bridge.checkpoint import checkpoint as checkpoint  # noqa: E402
from torch_xla_jaxbridge._bridge.fallback import BridgeReport as BridgeReport  # noqa: E402
from torch_xla_jaxbridge._bridge.fallback import bridge_report as bridge_report  # noqa: E402
from torch_xla_jaxbridge._bridge.module import BridgeModule as BridgeModule  # noqa: E402
from torch_xla_jaxbridge._bridge.module import PureModule as PureModule  # noqa: E402
from torch_xla_jaxbridge._bridge.inspection import lower_bridged as lower_bridged  # noqa: E402
from torch_xla_jaxbridge._bridge.inspection import saved_residuals as saved_residuals  # noqa: E402
from torch_xla_jaxbridge._bridge.remat import Remat as Remat  # noqa: E402
from torch_xla_jaxbridge._bridge.remat import checkpoint_name as checkpoint_name  # noqa: E402
from torch_xla_jaxbridge._bridge.scan import StackedLayers as StackedLayers  # noqa: E402
from torch_xla_jaxbridge._bridge.scan import scan_layers as scan_layers  # noqa: E402
from torch_xla_jaxbridge._bridge.scan_fn import scan as scan  # noqa: E402
from torch_xla_jaxbridge._core.call import call_jax as call_jax  # noqa: E402
from torch_xla_jaxbridge._core.lowering import CacheInfo as CacheInfo  # noqa: E402
from torch_xla_jaxbridge._core.lowering import cache_info as cache_info  # noqa: E402
from torch_xla_jaxbridge._core.lowering import clear_cache as clear_cache  # noqa: E402
from torch_xla_jaxbridge._integrations.control_flow import fori_loop as fori_loop  # noqa: E402
from torch_xla_jaxbridge._integrations.overrides import override_ops as override_ops  # noqa: E402
from torch_xla_jaxbridge._integrations.overrides import register_lowering as register_lowering  # noqa: E402,E501
from torch_xla_jaxbridge._interop import dynamo_backend as _dynamo_backend  # noqa: E402
from torch_xla_jaxbridge._interop.custom_op import jax_op as jax_op  # noqa: E402
from torch_xla_jaxbridge._interop.jaxify import jaxify as jaxify  # noqa: E402
from torch_xla_jaxbridge._training.memory import MemoryReport as MemoryReport  # noqa: E402
from torch_xla_jaxbridge._training.memory import memory_report as memory_report  # noqa: E402
from torch_xla_jaxbridge._training.train_step import train_step as train_step  # noqa: E402

__all__ = ["call_jax", "bridge", "assume_pure", "BridgeModule", "PureModule", "cache_info",
           "clear_cache", "CacheInfo", "Remat", "checkpoint_name", "saved_residuals",
           "lower_bridged", "memory_report", "MemoryReport", "scan", "scan_layers", "StackedLayers",
           "checkpoint", "fori_loop", "jaxify", "jax_op", "override_ops", "register_lowering",
           "train_step", "errors", "dlpack",
           "optim", "spmd", "remat", "flash_attention", "bridge_modules", "bridge_report",
           "BridgeReport"]

_dynamo_backend.register()
