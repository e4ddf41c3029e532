"""Integrations that register themselves with `_core.tracing`: importing this package installs them.

Each module adds an op override, a trace context or a trace key; nothing else imports them for
their side effects.
"""
from torch_xla_jaxbridge._integrations import (autocast, control_flow, hf_models, overrides,  # noqa: F401
                                               spmd, torch_checkpoint, torch_xla_kernels,
                                               trace_signals)
