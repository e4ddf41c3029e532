"""`scan_layers`: a stack of identical layers run as one `jax.lax.scan` in one bridged call.

The layers' parameters and buffers are stacked along a new leading axis; the one-layer torch code
is converted once and becomes the scan body, so trace and compile time do not grow with depth.
`StackedLayers` keeps them stacked, so nothing is stacked or split per step.
"""
import contextlib
import copy
import inspect
import weakref
from typing import Any, Callable, Iterable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge.bridging import Bridged
from torch_xla_jaxbridge._bridge import layer_check
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._compat import torch_private, torch_xla_private, torchax_private
from torch_xla_jaxbridge._core import (attribute_reads, call, grad_reads, modules, recompute,
                                       runtime, sharding, structure_keys, tracing)

# The scan's bridged function, shared by layer stacks of one structure (a `_ScanLayers`: it holds
# no layer), and kept as long as the first layer of one of them lives: each first layer holds its
# stack's in `_BY_LAYER` (a stack whose structure has no key has its own).
_BY_STRUCTURE: "weakref.WeakValueDictionary[tuple, Bridged[_ScanLayers]]" = (
    weakref.WeakValueDictionary())
# first layer -> {(structure, remat): Bridged}
_BY_LAYER: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Bridged[_ScanLayers]]]" = (
    weakref.WeakKeyDictionary())


def scan_layers(layers: Iterable[torch.nn.Module], input_data: Any, partition_fn: Any = None,
                is_layer_pure: bool = True, *, remat: Any = None, shared_args: tuple = (),
                shared_kwargs: dict | None = None) -> Any:
  """Runs `layers` in sequence on `input_data` as one scanned, bridged computation.

  The arguments of `torch_xla.experimental.scan_layers.scan_layers`, and more. Layer `i` is
  called as `layer(carry, *shared_args, **shared_kwargs)`, or, for a tuple carry the layer
  cannot take as one argument (`forward(self, x, y, z)`), as `layer(*carry, *shared_args, ...)`
  (upstream's way). It must return a value of the same structure as `carry` (a tensor, or a
  tuple such as `(hidden, aux)`). Gradients reach each layer's own parameters. Randomness
  differs per layer and per call.

  Args:
    layers: structurally identical modules (same classes, parameter shapes, plain attributes).
    input_data: the first layer's carry input.
    partition_fn: upstream's AOTAutograd partitioner, mapped to a remat policy as for `jb.scan`
      (`default_partition`: keep what `jax.vjp` keeps); or give `remat=`.
    is_layer_pure: accepted; changes nothing (the trace is always reused per structure).
    remat: policy for the scan body (see docs/remat.md); None keeps what `jax.vjp` keeps
      except the results of elementwise and layout ops (`jb.remat.save_unfused`).
    shared_args, shared_kwargs: extra inputs given unchanged to every layer (positions, masks).

  Returns:
    The last layer's output (`input_data` itself when `layers` is empty).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layers = [torch.nn.Linear(8, 8).to("xla") for _ in range(4)]
    >>> out = jb.scan_layers(layers, torch.randn(2, 8, device="xla"))
  """
  layers = list(layers)
  if not layers:
    return input_data
  remat = remat_policies.from_partition_fn(partition_fn, remat, "scan_layers")
  stack = _LayerStack.of(layers)
  params, buffers, training = stack.state()
  template = stack.template()
  assert template is not None, "held by `layers`"
  bridged = _bridged_scan(template, stack.structure, remat)
  out = bridged.fn.run_for(template, bridged, len(layers), params, buffers, training,
                           input_data, tuple(shared_args), shared_kwargs or {})
  layer_check.refuse_read(stack.differences, bridged.fn.reads)  # what its traces read
  return out


class _LayerStack:
  """The layers of a `scan_layers` call, checked and walked once: later calls with the same layer
  objects read their current tensors through cached walks (the structure check and module walks
  were most of a deep stack's host time, docs/performance.md). The check is redone when a layer's
  parameter, buffer or submodule entries change, or when stacking finds different shapes or
  dtypes; attributes are read when the stack is first seen.

  Example:
    >>> layers = [torch.nn.Linear(2, 2) for _ in range(3)]  # held weakly: keep a reference
    >>> stack = _LayerStack.of(layers)
    >>> params, buffers, training = stack.state()
    >>> params["weight"].shape
    torch.Size([3, 2, 2])
  """

  # first layer -> {layer ids: _LayerStack}
  _by_first: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, _LayerStack]]" = (
      weakref.WeakKeyDictionary())

  @classmethod
  def of(cls, layers: list[torch.nn.Module]) -> "_LayerStack":
    stacks = cls._by_first.setdefault(layers[0], {})
    ids = tuple(map(id, layers))
    stack = stacks.get(ids)
    if stack is None or any(ref() is not layer for ref, layer in zip(stack.refs, layers)):
      stack = stacks[ids] = cls(layers)
    return stack

  def __init__(self, layers: list[torch.nn.Module]) -> None:
    self.differences = layer_check.identical(layers)
    self.refs = [weakref.ref(l) for l in layers]
    self.walks = [modules.StateWalk(l) for l in layers]
    self.layouts = [walk.walks for walk in self.walks]
    template = layers[0]
    self.template = weakref.ref(template)
    self.structure = structure_keys.structure_key(template, same_objects=False)

  def state(self) -> modules.ModuleState:
    """`(params, buffers, training)`: each parameter and buffer stacked over layers, in the graph
    (gradients reach each layer's own tensors through the stack's backward), and the first
    layer's modes."""
    states = [walk.state() for walk in self.walks]
    if [walk.walks for walk in self.walks] != self.layouts:  # a layer's entries changed
      self._check()
      self.layouts = [walk.walks for walk in self.walks]
    count = len(states)
    names, buffer_names = list(states[0][0]), list(states[0][1])
    params = [s[0][n] for n in names for s in states]
    buffers = [s[1][n] for n in buffer_names for s in states]
    if _mixed_dtypes(params, count) or _mixed_dtypes(buffers, count):
      self._check()  # torch.stack would promote them silently
    try:
      stacked = _StackLayers.apply(self, count, sharding.shardings_of(params), *params)
      stacked_buffers = [torch.stack(group) for group in _groups(buffers, count)]
    except RuntimeError:  # shapes differ: name the first difference
      self._check()
      raise
    return dict(zip(names, stacked)), dict(zip(buffer_names, stacked_buffers)), states[0][2]

  def _check(self) -> None:
    self.differences = layer_check.identical([ref() for ref in self.refs])

  def unstack(self, stacked: list) -> list:
    """The stacking's backward (`_unstack`), traced for this stack: its programs die with it."""
    return _unstack(stacked)


def _bridged_scan(template: torch.nn.Module, structure: tuple | None,
                  remat: remat_policies.RematArg) -> "Bridged[_ScanLayers]":
  """The scan's bridged function, shared by stacks of one structure and remat policy (call it as
  `bridged.fn.run_for(template, bridged, ...)`), held by `template` (a stack's first layer)."""
  own = _BY_LAYER.setdefault(template, {})
  bridged = own.get((structure, remat))
  if bridged is None:
    bridged = _BY_STRUCTURE.get((structure, remat)) if structure is not None else None
    if bridged is None:
      # no policy: what jax.vjp keeps, less what XLA would fuse away in the unrolled layers (a
      # scan stores each kept value for every layer: 1.33x LazyTensor's step bytes without this)
      policy = remat_policies.policy_for(remat) or remat_policies.save_unfused
      bridged = Bridged(_ScanLayers(policy), name=f"scan_{type(template).__name__}",
                         lift=False)
      if structure is not None:
        _BY_STRUCTURE[(structure, remat)] = bridged
    own[(structure, remat)] = bridged
  return bridged


class StackedLayers(torch.nn.Module):
  """Identical layers kept as one stack: each parameter and buffer is a single tensor with the
  layers along a new first axis, and the forward is `scan_layers` without stacking anything.

  Compile and host time then do not grow with depth at all: the step has one parameter per name
  (not per layer and name) to accumulate, update and keep. `state_dict()` keys are the layer list's
  (`"0.weight"`, `"1.weight"`, ...), so checkpoints load into either form.

  Args:
    layers: structurally identical modules (as for `scan_layers`); their values are copied.
    remat: policy for the scan body (see docs/remat.md).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> stack = jb.StackedLayers([torch.nn.Linear(8, 8) for _ in range(4)]).to("xla")
    >>> stack.layer.weight.shape
    torch.Size([4, 8, 8])
    >>> stack(torch.randn(2, 8, device="xla")).sum().backward()
    >>> stack.layer.weight.grad.shape
    torch.Size([4, 8, 8])
  """

  def __init__(self, layers: Iterable[torch.nn.Module], *, remat: Any = None) -> None:
    super().__init__()
    layers = list(layers)
    if not layers:
      raise errors.BadArgumentError("StackedLayers: layers is empty; give at least one layer.")
    differences = layer_check.identical(layers, "StackedLayers")
    layer_check.unshared(layers)
    remat_policies.policy_for(remat)  # validates `remat`
    self.count, self.remat = len(layers), remat
    self.layer = copy.deepcopy(layers[0])  # the structure; its tensors are replaced by stacks
    self.differences = differences
    stacked: dict[int, torch.Tensor] = {}  # a tensor tied between two names stays one stack
    for table in (torch_private.parameters_table, torch_private.buffers_table):
      for name, sub in self.layer.named_modules(remove_duplicate=False):
        tensors = table(sub)
        for key, value in [(k, v) for k, v in tensors.items() if v is not None]:
          if id(value) not in stacked:
            stacked[id(value)] = _stack_over(layers, f"{name}.{key}" if name else key, table,
                                             value.requires_grad)
          tensors[key] = stacked[id(value)]
    self._walk = modules.StateWalk(self.layer)
    self.register_state_dict_post_hook(_per_layer_keys)
    self.register_load_state_dict_pre_hook(_stacked_keys)

  def forward(self, carry: Any, *shared_args: Any, **shared_kwargs: Any) -> Any:
    """Runs the layers in order on `carry`; `shared_args`/`shared_kwargs` go to every layer."""
    params, buffers, training = self._walk.state()
    structure = structure_keys.structure_key(self.layer, same_objects=False)
    bridged = _bridged_scan(self.layer, structure, self.remat)
    out = bridged.fn.run_for(self.layer, bridged, self.count, params, buffers, training, carry,
                             shared_args, shared_kwargs)
    layer_check.refuse_read(self.differences, bridged.fn.reads, "StackedLayers")
    return out

  def __len__(self) -> int:
    return self.count

  def extra_repr(self) -> str:
    return f"count={self.count}, remat={self.remat!r}"


def _stack_over(layers: list[torch.nn.Module], name: str, table: Callable[[torch.nn.Module], dict],
                requires_grad: bool) -> torch.Tensor:
  """The parameter or buffer `name` (in each layer's `table`: its parameters or its buffers) of
  every layer, stacked."""
  path, _, key = name.rpartition(".")
  stack = torch.stack([table(l.get_submodule(path))[key].detach() for l in layers])
  is_parameter = table is torch_private.parameters_table
  return torch.nn.Parameter(stack, requires_grad) if is_parameter else stack


def _per_layer_keys(module: Any, state_dict: dict, prefix: str, local_metadata: object) -> None:
  """state_dict hook: the stacked `layer.<name>` entries as the layer list's `<i>.<name>`. An XLA
  stack's slices are computed in one program, as tensors of their own (a reader of views such as
  torch.distributed.checkpoint would run and compile a program per slice)."""
  stacks = {key[len(prefix + "layer."):]: state_dict.pop(key)
            for key in [k for k in state_dict if k.startswith(prefix + "layer.")]}
  on_xla = []
  for i in range(module.count):
    for name, stack in stacks.items():
      state_dict[f"{prefix}{i}.{name}"] = stack[i].clone() if stack.is_xla else stack[i]
      if stack.is_xla:
        on_xla.append(state_dict[f"{prefix}{i}.{name}"])
  if on_xla:
    torch_xla_private.sync_tensors(on_xla)


def _stacked_keys(module: Any, state_dict: dict, prefix: str, local_metadata: object, strict: bool,
                  missing_keys: list, unexpected_keys: list, error_msgs: list[str]) -> None:
  """load_state_dict hook: the layer list's `<i>.<name>` entries stacked as `layer.<name>`."""
  for name in module.layer.state_dict():
    keys = [f"{prefix}{i}.{name}" for i in range(module.count)]
    present = [k for k in keys if k in state_dict]
    if present and len(present) < len(keys):
      error_msgs.append(f"StackedLayers: {len(keys) - len(present)} of {len(keys)} layers miss "
                        f"{name!r} (first: {next(k for k in keys if k not in state_dict)!r}).")
    elif present:
      state_dict[f"{prefix}layer.{name}"] = torch.stack([state_dict.pop(k) for k in keys])


def _groups(tensors: list | tuple, count: int) -> list:
  """`tensors` listed name by name, each name's `count` layers in order: one group per name."""
  return [tensors[i:i + count] for i in range(0, len(tensors), count)]


def _mixed_dtypes(tensors: list | tuple, count: int) -> bool:
  return any(len({t.dtype for t in group}) > 1 for group in _groups(tensors, count))


class _StackLayers(torch.autograd.Function):
  """Stacks each parameter over the layers (`tensors` name by name, each name's layers in order);
  the backward splits every stacked gradient into the layers' gradients in one graph node, not
  one view per parameter, and under SPMD gives each the sharding of its parameter (propagation
  alone can leave it replicated)."""

  @staticmethod
  def forward(ctx: Any, stack: _LayerStack, count: int, shardings: tuple | None,
              *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ctx.stack, ctx.shardings = stack, shardings
    groups = _groups(tensors, count)
    stacked = tuple(torch.stack(group) for group in groups)
    ctx.mark_non_differentiable(*[out for out, group in zip(stacked, groups)
                                  if not any(t.requires_grad for t in group)])
    return stacked

  @staticmethod
  def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
    per_layer = call.call_jax(ctx.stack.unstack, (list(grads),), name="unstack_layers")
    sharding.shard_like(per_layer, ctx.shardings)
    return (None, None, None, *per_layer)


def _unstack(stacked: list) -> list:
  return [layer for group in stacked for layer in group]


class _ScanLayers(modules.Calling):
  """The bridged torch function of the stacks of one structure: `_scan` of the stack being
  called (its first layer named by `run_for`). `reads`: the attributes its traces read."""
  __slots__ = ("policy", "reads")

  def __init__(self, policy: Callable | None) -> None:
    super().__init__()
    self.policy = policy
    self.reads: set = set()

  def __call__(self, *args: Any) -> Any:
    template = self.module()
    with attribute_reads.attribute_reads(template) as reads:
      out = _scan(template, self.policy, *args)
    self.reads |= reads
    return out


def _scan(template: torch.nn.Module, policy: Callable | None, count: int, params: dict,
          buffers: dict, training: tuple, carry: Any, shared_args: tuple,
          shared_kwargs: dict) -> Any:
  """The bridged torch function: runs under torchax, with stacked torchax tensors."""
  jax = runtime.jax_module()
  env = tracing.environment()
  unwrap, wrap = tracing.to_jax, tracing.to_torchax

  def run_layer(carry: Any, layer_params: dict, layer_buffers: dict, key: Any) -> Any:
    buffers_in = wrap(layer_buffers)
    with env.override_property(prng=key) if key is not None else contextlib.nullcontext():
      before = torchax_private.current_key(env)
      out = modules.module_forward(template, wrap(layer_params), buffers_in, training,
                                   layer_args(wrap(carry)), shared_kwargs)
      drew.append(torchax_private.current_key(env) is not before)
    changed = [n for n, b in buffers_in.items() if b.jax() is not layer_buffers[n]]
    if changed:
      raise errors.MutationError(
          f"scan_layers: the layers update buffers {changed} in place (e.g. BatchNorm running "
          f"statistics), which a scan cannot write back yet. Bridge each layer with "
          f"jb.BridgeModule instead, or put the layer in eval mode.")
    out = unwrap(out)
    if jax.tree.structure(out) != jax.tree.structure(carry):
      raise errors.BadArgumentError(
          f"scan_layers: a layer returned {jax.tree.structure(out)} for a carry of structure "
          f"{jax.tree.structure(carry)}; each layer must return what it takes (e.g. (hidden, "
          f"aux) for (hidden, aux)).")
    return out

  # per-layer keys only for layers that draw random numbers: splitting keys costs compile time
  drew: list[bool] = []
  layer_args = _layer_arguments(template, carry, shared_args, shared_kwargs)
  first_layer = jax.tree.map(lambda a: a[0], (unwrap(params), unwrap(buffers)))
  jax.eval_shape(lambda c, p, b: run_layer(c, p, b, jax.random.key(0)), unwrap(carry),
                 *first_layer)
  keys = jax.random.split(env.get_and_rotate_prng_key(), count) if drew[0] else None

  def body(carry: Any, xs: tuple) -> tuple[Any, None]:
    layer_params, layer_buffers, key = xs
    return run_layer(carry, layer_params, layer_buffers, key), None

  body = jax.checkpoint(body, policy=policy)
  if grad_reads.differentiable((carry, params, shared_args, shared_kwargs)):  # a backward follows
    body = recompute.residuals_read_whole(body)
  final, _ = jax.lax.scan(body, unwrap(carry), (unwrap(params), unwrap(buffers), keys),
                          length=count)
  return grad_reads.like(wrap(final), (carry, params))


def _layer_arguments(template: torch.nn.Module, carry: Any, shared_args: tuple,
                     shared_kwargs: dict) -> Callable[[Any], tuple]:
  """How a layer gets the carry: as one argument, or a tuple carry spread over its arguments
  when the layer's forward cannot take it as one (upstream's way: `forward(self, x, y, z)`)."""
  shared = tuple(shared_args)
  if isinstance(carry, tuple):
    signature = inspect.signature(template.forward)
    try:
      signature.bind(carry, *shared, **shared_kwargs)
    except TypeError:
      return lambda c: (*c, *shared)
  return lambda c: (c, *shared)
