"""torch_xla's own JAX entry point, `torch_xla.core.xla_builder.call_jax`, inside bridged code.

torch_xla's Pallas kernels (`custom_kernel.gmm`, `tgmm`, `quantized_matmul_int8`) and its splash
attention reach JAX through `xb.call_jax`. Called by bridged torch code, upstream's version hands
the traced tensors to torchax's own environment, which keeps a traced random key past the trace
(the trace fails with a leak). While bridged code is traced, `xb.call_jax` is this package's
`call_jax`, which runs the JAX function inline on the traced arrays: no node of its own, gradients
through the enclosing call's `jax.vjp`. Other threads, and calls outside a trace, get torch_xla's
own function unchanged.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from torch_xla_jaxbridge._core import call, patching, tracing

# where torch_xla code looks `call_jax` up: `xb.call_jax` (custom_kernel.py, xla_sharding.py), and
# the name splash_attention.py imports
_MODULES = ("torch_xla.core.xla_builder", "torch_xla.experimental.splash_attention")


def _call_jax(jax_func: Callable, args: tuple, kwargs: dict | None = None,
              name: str | None = None, override_hash: Any = None) -> Any:
  """torch_xla's signature; in a thread that traces bridged code it is `jb.call_jax` (no cache
  is involved there, so `override_hash` has nothing to do), elsewhere torch_xla's own."""
  if not _CALL_JAX.active():
    return _CALL_JAX.original("call_jax")(jax_func, args, kwargs, name, override_hash)
  return call.call_jax(jax_func, args, kwargs, name=name)


_CALL_JAX = patching.Patch(lambda: [sys.modules.get(name) for name in _MODULES],
                           {"call_jax": _call_jax})
tracing.register_trace_context(lambda: _CALL_JAX)
