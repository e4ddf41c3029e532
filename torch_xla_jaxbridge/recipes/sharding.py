"""The recipe's SPMD layout: a `(fsdp, tensor)` device mesh, parameters sharded FSDP-style (the
largest divisible dimension over `fsdp`; with `tensor > 1` the projections also Megatron-style
over `tensor`), and each batch split over `fsdp`.

All of it is plain torch_xla SPMD (`xs.Mesh`, `xs.mark_sharding`) on the model's XLA tensors; the
bridged layers need nothing more: the shardings flow through their calls.
"""
import functools

import numpy as np
import torch.nn.functional as F

import torch_xla_jaxbridge as jb

# Megatron-style placement over the `tensor` axis, by the parameter's last name parts:
# column-parallel projections split their output features (dim 0), row-parallel their input (dim 1).
_TENSOR_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
               "lm_head": 0, "o_proj": 1, "down_proj": 1, "embed": 1}


def mesh_shape(cfg):
  """`(fsdp, tensor)` from the config's `mesh` section.

  Example:
    >>> from torch_xla_jaxbridge.recipes import config
    >>> mesh_shape(config.load())
    (1, 1)
  """
  return cfg["mesh"]["fsdp"], cfg["mesh"]["tensor"]


@functools.cache
def make_mesh(fsdp, tensor):
  """Enables SPMD (once per process, irreversible) and returns the `("fsdp", "tensor")` mesh over
  every device; None for a `(1, 1)` mesh, which runs without SPMD.

  Example:
    >>> make_mesh(1, 1) is None
    True
  """
  if fsdp * tensor == 1:
    return None
  import torch_xla.distributed.spmd as xs
  import torch_xla.runtime as xr

  count = xr.global_runtime_device_count()
  if count != fsdp * tensor:  # config.check says this first; kept for direct callers
    raise ValueError(f"mesh ({fsdp}, {tensor}) needs {fsdp * tensor} devices; there are {count}.")
  if not xr.is_spmd():
    xr.use_spmd()
  return xs.Mesh(np.arange(count), (fsdp, tensor), ("fsdp", "tensor"))


def param_spec(name, shape, fsdp, tensor):
  """The partition spec of parameter `name`: Megatron-style over `tensor` for the projections,
  then the largest remaining dimension that `fsdp` divides over `fsdp` (None: replicated).

  Example:
    >>> param_spec("layers.0.attn.q_proj.weight", (64, 64), 4, 1)
    ('fsdp', None)
    >>> param_spec("layers.0.attn.o_proj.weight", (64, 64), 2, 2)
    ('fsdp', 'tensor')
    >>> param_spec("norm.weight", (6,), 4, 1)
    (None,)
  """
  spec: list[str | None] = [None] * len(shape)
  parts = name.split(".")
  owner = parts[-2] if len(parts) > 1 else parts[0]
  dim = _TENSOR_DIM.get(owner)
  if tensor > 1 and dim is not None and dim < len(shape) and shape[dim] % tensor == 0:
    spec[dim] = "tensor"
  free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
  if fsdp > 1 and free:
    spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
  return tuple(spec)


def place(value, mesh, partition):
  """The CPU tensor `value` as a tensor on the XLA device split by `partition` (a partition spec)
  over `mesh`, made from its shards: each device receives only its own part
  (`jb.spmd.place_from_cpu`).

  Example (needs 4 devices under `use_spmd()`; test_startup.py runs it on 4 virtual CPU devices):
    >>> weight = place(torch.ones(8, 4), make_mesh(4, 1), ("fsdp", None))  # doctest: +SKIP
  """
  return jb.spmd.place_from_cpu(value, mesh, partition)


def placer(mesh, device):
  """`place(name, value, stacked)` for `llama.build`: each initial value on `device`, split over
  `mesh` by its `spec` (with no mesh: moved whole); a stack (`stacked`: `value` a
  `llama.LayerValues`) assembled on the device a layer at a time (`stack_on_device`).

  Example:
    >>> import torch
    >>> placer(None, "xla")("norm.weight", torch.ones(4), False).device.type
    'xla'
  """
  if mesh is None:
    one = lambda name, value: value.to(device)  # noqa: E731
  else:
    one = lambda name, value: place(value, mesh, param_spec(  # noqa: E731
        name, tuple(value.shape), *mesh.mesh_shape))
  return lambda name, value, stacked: (stack_on_device(name, value, one, device, mesh)
                                       if stacked else one(name, value))


def stack_on_device(name, values, place_one, device, mesh=None):
  """The stack of parameter `name` on `device`, made from `values` (its layers' values on the
  CPU, made as each is read: `llama.LayerValues`) one layer at a time: each layer's value placed
  by `place_one(name, value)` (under SPMD as its shards, by the layer's `param_spec`), copied
  into its slice of the stack (marked with its stacked `spec`) and the step run
  (`torch_xla.sync()`, the stack's buffer updated in place: torch_xla aliases an in-place updated
  input to its output) and waited for. The host holds one layer's value (and its shards) at a
  time, the devices the stack and one layer; the result is device data, no graph pending.

  Example:
    >>> import torch
    >>> values = [torch.full((2, 3), float(i)) for i in range(4)]
    >>> stack = stack_on_device("w", values, lambda name, value: value.to("xla"), "xla")
    >>> stack.shape, stack[:, 0, 0].cpu().tolist()
    (torch.Size([4, 2, 3]), [0.0, 1.0, 2.0, 3.0])
  """
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm

  first = values[0]
  shape = (len(values), *first.shape)
  stack = torch.zeros(shape, dtype=first.dtype, device=device)
  if mesh is not None:
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(stack, mesh, spec(name, shape, True, *mesh.mesh_shape))
  for i in range(len(values)):
    layer = place_one(name, first if i == 0 else values[i])
    first = None  # the first layer's host value goes once placed
    stack.index_copy_(0, torch.tensor([i], device=device), layer.unsqueeze(0))
    del layer
    torch_xla.sync()
    xm.wait_device_ops()
  return stack


def spec(name, shape, stacked, fsdp, tensor):
  """`param_spec`, for the stack of a `jb.StackedLayers` (`stacked`) that of one layer's
  parameter with the layer axis replicated (each step of the scan reads one layer).

  Example:
    >>> spec("layers.layer.attn.q_proj.weight", (4, 64, 64), True, 4, 1)
    (None, 'fsdp', None)
  """
  if stacked:
    return (None,) + param_spec(name, shape[1:], fsdp, tensor)
  return param_spec(name, shape, fsdp, tensor)


def model_specs(model, fsdp, tensor):
  """Each parameter of `model` by name: its `spec` on an (fsdp, tensor) mesh, the stacks of a
  `jb.StackedLayers` as stacks.

  Example:
    >>> import torch
    >>> model_specs(torch.nn.Linear(8, 4), 4, 1)
    {'weight': (None, 'fsdp'), 'bias': ('fsdp',)}
  """
  stacked = [prefix + "." for prefix, sub in model.named_modules()
             if isinstance(sub, jb.StackedLayers)]
  return {name: spec(name, tuple(param.shape), any(name.startswith(p) for p in stacked), fsdp,
                     tensor)
          for name, param in model.named_parameters()}


def shard_model(model, mesh):
  """Marks every parameter of `model` (on the XLA device) with its `model_specs` entry; returns
  them.

  Example (needs 4 devices under `use_spmd()`; test_spmd.py runs it on 4 virtual CPU devices):
    >>> specs = shard_model(model, make_mesh(4, 1))  # doctest: +SKIP
  """
  import torch_xla.distributed.spmd as xs

  specs = model_specs(model, *mesh.mesh_shape)
  for name, param in model.named_parameters():
    xs.mark_sharding(param, mesh, specs[name])
  return specs


def batch_sharding(mesh):
  """The layout of a `(batch, seq)` input: batch split over `fsdp`, replicated over `tensor`; a
  `ShardingSpec` for `MpDeviceLoader(..., input_sharding=...)`, which places each batch sharded as
  it moves it to the device. None without a mesh.

  Example (needs 4 devices under `use_spmd()`; test_spmd.py runs it on 4 virtual CPU devices):
    >>> spec = batch_sharding(make_mesh(4, 1))  # doctest: +SKIP
    >>> batch_sharding(None) is None
    True
  """
  if mesh is None:
    return None
  import torch_xla.distributed.spmd as xs

  return xs.ShardingSpec(mesh, ("fsdp", None))


@functools.cache
def attention_overrides(attention, fsdp, tensor, kv_heads):
  """The op overrides of `model.attention` on an `(fsdp, tensor)` mesh. The flash kernel runs
  per device inside `jb.spmd.shard_map` (a Pallas kernel is not partitioned by GSPMD): batch over
  `fsdp`, heads over `tensor` when the key/value heads divide evenly (each device then holds
  whole query groups), else replicated over `tensor`. Cached, so every step has the same
  overrides (they are part of the trace key).

  Example (needs 4 devices under `use_spmd()`; test_spmd.py runs it on 4 virtual CPU devices):
    >>> model.overrides = attention_overrides("flash", 2, 2, 2)  # doctest: +SKIP
  """
  from torch_xla_jaxbridge.recipes.llama import ATTENTION

  if attention != "flash":
    return ATTENTION[attention]
  mesh = make_mesh(fsdp, tensor)
  spec = ("fsdp", "tensor" if kv_heads % tensor == 0 else None, None, None)

  def sharded_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    def per_device(q, k, v):
      return jb.flash_attention.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # interpret-mode kernels fail JAX's varying-axes check inside shard_map (docs/kernels.md)
    return jb.spmd.shard_map(per_device, (spec,) * 3, spec, mesh, check_vma=False)(
        query, key, value)

  return {F.scaled_dot_product_attention: sharded_sdpa}
