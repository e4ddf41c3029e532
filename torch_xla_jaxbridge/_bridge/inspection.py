"""What the backward of a bridged function keeps, and its forward/backward lowered for a platform.

Both work on shapes alone: the example arguments may be CPU or XLA tensors, and nothing runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from torch_xla_jaxbridge._bridge import captures, vjp
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import Bridged
from torch_xla_jaxbridge._bridge.module import BridgeModule
from torch_xla_jaxbridge._bridge.spec import DIFF, OTHER, Spec, register_static_pytree
from torch_xla_jaxbridge._compat import jax_private
from torch_xla_jaxbridge._core import call, diagnostics, dtypes, lowering, modules, runtime


@dataclasses.dataclass(frozen=True)
class ResidualRow:
  """One value the backward keeps."""
  name: str  # checkpoint name, `argument <path>`, or `<op> at <file>:<line>`
  shape: tuple
  dtype: str
  bytes: int
  where: str  # "device" or "host"


@dataclasses.dataclass(frozen=True)
class ResidualReport:
  """The rows of `saved_residuals`, with totals; `str()` gives a table."""
  rows: tuple

  @property
  def total_bytes(self) -> int:
    return sum(r.bytes for r in self.rows)

  @property
  def device_bytes(self) -> int:
    return sum(r.bytes for r in self.rows if r.where == "device")

  @property
  def host_bytes(self) -> int:
    return sum(r.bytes for r in self.rows if r.where == "host")

  def names(self) -> set[str]:
    """The set of row names."""
    return {r.name for r in self.rows}

  def __str__(self) -> str:
    width = max([len(r.name) for r in self.rows] + [8])
    lines = [f"{'residual':<{width}}  {'shape':<18}{'dtype':<10}{'bytes':>12}  where"]
    for r in self.rows:
      lines.append(f"{r.name:<{width}}  {str(r.shape):<18}{r.dtype:<10}{r.bytes:>12}  {r.where}")
    lines.append(f"{'total':<{width}}  {'':<18}{'':<10}{self.total_bytes:>12}  "
                 f"(device {self.device_bytes}, host {self.host_bytes})")
    return "\n".join(lines)


def saved_residuals(fn: Callable, *args: Any, remat: Any = None, **kwargs: Any) -> ResidualReport:
  """Reports what the backward of bridged `fn(*args, **kwargs)` keeps, one row per residual.

  Args:
    fn: a torch function, an `nn.Module`, or a bridged function / `BridgeModule`.
    *args, **kwargs: example arguments (CPU or XLA tensors; only shapes and dtypes are used).
      Tensors that require grad, and the module's parameters, are differentiated.
    remat: the policy to report on; None uses `fn`'s own (a plain function or module has none).

  Returns:
    A `ResidualReport`: `rows` (name, shape, dtype, bytes, where), `total_bytes`,
    `device_bytes`, `host_bytes`; `print(report)` shows a table.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> report = jb.saved_residuals(torch.nn.Linear(4, 4), torch.ones(2, 4))
    >>> report.rows[0].name, report.total_bytes
    ('argument args[0]', 64)
  """
  jax = runtime.jax_module()
  call = abstract_call(fn, args, kwargs, remat)
  bridged, spec, diff, other, key, paths = call

  def linearized(diff: list, other: list, key: Any) -> Any:
    run = lambda *d: bridged.run(spec, d, other, key)[0]  # noqa: E731
    if bridged.policy is not None:
      run = jax.checkpoint(run, policy=bridged.policy)
    return jax.linearize(run, *diff)

  with jax_private.enable_x64(True):  # as bridged calls trace (`Bridged.keyed`)
    closed, out_shape = jax.make_jaxpr(linearized, return_shape=True)(diff, other, key)
    plain = jax.make_jaxpr(lambda d, o, k: bridged.run(spec, d, o, k)[0])(diff, other, key)
  named_sites = _named_sites(plain.jaxpr)
  jaxpr = closed.jaxpr
  count = len(jax.tree.leaves(out_shape[1]))
  residual_vars = jaxpr.outvars[len(jaxpr.outvars) - count:]
  input_names = dict(zip(jaxpr.invars, paths + ["rng key"]))
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  named = {v: eqn.params["name"] for eqn in jaxpr.eqns if jax_private.is_checkpoint_name(eqn.primitive)
           for v in eqn.invars + eqn.outvars if hasattr(v, "count")}
  rows: list[ResidualRow] = []
  for var in residual_vars:
    aval = var.aval
    if not hasattr(var, "count"):  # a literal: a constant folded into the backward
      name = "constant"
    elif var in named:
      name = named[var]
    elif var in input_names:
      name = f"argument {input_names[var]}"
    elif var in producers:
      eqn = producers[var]
      source = eqn.invars[0] if eqn.primitive.name == "device_put" else None
      if source is not None and hasattr(source, "count") and source in named:
        name = named[source]  # an offloaded copy of a named value
      else:  # remat drops the name marks from the saved values: find them by their origin
        name = named_sites.get(_site(eqn, var),
                               f"{eqn.primitive.name} at {_user_line(eqn.source_info)}")
    else:
      name = "constant"
    where = "host" if getattr(aval, "memory_space", None) == jax.memory.Space.Host else "device"
    shape = tuple(aval.shape)
    rows.append(ResidualRow(name, shape, str(aval.dtype), int(aval.size * aval.dtype.itemsize),
                            where))
  return ResidualReport(tuple(rows))


def lower_bridged(fn: Callable, *args: Any, platform: str, remat: Any = None,
                  **kwargs: Any) -> tuple:
  """The forward and backward halves of bridged `fn`, lowered for `platform`, as StableHLO text.

  Use it to check what a TPU or GPU would get (host-offload annotations, shardings) on a machine
  without one.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> fwd, bwd = jb.lower_bridged(torch.nn.Linear(4, 4), torch.ones(2, 4), platform="tpu")
    >>> "stablehlo.dot_general" in fwd
    True
  """
  jax = runtime.jax_module()
  bridged, spec, diff, other, key, _ = abstract_call(fn, args, kwargs, remat)

  def trace(x64: bool) -> Any:
    with jax_private.enable_x64(x64), jax_private.gspmd_partitioner():
      return jax.jit(bridged.forward_half, static_argnums=0).trace(spec, diff, other, key)

  x64, traced = True, trace(True)  # as bridged calls trace (`Bridged.keyed`, `lowering.lower`)
  if lowering.needs_32_bit_mode(traced, diff + other):
    x64, traced = False, trace(False)
  with jax_private.enable_x64(x64), jax_private.gspmd_partitioner(), \
      lowering.runtime_forms(platform):
    forward = traced.lower(lowering_platforms=(platform,)).as_text()
    floats, _, _, saved, _ = traced.out_info
    cotangents = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in floats]
    saved = (saved[0], [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in saved[1]])
    inputs = [diff[i] for i in saved[0].inputs]
    backward = jax.jit(vjp.backward_half).trace(saved, inputs, cotangents).lower(
        lowering_platforms=(platform,)).as_text()
  return forward, backward


def abstract_call(fn: Callable, args: tuple, kwargs: dict,
                  remat: remat_policies.RematArg) -> tuple:
  """`(bridged, spec, diff avals, other avals, key aval, readable paths)` for an example call of
  `fn` (a function, module, bridged function or BridgeModule): what `saved_residuals` and
  `lower_bridged` trace.

  Example:
    >>> bridged, spec, diff, other, key, paths = abstract_call(
    ...     torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, None)
    >>> paths
    ['param bias', 'param weight', 'args[0]']
  """
  jax = runtime.jax_module()
  if isinstance(fn, BridgeModule):
    fn = fn.wrapped
  is_module = isinstance(fn, torch.nn.Module)
  if isinstance(fn, torch.nn.Module):
    module = fn
    params, buffers, training = modules.module_state(module)
    call_args: tuple[tuple, dict] = ((params, buffers, training, args, kwargs), {})
    target = Bridged(lambda *a: modules.module_forward(module, *a),
                            remat=remat, name=type(module).__name__)
  else:
    bridged = fn if isinstance(fn, Bridged) else None
    own = bridged.fn if bridged else fn
    target = Bridged(own, remat=remat, name=bridged.name if bridged else None)
    if remat is None and bridged is not None:
      target.policy, target.offloads = bridged.policy, bridged.offloads
    call_args = (captures.with_captures(own, target.name, args, kwargs, xla=False), kwargs)
  register_static_pytree()
  spec, diff, other = Spec.split(call_args, lambda t: t.requires_grad, target.name)
  lifted = not is_module and bool(call_args[0]) and isinstance(call_args[0][0], captures.Lifted)
  names = [_path_name(path, is_module, lifted)
           for path, _ in jax.tree_util.tree_flatten_with_path(call_args)[0]]
  paths = [n for n, m in zip(names, spec.leaves) if m is DIFF]
  paths += [n for n, m in zip(names, spec.leaves) if m is OTHER]
  aval = lambda t: jax.ShapeDtypeStruct(tuple(t.shape), dtypes.to_jax(t.dtype))  # noqa: E731
  key = jax.ShapeDtypeStruct((2,), jax.numpy.int32)
  return target, spec, [aval(t) for t in diff], [aval(t) for t in other], key, paths


def _path_name(path: tuple, is_module: bool, lifted: bool) -> str:
  jax = runtime.jax_module()
  if is_module:  # ((params, buffers, training, args, kwargs), {})
    group = ("param", "buffer", "training", "args", "kwargs")[path[1].idx]
    rest = path[2:]
    if group in ("param", "buffer"):
      return f"{group} {rest[0].key}"
    return group + jax.tree_util.keystr(rest)
  if lifted and path[0].idx == 0:  # (((captured, *args), kwargs): captured first, args shifted
    if path[1].idx == 0:
      return f"captured {path[2].name}"
    return f"args[{path[1].idx - 1}]" + jax.tree_util.keystr(path[2:])
  return call.path_name(path)


def _site(eqn: Any, var: Any) -> tuple:
  # not the op: remat saves a value through a `reduce_precision` the plain forward lacks
  return (_user_line(eqn.source_info), tuple(var.aval.shape), str(var.aval.dtype))


def _named_sites(jaxpr: Any) -> dict[tuple, str]:
  """Checkpoint names by the site (op, source line, shape, dtype) of the value they name."""
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  sites: dict[tuple, str] = {}
  for eqn in jaxpr.eqns:
    if jax_private.is_checkpoint_name(eqn.primitive) and eqn.invars[0] in producers:
      sites[_site(producers[eqn.invars[0]], eqn.invars[0])] = eqn.params["name"]
  return sites


def _user_line(source_info: Any) -> str:
  for frame in jax_private.user_frames(source_info):
    if not diagnostics.is_library_file(frame.file_name):
      return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"
  return "<library code>"

