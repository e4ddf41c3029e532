"""JAX's and jaxlib's private entry points (`jax._src`), one function each.

Each says why the package needs it and the public alternative where one exists;
`test/test_compat.py` checks each directly, so a JAX version bump fails there by name.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator


def _jax():
  from torch_xla_jaxbridge._compat import torch_xla_private

  torch_xla_private.init_computation_client()  # before JAX can claim the device
  import jax

  return jax


def trace_context() -> Any:
  """JAX's trace-time config (x64, matmul precision, ...) as a hashable value: part of every
  cache key, so a trace made under other settings is not reused. Breaks: every call re-traces or
  none does; `test_compat` checks it is hashable and changes with x64.

  Example:
    >>> hash(trace_context()) is not None
    True
  """
  _jax()
  from jax._src import config

  return config.trace_context()


def enable_x64(on: bool) -> Any:
  """Context: JAX's 64-bit mode on or off for this thread only (`jax.enable_x64` is deprecated
  and flips it for every thread).

  Example:
    >>> with enable_x64(False):
    ...   pass
  """
  _jax()
  from jax._src import config

  return config.enable_x64(bool(on))


def gspmd_partitioner() -> Any:
  """Context: lower with GSPMD shardings (`mhlo.sharding`), which torch_xla partitions, not
  Shardy's. Public alternative: `jax.config.update("jax_use_shardy_partitioner", False)`, which
  is global.

  Example:
    >>> with gspmd_partitioner():
    ...   pass
  """
  _jax()
  from jax._src import config

  return config.use_shardy_partitioner(False)


def is_checkpoint_name(primitive: Any) -> bool:
  """Whether a jaxpr equation's primitive is the one `jax.ad_checkpoint.checkpoint_name` binds;
  its `params["name"]` is the name. Used to name residuals in `jb.saved_residuals`.

  Example:
    >>> jax = _jax()
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> eqn = jax.make_jaxpr(lambda x: checkpoint_name(x, "a"))(1.0).jaxpr.eqns[0]
    >>> is_checkpoint_name(eqn.primitive)
    True
  """
  _jax()
  from jax._src import ad_checkpoint

  return primitive is ad_checkpoint.name_p


def user_frames(source_info: Any) -> Iterator:
  """The frames of a jaxpr equation's source traceback outside JAX, innermost first.

  Example:
    >>> jax = _jax()
    >>> eqn = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0]
    >>> len(list(user_frames(eqn.source_info))) > 0
    True
  """
  from jax._src import source_info_util

  return source_info_util.user_frames(source_info.traceback)


def is_leak_error(exc: BaseException) -> bool:
  """Whether `exc` is the report of `jax.checking_leaks()`: JAX raises a plain Exception whose
  message starts with "Leaked trace" (no class to catch).

  Example:
    >>> is_leak_error(Exception("Leaked trace DynamicJaxprTrace"))
    True
  """
  return str(exc).startswith("Leaked trace")


def is_while_loop_gradient_error(exc: BaseException) -> bool:
  """Whether `exc` is JAX's refusal to differentiate `lax.while_loop` in reverse mode (a
  ValueError identified by its message).

  Example:
    >>> is_while_loop_gradient_error(ValueError("x"))
    False
  """
  return "Reverse-mode differentiation does not work for lax.while_loop" in str(exc)


def holds_pallas_kernel(closed_jaxpr: Any) -> bool:
  """Whether a traced program calls a Pallas kernel (a `pallas_call` equation, in it or in any
  program nested in its equations' parameters). Found by the primitive's name: Pallas exports
  no predicate. If the name changes, bridged code calling a Pallas kernel stays in 64-bit mode,
  where its lowering fails (`test_xla_kernels` checks it).

  Example:
    >>> jax = _jax()
    >>> holds_pallas_kernel(jax.make_jaxpr(lambda x: jax.numpy.sin(x))(1.0))
    False
  """
  pending = [closed_jaxpr.jaxpr]
  while pending:
    for eqn in pending.pop().eqns:
      if eqn.primitive.name == "pallas_call":
        return True
      pending.extend(_nested_jaxprs(list(eqn.params.values())))
  return False


def _nested_jaxprs(values: list) -> Iterator:
  for value in values:
    if hasattr(value, "eqns"):
      yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
      yield value.jaxpr
    elif isinstance(value, (list, tuple)):
      yield from _nested_jaxprs(list(value))


def dlpack_cpu_import() -> Callable | None:
  """JAX's own DLPack import onto its CPU device, or None where this JAX lacks it. The public
  `jax.dlpack.from_dlpack` wraps it in conversions that cost an order of magnitude more host time
  per call (docs/performance.md).

  Example:
    >>> dlpack_cpu_import() is None or callable(dlpack_cpu_import())
    True
  """
  _jax()
  from jax._src.lib import xla_client

  return getattr(xla_client._xla, "dlpack_managed_tensor_to_buffer", None)


def hlo_text(hlo_proto: bytes) -> str:
  """The text of a serialized HLO module.

  Example:
    >>> jax = _jax()
    >>> lowered = jax.jit(lambda x: x + 1).lower(1.0)
    >>> "add" in hlo_text(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())
    True
  """
  _jax()
  from jax._src.lib import xla_client

  return xla_client._xla.HloModule.from_serialized_hlo_module_proto(hlo_proto).to_string()


def hlo_proto_from_text(text: str) -> bytes:
  """The serialized HLO module of HLO text (what `hlo_text` gives).

  Example:
    >>> jax = _jax()
    >>> proto = jax.jit(lambda x: x + 1).lower(1.0).compiler_ir("hlo").as_serialized_hlo_module_proto()
    >>> "add" in hlo_text(hlo_proto_from_text(hlo_text(proto)))
    True
  """
  _jax()
  from jax._src.lib import xla_client

  return xla_client._xla.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def cpu_compiled_memory(hlo_proto: bytes) -> Any:
  """XLA's `CompiledMemoryStats` (argument, output, alias, temp bytes) of a serialized HLO module
  compiled for JAX's CPU backend: module -> StableHLO -> `compile_and_load`. Public alternative:
  none for a module JAX did not trace.

  Example:
    >>> jax = _jax()
    >>> lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4,), "float32"))
    >>> cpu_compiled_memory(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()).output_size_in_bytes
    16
  """
  jax = _jax()
  from jax._src.lib import xla_client

  mlir = xla_client._xla.mlir.hlo_to_stablehlo(hlo_proto)
  cpu = jax.devices("cpu")[:1]
  executable = cpu[0].client.compile_and_load(mlir, cpu, xla_client.CompileOptions())
  return executable.get_compiled_memory_stats()


def vjp_without_known_values(vjp_fn: Any) -> Any:
  """`jax.vjp`'s function with the values of outputs that do not depend on the inputs dropped
  from its closure. JAX keeps each such value (an output partial evaluation found "known") in the
  function's static part, `ad.vjp`'s `partial(unbound_vjp, pvals, jaxpr)`, though the backward
  reads only whether each output is known; flattening the function to pass its residuals out of
  a trace then keeps a traced value in the tree, which JAX's leak checker reports (a Hugging Face
  T5 decoder block returns its cross-attention bias, zeros that depend on no input). Each known
  value becomes a float32 zero. Breaks if JAX changes how `vjp` builds its function: then it is
  returned unchanged (and such a call reports a leak); `test_compat` checks. Public alternative:
  `jax.closure_convert`, which traces the backward once more.

  Example:
    >>> jax = _jax()
    >>> out, vjp = jax.vjp(lambda x: (x * 2, jax.numpy.ones(2)), jax.numpy.ones(2))
    >>> vjp_without_known_values(vjp)((jax.numpy.ones(2), jax.numpy.ones(2)))[0].tolist()
    [2.0, 2.0]
  """
  import functools

  import numpy as np

  jax = _jax()
  from jax._src.interpreters import partial_eval as pe

  try:
    (inner,) = vjp_fn.args
    pvals, jaxpr = inner.func.args
    if not any(isinstance(pv, pe.PartialVal) and pv.is_known() for pv in pvals):
      return vjp_fn
    cleaned = [pe.PartialVal.known(np.zeros((), np.float32)) if pv.is_known() else pv
               for pv in pvals]
  except (AttributeError, TypeError, ValueError):
    return vjp_fn
  partial = jax.tree_util.Partial
  outer = vjp_fn.func
  return partial(functools.partial(outer.func, *outer.args, **outer.keywords),
                 partial(functools.partial(inner.func.func, cleaned, jaxpr), *inner.args))


def tangents_unread(vjp_fn: Any) -> frozenset[int]:
  """The positions of the inputs of `jax.vjp`'s function (its flat primal inputs) whose tangent
  reaches no output in the linear program `ad.vjp` keeps (`partial(unbound_vjp, pvals, jaxpr)`):
  unused, or cut by `stop_gradient`, their gradient is zero by construction, where torch's
  autograd gives None. Empty when the function is not built so (a JAX change): then every input
  counts as read. Public alternative: `jax.make_jaxpr` of the backward and a dependency walk,
  one more trace.

  Example:
    >>> jax = _jax()
    >>> f = lambda a, b, c: (a * 2).sum() + jax.lax.stop_gradient(b).sum()
    >>> ones = jax.numpy.ones(2)
    >>> sorted(tangents_unread(jax.vjp(f, ones, ones, ones)[1]))
    [1, 2]
  """
  try:
    (inner,) = vjp_fn.args
    _, jaxpr = inner.func.args
    eqns, invars, outvars = jaxpr.eqns, jaxpr.invars, jaxpr.outvars
  except (AttributeError, TypeError, ValueError):
    return frozenset()
  live = {v for v in outvars if hasattr(v, "aval") and not hasattr(v, "val")}
  for eqn in reversed(eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not hasattr(v, "val"))
  return frozenset(i for i, v in enumerate(invars) if v not in live)
