"""`shard_map` over the torch_xla mesh: a function run once per shard inside bridged code.

`jax.shard_map` over JAX's abstract mesh of the torch_xla mesh's shape and axis names, so JAX needs
no devices of its own; the lowered computation holds the manual-sharding region that torch_xla's
partitioner runs. `fn` is torch code inside bridged torch code, a JAX function inside a JAX
function given to `call_jax`.
"""
import functools
from typing import Any, Callable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import grad_reads, rng, runtime, tracing
from torch_xla_jaxbridge._core.sharding import check_mesh


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
        raise errors.UsageError(
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
    assert rotate is not None  # made with the torch body
    rotate()
    return grad_reads.like(tracing.to_torchax(outputs), args)

  return mapped


def _mesh(mesh, where):
  """The torch_xla mesh to map over (`mesh`, else the global one), checked."""
  if mesh is None:
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    if mesh is None:
      raise errors.UsageError(
          f"{where}: no mesh given and no global mesh set. Pass mesh=xs.Mesh(...), or call "
          f"xs.set_global_mesh(mesh) first.")
  check_mesh(mesh, where)
  if not mesh.axis_names:
    raise errors.UsageError(
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
    by_key = {k: _pspec_tree(s, where, what) for k, s in specs.items()}
    return {k: p for k, (p, _) in by_key.items()}, {k: e for k, (_, e) in by_key.items()}
  raise errors.UsageError(
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
    raise errors.UsageError(
        f"{where}: in_specs must hold one spec per positional argument ({len(args)} here), "
        f"e.g. in_specs=(('fsdp', None),) for one 2-D tensor; got {in_specs!r}.")
  pspecs, exact = _pspec_tree(tuple(in_specs), where, "in_specs")
  _check_names(pspecs, names, where, "in_specs")
  try:
    jax.tree.map(lambda spec, ex, value: _check_rank(spec, ex, value, where, "in_specs"),
                 pspecs, exact, tuple(args))
  except ValueError as e:  # the structures differ
    raise errors.UsageError(
        f"{where}: in_specs {in_specs!r} does not match the arguments' structure: {e}") from None
  return pspecs


def _check_names(pspecs, names, where, what):
  """Each spec names only axes of the mesh, each at most once."""
  for spec in runtime.jax_module().tree.leaves(pspecs):
    axes = [a for entry in spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    unknown = [a for a in axes if a not in names]
    if unknown:
      raise errors.UsageError(
          f"{where}: {what} spec {tuple(spec)} names mesh axis {unknown[0]!r}, which the mesh "
          f"does not have; its axes are {names}.")
    if len(axes) != len(set(axes)):
      raise errors.UsageError(
          f"{where}: {what} spec {tuple(spec)} names a mesh axis more than once; each axis can "
          f"shard at most one dimension.")


def _check_rank(spec, exact, values, where, what):
  """Each array in `values` has one dimension per entry of `spec` (at least as many, for a
  `PartitionSpec`)."""
  for value in runtime.jax_module().tree.leaves(values):
    shape = tuple(getattr(value, "shape", ()))
    if len(spec) > len(shape) or (exact and len(spec) != len(shape)):
      raise errors.UsageError(
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
  outer_key = torchax_private.current_key(env)
  drew = []

  def body(*shards):
    tensors = tracing.to_torchax(shards)
    # per shard: a threefry key (JAX refuses RngBitGenerator on a key varying along an axis)
    start = (jax.random.fold_in(rng.threefry_key(jax, outer_key), jax.lax.axis_index(axes))
             if axes else outer_key)
    with env.override_property(prng=start):
      outputs = fn(*tensors)
      drew.append(torchax_private.current_key(env) is not start)
    for tensor, shard in zip(jax.tree.leaves(tensors), jax.tree.leaves(shards)):
      if tensor.jax() is not shard:
        raise errors.misuse(errors.MutationError(
            f"{where}: the function updated an argument of shape {tuple(tensor.shape)} in place; "
            f"inside shard_map that update would be lost. Return the new value instead."))
    return tracing.to_jax(outputs)

  def rotate():
    if drew and drew[-1]:
      env.get_and_rotate_prng_key()  # later draws of the enclosing code differ from these

  return body, rotate
