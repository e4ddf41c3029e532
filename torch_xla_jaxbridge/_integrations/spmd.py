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
import math
import sys
from typing import Any, Sequence

import numpy as np

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import jax_lowering_private, torch_xla_private, torchax_private
from torch_xla_jaxbridge._core import patching, runtime, threads, tracing
from torch_xla_jaxbridge._core.sharding import check_mesh


@dataclasses.dataclass(frozen=True)
class Tiles:
  """An HLO tile sharding: tiles per tensor dimension, the device id of each tile (row-major),
  and whether a last tile dimension replicates over the remaining devices."""
  dims: tuple
  devices: tuple
  replicate_last: bool

  def op_sharding(self):
    """The `xla_client.OpSharding` JAX's lowering attaches to the constraint."""
    op = jax_lowering_private.op_sharding()
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
  check_mesh(mesh, where)
  spec = tuple(partition_spec)
  if len(spec) != len(shape):
    raise errors.UsageError(
        f"{where}: partition spec {spec} has {len(spec)} entries for a tensor of shape "
        f"{tuple(shape)}; give one entry (a mesh axis, a tuple of axes, or None) per dimension.")
  names = tuple(mesh.axis_names or ())
  per_dim = []
  for entry in spec:
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    per_dim.append(tuple(_axis_index(mesh, names, a, spec, where) for a in axes))
  used = [a for axes in per_dim for a in axes]
  if len(used) != len(set(used)):
    raise errors.UsageError(
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


def _axis_index(mesh, names, axis, spec, where):
  if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(mesh.mesh_shape):
    return axis
  if isinstance(axis, str) and axis in names:
    return names.index(axis)
  raise errors.UsageError(
      f"{where}: partition spec {spec} names mesh axis {axis!r}, which the mesh does not have; "
      f"its axes are {names or tuple(range(len(mesh.mesh_shape)))}.")


@threads.once
def _primitive():
  """The constraint as a JAX primitive: identity on values, an HLO `Sharding` custom call when
  lowered; its transpose constrains the cotangent the same way (as `with_sharding_constraint`)."""
  runtime.jax_module()

  def lower(ctx, x, *, tiles):
    # GSPMD form (mhlo.sharding) whatever the partitioner flag: torch_xla partitions with GSPMD
    return [jax_lowering_private.wrap_with_sharding_op(ctx, x, ctx.avals_out[0],
                                                       tiles.op_sharding())]

  return jax_lowering_private.identity_primitive(
      "jaxbridge_sharding_constraint", lower,
      lambda dim, *, tiles: {"tiles": tiles.insert_dim(dim)})


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


# --- sharded tensors made from CPU values, and their shardings read ------------------------------

def place_from_cpu(value: torch.Tensor, mesh: Any, spec: Sequence) -> torch.Tensor:
  """The CPU tensor `value` as a tensor on the XLA device split by `spec` over `mesh`, made from
  its shards: each device receives only its own part. (`value.to(device)` then `mark_sharding`
  keeps another whole host copy of `value` until the mark.)

  Example (needs 4 devices under `use_spmd()`; test_startup.py runs it on 4 virtual CPU devices):
    >>> import numpy as np, torch_xla.distributed.spmd as xs
    >>> mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))  # doctest: +SKIP
    >>> weight = place_from_cpu(torch.ones(8, 4), mesh, ("fsdp", None))  # doctest: +SKIP
  """
  import torch_xla.runtime as xr

  ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
  if xr.addressable_runtime_device_count() != ids.size:
    raise errors.UsageError(
        f"place_from_cpu: this process addresses {xr.addressable_runtime_device_count()} of the "
        f"mesh's {ids.size} devices; placing shards supports one process holding every device.")
  if len(spec) != value.dim() or not all(a is None or a in mesh.axis_names for a in spec):
    raise errors.UsageError(
        f"place_from_cpu: spec {spec} needs one entry per dimension of a {value.dim()}-d tensor, "
        f"each None or one of the mesh axes {mesh.axis_names}.")
  shards = []
  for device in range(ids.size):  # the process's devices, in ordinal order
    coords = dict(zip(mesh.axis_names, np.argwhere(ids == device)[0]))
    index = []
    for size, axis in zip(value.shape, spec):
      parts = mesh.mesh_shape[mesh.axis_names.index(axis)] if axis else 1
      if size % parts:
        raise errors.UsageError(
            f"place_from_cpu: dimension of size {size} does not split evenly over mesh axis "
            f"{axis!r} of {parts} devices; shard a divisible dimension or replicate it (None).")
      step = size // parts
      index.append(slice(coords[axis] * step, (coords[axis] + 1) * step) if axis else slice(None))
    shards.append(value[tuple(index)].contiguous())
  return torch_xla_private.tensor_from_cpu_shards(shards, mesh.get_op_sharding(spec),
                                                 list(value.shape))


def sharding_spec(tensor: torch.Tensor) -> str:
  """The HLO text of an XLA tensor's sharding (`""` when it has none).

  Example:
    >>> sharding_spec(torch.ones(2, device="xla"))
    ''
  """
  return torch_xla_private.sharding_spec(tensor)


# --- xs.mark_sharding on traced tensors -------------------------------------------------------

_MODULES = ("torch_xla.distributed.spmd.xla_sharding", "torch_xla.distributed.spmd")


def _mark_sharding(t, mesh, partition_spec, *args, **kwargs):
  if not (_MARK_SHARDING.active() and tracing.is_traced(t)):
    return _MARK_SHARDING.original("mark_sharding")(t, mesh, partition_spec, *args, **kwargs)
  # in place, as on an XLA tensor: later code that reads `t` sees the constrained value
  torchax_private.set_array(t, _constrain(runtime.jax_module(), t.jax(), mesh, partition_spec,
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
