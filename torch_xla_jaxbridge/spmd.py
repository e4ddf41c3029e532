"""SPMD (GSPMD) sharding inside bridged code.

Bridged computations need nothing special to run on sharded tensors: each is one call in the
torch_xla graph, XLA inlines it before sharding propagation, and the input shardings flow through
it to the outputs. What needs this module is a sharding asked for *inside* bridged code:
`xs.mark_sharding(t, mesh, spec)` on a traced tensor, or `with_sharding_constraint` in a JAX
function given to `call_jax`. Both become a sharding constraint (an HLO `Sharding` custom call)
in the lowered computation, built from the torch_xla mesh's own device ids: no JAX devices or JAX
mesh are needed, so it works where torch_xla owns the chips.
"""
import dataclasses
import functools
import math
import os
import sys
from typing import Any, Callable, Sequence

import torch

from torch_xla_jaxbridge import _compat, errors, patching, runtime, tracing


@dataclasses.dataclass(frozen=True)
class Tiles:
  """An HLO tile sharding: tiles per tensor dimension, the device id of each tile (row-major),
  and whether a last tile dimension replicates over the remaining devices."""
  dims: tuple
  devices: tuple
  replicate_last: bool

  def op_sharding(self):
    """The `xla_client.OpSharding` JAX's lowering attaches to the constraint."""
    op = _compat.op_sharding()
    if all(d == 1 for d in self.dims):
      op.type = type(op).Type.REPLICATED
      return op
    op.type = type(op).Type.OTHER
    op.tile_assignment_dimensions = list(self.dims)
    op.tile_assignment_devices = list(self.devices)
    op.replicate_on_last_tile_dim = self.replicate_last
    return op

  def insert_dim(self, position):
    """The same sharding for a tensor with one more, unsharded, dimension at `position`."""
    dims = list(self.dims)
    dims.insert(position, 1)
    return Tiles(tuple(dims), self.devices, self.replicate_last)

  def __str__(self):  # HLO's notation, for messages
    if all(d == 1 for d in self.dims):
      return "{replicated}"
    tail = " last_tile_dim_replicate" if self.replicate_last else ""
    dims = ",".join(map(str, self.dims))
    return f"{{devices=[{dims}]{','.join(map(str, self.devices))}{tail}}}"


def tiles(mesh, partition_spec, shape, *, where="with_sharding_constraint"):
  """The `Tiles` that `xs.mark_sharding(t, mesh, partition_spec)` gives a tensor of `shape`.

  Checks what torch_xla would assert on (or abort for) with a message that says what to do: the
  spec's length, unknown or repeated mesh axes, a mesh whose size is not the device count, SPMD
  not enabled.

  Example:
    Needs 4 devices and `torch_xla.runtime.use_spmd()`, so it is skipped in the docstring tests
    (test_spmd.py runs it on 4 virtual CPU devices):

    >>> import numpy as np, torch_xla.distributed.spmd as xs
    >>> mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))  # doctest: +SKIP
    >>> str(tiles(mesh, ("data", None), (8, 6)))  # doctest: +SKIP
    '{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}'
  """
  _check_mesh(mesh, where)
  spec = tuple(partition_spec)
  if len(spec) != len(shape):
    raise errors.BadArgumentError(
        f"{where}: partition spec {spec} has {len(spec)} entries for a tensor of shape "
        f"{tuple(shape)}; give one entry (a mesh axis, a tuple of axes, or None) per dimension.")
  names = tuple(mesh.axis_names or ())
  per_dim = []
  for entry in spec:
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    per_dim.append(tuple(_axis_index(mesh, names, a, spec, where) for a in axes))
  used = [a for axes in per_dim for a in axes]
  if len(used) != len(set(used)):
    raise errors.BadArgumentError(
        f"{where}: partition spec {spec} names a mesh axis more than once; each axis can shard "
        f"at most one dimension.")
  mesh_shape = tuple(mesh.mesh_shape)
  if not used:
    return Tiles((1,) * len(spec), (), False)
  rest = [a for a in range(len(mesh_shape)) if a not in used]
  logical = mesh.get_logical_mesh().transpose(used + rest)
  dims = tuple(math.prod(mesh_shape[a] for a in axes) for axes in per_dim)
  replicated = math.prod(mesh_shape[a] for a in rest)
  if replicated > 1:
    dims += (replicated,)
  return Tiles(dims, tuple(int(d) for d in logical.reshape(-1)), replicated > 1)


def _check_mesh(mesh, where):
  """SPMD on, and `mesh` over every device: what torch_xla asserts on, said with the fix."""
  import torch_xla.runtime as xr

  if not spmd_enabled():
    raise errors.BadArgumentError(
        f"{where}: SPMD is not enabled. Call torch_xla.runtime.use_spmd() at the start of the "
        f"program, before any tensor is moved to the XLA device.")
  count = xr.global_runtime_device_count()
  if mesh.size() != count:
    raise errors.BadArgumentError(
        f"{where}: the mesh has {mesh.size()} devices (shape {tuple(mesh.mesh_shape)}) but the "
        f"program runs on {count}. Build the mesh over every device, e.g. xs.Mesh(np.arange("
        f"{count}), ({count},), ('fsdp',)).")


def _axis_index(mesh, names, axis, spec, where):
  if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(mesh.mesh_shape):
    return axis
  if isinstance(axis, str) and axis in names:
    return names.index(axis)
  raise errors.BadArgumentError(
      f"{where}: partition spec {spec} names mesh axis {axis!r}, which the mesh does not have; "
      f"its axes are {names or tuple(range(len(mesh.mesh_shape)))}.")


@functools.cache
def _primitive():
  """The constraint as a JAX primitive: identity on values, an HLO `Sharding` custom call when
  lowered; its transpose constrains the cotangent the same way (as `with_sharding_constraint`)."""
  runtime.jax_module()
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching
  from jax.interpreters import mlir

  constraint = Primitive("jaxbridge_sharding_constraint")
  constraint.def_impl(lambda x, *, tiles: x)
  constraint.def_abstract_eval(lambda x, *, tiles: x)
  ad.deflinear2(constraint, lambda ct, x, *, tiles: [constraint.bind(ct, tiles=tiles)])

  def batched(args, dims, *, tiles):
    (x,), (dim,) = args, dims
    if dim is batching.not_mapped:
      return constraint.bind(x, tiles=tiles), dim
    return constraint.bind(x, tiles=tiles.insert_dim(dim)), dim

  batching.primitive_batchers[constraint] = batched

  def lower(ctx, x, *, tiles):
    # GSPMD form (mhlo.sharding) whatever the partitioner flag: torch_xla partitions with GSPMD
    return [_compat.wrap_with_sharding_op(ctx, x, ctx.avals_out[0], tiles.op_sharding())]

  mlir.register_lowering(constraint, lower)
  return constraint


def with_sharding_constraint(x: Any, mesh: Any, partition_spec: Sequence) -> Any:
  """Constrains `x` to be sharded as `partition_spec` over the torch_xla `mesh`.

  Inside a JAX function given to `call_jax` (`x` a JAX array) or inside bridged torch code (`x`
  a tensor being traced), it adds a sharding constraint to the lowered computation; its gradient
  is constrained the same way. On a plain XLA tensor it is `xs.mark_sharding`. Inside bridged code
  `xs.mark_sharding(t, mesh, spec)` does this for you.

  Args:
    x: a JAX array, a traced torch tensor, or an XLA tensor.
    mesh: a `torch_xla.distributed.spmd.Mesh` over every device.
    partition_spec: one entry per dimension of `x`: a mesh axis name or index, a tuple of them,
      or None (replicated).

  Returns:
    `x`, constrained (a new array or tensor inside traced code; `x` itself otherwise).

  Example:
    Needs 4 devices and `torch_xla.runtime.use_spmd()`, so it is skipped in the docstring tests
    (test_spmd.py runs the same on 4 virtual CPU devices):

    >>> import jax.numpy as jnp, numpy as np, torch, torch_xla.distributed.spmd as xs
    >>> import torch_xla_jaxbridge as jb
    >>> mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))  # doctest: +SKIP
    >>> def f(a):
    ...   return jb.spmd.with_sharding_constraint(jnp.sin(a), mesh, ("fsdp", None)) * 2
    >>> out = jb.call_jax(f, (torch.ones(8, 8, device="xla"),))  # doctest: +SKIP
  """
  jax = runtime.jax_module()
  if tracing.is_traced(x):
    return tracing.to_torchax(_constrain(jax, x.jax(), mesh, partition_spec))
  if isinstance(x, torch.Tensor):
    import torch_xla.distributed.spmd as xs

    tiles(mesh, partition_spec, x.shape, where="with_sharding_constraint")  # our checks first
    original = _MARK_SHARDING.original("mark_sharding") or xs.mark_sharding
    original(x, mesh, tuple(partition_spec))
    return x
  return _constrain(jax, x, mesh, partition_spec)


def _constrain(jax, array, mesh, partition_spec, where="with_sharding_constraint"):
  found = tiles(mesh, partition_spec, jax.numpy.shape(array), where=where)
  return _primitive().bind(array, tiles=found)


# --- shard_map over the torch_xla mesh ----------------------------------------------------------


def shard_map(fn: Callable, in_specs: Any, out_specs: Any, mesh: Any = None, *,
              check_vma: bool = True) -> Callable:
  """`jax.shard_map` over a torch_xla mesh: `fn` runs once per shard, on its block of each
  argument (a Pallas kernel, which XLA's SPMD partitioner cannot split, runs per device).

  Works inside bridged torch code, where `fn` is torch code called on the shards as tensors, and
  inside a JAX function given to `call_jax`, where `fn` is a JAX function called on arrays: `fn`
  gets the kind of values the returned function is called with. The mesh is JAX's abstract mesh
  of the torch_xla mesh's shape and axis names, so JAX needs no devices of its own; the lowered
  computation holds the manual-sharding region (`SPMDFullToShardShape`, `{manual}`,
  `SPMDShardToFullShape`) that torch_xla's partitioner runs. Gradients flow through it.

  Args:
    fn: called as `fn(*shards)` on each device's blocks; returns its blocks of the outputs.
    in_specs: one entry per positional argument: a partition spec (torch_xla style, a tuple with
      one mesh axis name or None per dimension; or a `jax.sharding.PartitionSpec`, which may be
      shorter than the rank and may shard a dimension over several axes), or a list / tuple /
      dict of them matching an argument that is one, or a `PartitionSpec` for all its tensors.
    out_specs: the same for the outputs (one spec for a single output, a tuple of specs for a
      tuple). A dimension a spec leaves unsharded must be equal on every device.
    mesh: a `torch_xla.distributed.spmd.Mesh` with axis names, over every device; None: the
      global mesh (`xs.set_global_mesh`).
    check_vma: JAX's check that outputs replicated by `out_specs` do not vary across devices
      (`jax.shard_map`'s argument). A Pallas kernel's `out_shape` then needs
      `jax.ShapeDtypeStruct(..., vma=jax.typeof(x).vma)`; or pass False.

  Returns:
    The mapped function: tensors in, tensors out inside bridged code; arrays in, arrays out in
    JAX code.

  Example:
    Needs 4 devices and `torch_xla.runtime.use_spmd()`, so it is skipped in the docstring tests
    (test_shard_map.py runs the same on 4 virtual CPU devices):

    >>> import numpy as np, torch, torch_xla.distributed.spmd as xs
    >>> import torch_xla_jaxbridge as jb
    >>> mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))  # doctest: +SKIP
    >>> @jb.bridge
    ... def scale_rows(x):  # each device normalizes its 2 rows with its own small computation
    ...   per_shard = lambda rows: rows / rows.abs().amax(dim=1, keepdim=True)
    ...   return jb.spmd.shard_map(per_shard, (("fsdp", None),), ("fsdp", None), mesh)(x)
    >>> out = scale_rows(torch.randn(8, 16, device="xla"))  # doctest: +SKIP
  """
  name = getattr(fn, "__name__", type(fn).__name__)
  where = f"jb.spmd.shard_map({name})"
  out_pspecs, out_exact = _pspec_tree(out_specs, where, "out_specs")

  @functools.wraps(fn)
  def mapped(*args):
    jax = runtime.jax_module()
    leaves = jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, torch.Tensor))
    torch_code = any(tracing.is_traced(leaf) for leaf in leaves)
    for leaf in leaves:
      if isinstance(leaf, torch.Tensor) and not tracing.is_traced(leaf):
        raise errors.BadArgumentError(
            f"{where}: called on a {leaf.device} tensor of shape {tuple(leaf.shape)} outside "
            f"traced code. shard_map runs inside bridged code (jb.bridge, jb.BridgeModule, "
            f"jb.StackedLayers, ...) or inside a JAX function given to jb.call_jax: call it "
            f"there, on the tensors (or arrays) that code receives.")
    found = _mesh(mesh, where)
    names = tuple(found.axis_names)
    arrays = tracing.to_jax(args) if torch_code else args
    in_pspecs = _in_pspecs(in_specs, arrays, names, where)
    _check_names(out_pspecs, names, where, "out_specs")
    body, rotate = (_torch_body(fn, _axes_used(in_pspecs, names), where) if torch_code else
                    (fn, None))

    def checked(*shards):
      outputs = body(*shards)
      jax.tree.map(lambda spec, exact, out: _check_rank(spec, exact, out, where, "out_specs"),
                   out_pspecs, out_exact, outputs)
      return outputs

    abstract = jax.sharding.AbstractMesh(tuple(found.mesh_shape), names)
    mapped_fn = jax.shard_map(checked, mesh=abstract, in_specs=in_pspecs,
                              out_specs=out_pspecs, check_vma=check_vma)
    # Differentiated through jax.checkpoint (which saves everything, so nothing is recomputed):
    # JAX 0.7.1's direct linearize of shard_map leaves a reference that its leak checker, which
    # every bridged trace runs under, reports as a leaked tracer; checkpoint's rule does not.
    saved = jax.checkpoint(mapped_fn, policy=jax.checkpoint_policies.everything_saveable)
    outputs = saved(*arrays)
    if not torch_code:
      return outputs
    rotate()
    return tracing.to_torchax(outputs)

  return mapped


def _mesh(mesh, where):
  """The torch_xla mesh to map over (`mesh`, else the global one), checked."""
  if mesh is None:
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    if mesh is None:
      raise errors.BadArgumentError(
          f"{where}: no mesh given and no global mesh set. Pass mesh=xs.Mesh(...), or call "
          f"xs.set_global_mesh(mesh) first.")
  _check_mesh(mesh, where)
  if not mesh.axis_names:
    raise errors.BadArgumentError(
        f"{where}: the mesh has no axis names; shard_map's specs name mesh axes. Build it with "
        f"names, e.g. xs.Mesh(ids, {tuple(mesh.mesh_shape)}, ('fsdp', ...)).")
  return mesh


def _is_spec(value):
  """A partition spec: a `PartitionSpec`, or a tuple / list of axis names and Nones."""
  pspec = runtime.jax_module().sharding.PartitionSpec
  return isinstance(value, pspec) or (
      isinstance(value, (tuple, list)) and all(e is None or isinstance(e, str) for e in value))


def _pspec_tree(specs, where, what):
  """`specs` with each spec a `PartitionSpec`, and the same tree of "one entry per dimension"
  flags (a torch_xla-style tuple must name every dimension; a `PartitionSpec` may stop short)."""
  pspec = runtime.jax_module().sharding.PartitionSpec
  if _is_spec(specs):
    exact = not isinstance(specs, pspec)
    return (pspec(*specs) if exact else specs), exact
  if isinstance(specs, (tuple, list)):
    pairs = [_pspec_tree(s, where, what) for s in specs]
    return type(specs)(p for p, _ in pairs), type(specs)(e for _, e in pairs)
  if isinstance(specs, dict):
    pairs = {k: _pspec_tree(s, where, what) for k, s in specs.items()}
    return {k: p for k, (p, _) in pairs.items()}, {k: e for k, (_, e) in pairs.items()}
  raise errors.BadArgumentError(
      f"{where}: {what} holds {specs!r}; a spec is a tuple of mesh axis names or None, one per "
      f"dimension (or a jax.sharding.PartitionSpec), in a tuple, list or dict shaped like the "
      f"values.")


def _in_pspecs(in_specs, args, names, where):
  """`in_specs` as `PartitionSpec`s, one entry per argument, checked against the arguments'
  structure and ranks and the mesh's axis names."""
  jax = runtime.jax_module()
  if isinstance(in_specs, jax.sharding.PartitionSpec):  # one spec for every argument
    in_specs = (in_specs,) * len(args)
  if not isinstance(in_specs, (tuple, list)) or len(in_specs) != len(args) or (
      len(args) == 1 and _is_spec(in_specs) and not _is_spec(in_specs[0])):
    raise errors.BadArgumentError(
        f"{where}: in_specs must hold one spec per positional argument ({len(args)} here), "
        f"e.g. in_specs=(('fsdp', None),) for one 2-D tensor; got {in_specs!r}.")
  pspecs, exact = _pspec_tree(tuple(in_specs), where, "in_specs")
  _check_names(pspecs, names, where, "in_specs")
  try:
    jax.tree.map(lambda spec, ex, value: _check_rank(spec, ex, value, where, "in_specs"),
                 pspecs, exact, tuple(args))
  except ValueError as e:  # the structures differ
    raise errors.BadArgumentError(
        f"{where}: in_specs {in_specs!r} does not match the arguments' structure: {e}") from None
  return pspecs


def _check_names(pspecs, names, where, what):
  """Each spec names only axes of the mesh, each at most once."""
  for spec in runtime.jax_module().tree.leaves(pspecs):
    axes = [a for entry in spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    unknown = [a for a in axes if a not in names]
    if unknown:
      raise errors.BadArgumentError(
          f"{where}: {what} spec {tuple(spec)} names mesh axis {unknown[0]!r}, which the mesh "
          f"does not have; its axes are {names}.")
    if len(axes) != len(set(axes)):
      raise errors.BadArgumentError(
          f"{where}: {what} spec {tuple(spec)} names a mesh axis more than once; each axis can "
          f"shard at most one dimension.")


def _check_rank(spec, exact, values, where, what):
  """Each array in `values` has one dimension per entry of `spec` (at least as many, for a
  `PartitionSpec`)."""
  for value in runtime.jax_module().tree.leaves(values):
    shape = tuple(getattr(value, "shape", ()))
    if len(spec) > len(shape) or (exact and len(spec) != len(shape)):
      raise errors.BadArgumentError(
          f"{where}: {what} spec {tuple(spec)} has {len(spec)} entries for a value of shape "
          f"{shape}; give one entry (a mesh axis name or None) per dimension.")


def _axes_used(pspecs, names):
  """The mesh axes the specs split over, in mesh order."""
  used = {a for spec in runtime.jax_module().tree.leaves(pspecs) for entry in spec
          if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
  return tuple(a for a in names if a in used)


def _torch_body(fn, axes, where):
  """`fn` (torch code) as a JAX function of the shards: torchax tensors in, arrays out. Random
  draws start from the enclosing code's key folded with the shard's index along `axes` (the axes
  the inputs are split over: each block draws its own numbers, devices holding the same blocks
  the same ones); an in-place update of an argument is refused (its shard would be dropped).
  Returns the body and `rotate()`, which moves the enclosing key on after the call if it drew."""
  jax = runtime.jax_module()
  env = tracing.environment()
  outer_key = _compat.current_key(env)
  drew = []

  def body(*shards):
    tensors = tracing.to_torchax(shards)
    start = jax.random.fold_in(outer_key, jax.lax.axis_index(axes)) if axes else outer_key
    with env.override_property(prng=start):
      outputs = fn(*tensors)
      drew.append(_compat.current_key(env) is not start)
    for tensor, shard in zip(jax.tree.leaves(tensors), jax.tree.leaves(shards)):
      if tensor.jax() is not shard:
        raise errors.MutationError(
            f"{where}: the function updated an argument of shape {tuple(tensor.shape)} in place; "
            f"inside shard_map that update would be lost. Return the new value instead.")
    return tracing.to_jax(outputs)

  def rotate():
    if drew and drew[-1]:
      env.get_and_rotate_prng_key()  # later draws of the enclosing code differ from these

  return body, rotate


# --- gradients sharded as their inputs ----------------------------------------------------------


def spmd_enabled():
  """Whether torch_xla runs SPMD (`torch_xla.runtime.use_spmd()`), read without its imports.

  Example:
    >>> spmd_enabled()  # a single-device run
    False
  """
  return os.environ.get("XLA_USE_SPMD", "").upper() in ("ON", "1", "YES", "TRUE", "Y")


def shardings_of(tensors):
  """Each XLA tensor's torch_xla `OpSharding` (None where it has none, or for a tensor traced inside
  bridged code), or None when SPMD is off or no tensor is sharded: what `shard_like` gives the
  gradients.

  Example:
    >>> shardings_of([torch.ones(2, device="xla")]) is None  # without SPMD
    True
  """
  if not spmd_enabled():
    return None
  get = _compat.xlac()._get_xla_op_sharding
  found = tuple(get(t) if t.is_xla else None for t in tensors)  # traced ones have none yet
  return found if any(s is not None for s in found) else None


def shard_like(tensors, shardings):
  """Annotates each XLA tensor with the matching sharding from `shardings_of` (in place).

  Sharding propagation alone may leave the gradient of a sharded parameter replicated (a norm
  weight's gradient is a sum over the batch); FSDP wants it sharded as the parameter.

  Example:
    >>> shard_like([torch.ones(2, device="xla")], None)  # no shardings: nothing to do
  """
  if shardings is None:
    return
  mark = _compat.xlac()._xla_mark_sharding
  for tensor, sharding in zip(tensors, shardings):
    if sharding is not None and tensor is not None:
      mark(tensor, sharding)


# --- xs.mark_sharding on traced tensors -------------------------------------------------------

_MODULES = ("torch_xla.distributed.spmd.xla_sharding", "torch_xla.distributed.spmd")


def _mark_sharding(t, mesh, partition_spec, *args, **kwargs):
  if not (_MARK_SHARDING.active() and tracing.is_traced(t)):
    return _MARK_SHARDING.original("mark_sharding")(t, mesh, partition_spec, *args, **kwargs)
  # in place, as on an XLA tensor: later code that reads `t` sees the constrained value
  _compat.set_array(t, _constrain(runtime.jax_module(), t.jax(), mesh, partition_spec,
                                  where="xs.mark_sharding in bridged code"))
  return t


def _mark_sharding_with_gradients(t, mesh, partition_spec):
  if not (_MARK_SHARDING.active() and tracing.is_traced(t)):
    return _MARK_SHARDING.original("mark_sharding_with_gradients")(t, mesh, partition_spec)
  constrained = _constrain(runtime.jax_module(), t.jax(), mesh, partition_spec,
                           where="xs.mark_sharding_with_gradients in bridged code")
  return tracing.to_torchax(constrained)


# While bridged torch code is traced, `xs.mark_sharding` and `xs.mark_sharding_with_gradients` on
# its tensors add sharding constraints (torch_xla's own versions need JAX devices that match its
# device ids); calls on XLA tensors go to torch_xla unchanged. Nothing is patched while torch_xla's
# SPMD module was never imported.
_MARK_SHARDING = patching.Patch(
    lambda: [sys.modules.get(name) for name in _MODULES] if _MODULES[0] in sys.modules else [],
    {"mark_sharding": _mark_sharding,
     "mark_sharding_with_gradients": _mark_sharding_with_gradients})
tracing.register_trace_context(lambda: _MARK_SHARDING)
