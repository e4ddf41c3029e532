"""Integrations that register themselves with `_core.tracing`: importing this package installs them.

Each module adds an op override, a trace context or a trace key; nothing else imports them for
their side effects.
"""
from torch_xla_jaxbridge._integrations import (autocast, autograd_function, batch_norm,  # noqa: F401
                                               control_flow, custom_ops, hf_models, in_place_ops,
                                               low_precision, overrides, random_ops,
                                               seeded_generators, spmd,
                                               torch_checkpoint, torch_ops,
                                               torch_xla_kernels,
                                               trace_signals)
