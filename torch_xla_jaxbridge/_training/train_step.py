"""`train_step`: a training step (loss, gradients, optimizer update) as one graph node.

The loss function is torch code, traced once through torchax like any bridged function; its
gradients are `jax.value_and_grad`'s and the optimizer's update rule (`jb.optim`) runs in the same
JAX function, so a step adds one `call_jax` node to the LazyTensor graph instead of a forward, a
backward and an optimizer node (and the autograd engine's work between them): the least host
time per step.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from torch_xla_jaxbridge import errors, optim
from torch_xla_jaxbridge._bridge import api, auto, bridging, captures, rollback, spec
from torch_xla_jaxbridge._bridge import fallback as fallbacks
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._compat import jax_private, torch_xla_private
from torch_xla_jaxbridge._core import call, layer_loops, recompute, runtime, sharding

# Layer calls run as one loop from this many in a row (`layer_loop`): on XLA:CPU a loop compiles
# slower than 4 unrolled Llama layers and faster than 16 (scripts/bench_depth.py).
LOOP_FROM = 8


class TrainStep:  # size: its annotated signatures (typed core, issue 39) took it over 120
  """A training step made by `train_step`: call it with the loss function's arguments."""

  def __init__(self, loss_fn: Callable, optimizer: optim.RuleOptimizer,
               remat: remat_policies.RematArg, fallback: bool, layer_loop: bool | int) -> None:
    if not isinstance(optimizer, optim.RuleOptimizer):
      raise errors.UsageError(
          f"train_step: optimizer is a {type(optimizer).__name__}; the one-node step runs the "
          f"update rule of a jb.optim optimizer ({', '.join(optim.optimizers())}). Use one of "
          f"those, or call loss.backward() and optimizer.step() for other optimizers.")
    self.bridged = bridging.Bridged(loss_fn, remat=remat)
    self.optimizer, self.name, self.fallback = optimizer, self.bridged.name, fallback
    self.layer_loop = layer_loop
    self._roots: Callable[[], list] | None = None  # in a step, the loss's modules
    self.looped: tuple = ()  # the length of each run of layer calls the last trace looped
    self._groups_key: tuple | None = None  # what `_trained` and `_order` were made for
    self._diff_ids: tuple | None = None
    self._indices: list | None = None  # `_layer_indices`
    self.outcome = fallbacks.Outcome(f"train_step({self.name})", "step",
                                     lambda: self.bridged.traces)

  def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
    # through optimizer.step(), so its hooks run and LR schedulers see an optimizer step
    return self.optimizer.step_running(lambda: self._step_or_fall_back(args, kwargs))

  def _step_or_fall_back(self, args: tuple, kwargs: dict) -> torch.Tensor:
    if not self.outcome.fell_back:
      ran, loss = rollback.attempt(lambda: self._run(args, kwargs),
                                   lambda: rollback.region_of(self.bridged.fn, args, kwargs),
                                   lambda e: self.outcome.fall_back(e, self.fallback))
      if ran:
        self.outcome.bridged_again()
        return loss
    with self.outcome.plain_run():
      return self._plain_step(args, kwargs)

  def _plain_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
    """The step as plain LazyTensor code with the modules the loss reads bridged one by one:
    the loss, its gradients by autograd (never in `p.grad`), the optimizer's one-node update."""
    settings = auto.Settings(self.outcome.name, None, self.fallback)
    with torch.enable_grad(), auto.captured_bridged(self.bridged.fn, settings):
      loss = self.bridged.fn(*args, **kwargs)
      params = [p for group in self.optimizer.param_groups for p in group["params"]
                if p.requires_grad]
      grads = torch.autograd.grad(loss, params, allow_unused=True)
    used = [(p, g) for p, g in zip(params, grads) if g is not None]
    self.optimizer.check_params([p for p, _ in used], grads=False)
    self.optimizer.apply_gradients([p for p, _ in used], [g for _, g in used])
    return loss.detach()

  def _run(self, args: tuple, kwargs: dict) -> torch.Tensor:
    spec.register_static_pytree()
    bridged, optimizer = self.bridged, self.optimizer
    trained = self._trained()
    with torch.enable_grad():  # the loss is traced with grad on, as `_plain_step` runs it
      prepared = spec.prepare(bridged.fn, self.name, args, kwargs,
                              lambda t: id(t) in trained and t.requires_grad, refuse_hooks=True)
    if prepared.boxed:
      raise errors.UsageError(
          f"train_step: {self.name} takes an argument object holding tensors; pass its tensors "
          f"instead, or call the model and loss.backward() with optimizer.step().")
    if not (diff := prepared.diff):
      raise _nothing_trained(self.name, bridged.fn, prepared.args)
    params, positions = self._order(diff)
    states, scalars, statics = optimizer.prepare(params)
    statics = dict(statics, positions=positions)
    self._roots = lambda: rollback.region_of(bridged.fn, args, kwargs)[0]
    try:
      loss, update, (others, mutated, layout) = bridged.keyed(
          lambda key: call.call_jax(
              self._step, (prepared.spec, diff, prepared.other, key, states,
                           scalars.to(params[0].device),
                           self._layer_indices(args, kwargs, params[0].device)),
              statics, name=f"{self.name}_train_step"),
          params[0].device)
    finally:
      self._roots = None
    bridging.write_back(self.name, (prepared.args, prepared.kwargs), layout.mutated, mutated, diff)
    shardings = sharding.shardings_of(params)
    if shardings is not None:  # parameters and states stay sharded as the parameters are
      new_params, new_states, _ = update
      sharding.shard_like(new_params, shardings)
      if statics["layout"] is None:  # not flat state buffers (made only without SPMD)
        for param, state, shard in zip(new_params, new_states, shardings):
          like = [t for t in state.values() if t.shape == param.shape]  # not factored stats
          sharding.shard_like(like, [shard] * len(like))
    optimizer.take(params, update)
    return loss

  def _layer_indices(self, args: tuple, kwargs: dict, device: torch.device) -> list[torch.Tensor]:
    """Integer scalars 0, 1, ... on the device, one per call of the longest loop the loss's
    modules can hold, made once: the step's loops index their layers with them
    (`layer_loops.indexed_stack`), so the index is an input, not a constant."""
    if self._indices is None:  # loops are made only where `_step` makes them
      count = (layer_loops.most_calls(rollback.region_of(self.bridged.fn, args, kwargs)[0])
               if self.layer_loop and not sharding.spmd_enabled() else 0)
      self._indices = [torch.tensor(i, dtype=torch.int64, device=device) for i in range(count)
                       if count >= _least_loop(self.layer_loop)]
      torch_xla_private.sync_tensors(self._indices)
    return self._indices

  def _trained(self) -> set[int]:
    """The ids of the optimizer's parameters (kept while its groups hold the same parameters: a
    parameter swapped into a group's list in place is trained from its next step)."""
    key = self.optimizer.groups_key()
    if self._groups_key != key:
      self._groups_key = key
      self._trained_ids = {i for group in key for i in group}
      self._diff_ids = None  # `_order` reads the groups too
    return self._trained_ids

  def _order(self, diff: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """The optimizer's parameters among `diff` in `param_groups` order, and each one's position
    in `diff` (kept while `diff` and the groups hold the same parameters)."""
    ids = tuple(map(id, diff))
    if self._diff_ids != ids:
      self.optimizer.check_params(diff, grads=False)
      order = {id(p): i for i, p in enumerate(diff)}
      params = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) in order]
      self._diff_ids, self._ordered = ids, (params, tuple(order[id(p)] for p in params))
    return self._ordered

  def _step(self, spec_: spec.Spec, diff: Sequence[Any], other: Sequence[Any], key_data: Any,
            states: list, scalars: Any, indices: list, *, positions: tuple[int, ...],
            **statics: Any) -> tuple:
    jax = runtime.jax_module()

    def loss_of(*d: Any) -> tuple[Any, tuple]:
      floats, aux = self.bridged.run(spec_, d, other, key_data)
      layout = aux[2]
      if layout.kinds != (True,) or floats[0].shape != ():
        raise errors.UsageError(
            f"train_step: {self.name} must return the loss, one floating-point scalar tensor; "
            f"it returned {layout.out_tree.num_leaves} value(s): "
            f"{[tuple(f.shape) for f in floats]} floating-point shapes. Reduce the loss "
            f"(e.g. .mean()) and return only it.")
      return floats[0], aux

    chains: list = []
    with recompute.differentiated():
      if self.layer_loop and self._roots is not None and not sharding.spmd_enabled():
        loss_of, chains = _looped(self, loss_of, diff, indices)
      if self.bridged.policy is not None:
        loss_of = jax.checkpoint(loss_of, policy=self.bridged.policy)
      loss, vjp_fn, aux = jax.vjp(loss_of, *diff, has_aux=True)
      grads = vjp_fn(jax.numpy.ones_like(loss))
    # a parameter the loss does not depend on keeps its value and state, as torch's optimizers
    # skip a parameter whose .grad is None (AdamW would otherwise decay it)
    unread = jax_private.tangents_unread(vjp_fn)
    params = [diff[i] for i in positions]
    grads = [grads[i] for i in positions]
    moved = (statics["layout"].moved(_layer_parameters(chains, positions, len(indices)), indices)
             if statics["layout"] is not None else None)
    return loss, optim.apply_rule(params, grads, states, scalars, moved=moved,
                                  unchanged=tuple(k for k, i in enumerate(positions)
                                                  if i in unread), **statics), aux


def _looped(step: TrainStep, loss_of: Callable, diff: Sequence[Any],
            indices: Sequence[Any]) -> tuple[Callable, list]:
  """`loss_of` with its runs of at least `LOOP_FROM` (or `layer_loop`) identical layer calls as
  loops, and the runs found; sets `step.looped`."""
  assert step._roots is not None  # set by `_run` around the step's trace
  found = layer_loops.scanned(loss_of, list(diff), step._roots(), _least_loop(step.layer_loop),
                              indices)
  step.looped = tuple(len(c.segments) for c in found[1]) if found else ()
  return found if found else (loss_of, [])


def _least_loop(layer_loop: bool | int) -> int:
  """The fewest calls in a row that loop (`train_step`'s `layer_loop`)."""
  return LOOP_FROM if layer_loop is True else int(layer_loop)


def _layer_parameters(chains: list, positions: Sequence[int], indices: int) -> list[list[int]]:
  """Per input a loop stacks by traced indices (a loop of at most `indices` calls) that is a
  trained parameter in every layer: that parameter's index among the step's, layer by layer."""
  at = {d: i for i, d in enumerate(positions)}
  return [[at[d] for d in per_call] for chain in chains if len(chain.maps) <= indices
          for per_call in chain.arguments if all(d in at for d in per_call)]


def _nothing_trained(name: str, fn: Callable, args: tuple) -> errors.UsageError:
  return errors.UsageError(
      f"train_step: none of the tensors {name} reads (its arguments, and what it captures: "
      f"{_captured(args)}) is a parameter of the optimizer.{captures.hint(fn)} Pass the model as "
      f"an argument (`jb.train_step(lambda model, batch: model(**batch).loss, opt)`, called as "
      f"`step(model, batch)`), or read it into a variable the loss function closes over (`model "
      f"= trainer.model`, then `lambda batch: model(**batch).loss`).")


def _captured(args: tuple) -> str:
  """The modules and tensors a call's `Lifted` first argument holds, by name, for an error."""
  if not (args and isinstance(args[0], captures.Lifted)):
    return "no module or tensor"
  return ", ".join(f"`{name}` (a {kind})" for _, name, kind, *_ in args[0].layout
                   if kind != "value") or "no module or tensor"


_TAKES = (
    "the loss function, torch code that computes the loss and that each step calls with the "
    "step's arguments, not a loss already computed: `step = jb.train_step(lambda x, y: "
    "F.mse_loss(model(x), y), optimizer)`, then `loss = step(x, y)` each step.")


def train_step(loss_fn: Callable[..., torch.Tensor], optimizer: optim.RuleOptimizer, *,
               remat: remat_policies.RematArg = None, fallback: bool = True,
               layer_loop: bool | int = True) -> TrainStep:
  """One training step as one graph node: `loss_fn`'s loss, its gradients with respect to the
  optimizer's parameters, and the optimizer's update.

  `loss_fn` is torch code returning a scalar loss; the parameters it reads (of modules it closes
  over, reaches through objects, dicts, lists, a bound method's `self` or a partial's arguments,
  or takes as arguments) that `optimizer` (any `jb.optim` optimizer) holds are trained, with
  the optimizer's param groups, clipping and learning rate (schedulers keep working: the rates
  travel as a device input). Each call returns the loss as an XLA tensor and updates the
  parameters and optimizer state in place; `optimizer.grad_norm` holds the norm before clipping.
  Gradients are not written to `p.grad`. Randomness (dropout) is fresh each step. `remat=` is as
  for `jb.bridge`; modules inside may be `BridgeModule`s or `StackedLayers` with their own
  policies. Where the loss cannot be bridged as a whole (data-dependent Python control flow such
  as LayerDrop, an op with no lowering), the step falls back (`fallback=True`): the loss runs as
  plain LazyTensor code with the modules it reads bridged one by one, its gradients by autograd,
  and the same optimizer update; said once and listed in `jb.bridge_report()`. A step that finds
  a forward, pre- or backward hook on a module the loss reads runs so too (the hooks run at
  every step, as in plain torch_xla), that step only (docs/bridge.md). A model's own loop
  over `LOOP_FROM` or more layers of one class (a `ModuleList`) whose calls trace into the same
  program runs as one loop in the step's program (one layer body, whatever the depth; the
  lengths of the loops in `step.looped`); `layer_loop=n` loops runs of `n` or more calls,
  `layer_loop=False` keeps every layer's copy (on XLA:CPU a loop compiles faster at depth and
  steps slower: docs/scan.md). Under SPMD the layers are not looped yet.

  Example:
    >>> import torch, torch_xla, torch_xla_jaxbridge as jb
    >>> _ = torch.manual_seed(0)  # (unseeded, an initial loss near zero can end above it)
    >>> model = torch.nn.Linear(4, 1).to("xla")
    >>> opt = jb.optim.AdamW(model.parameters(), lr=0.1)
    >>> step = jb.train_step(lambda x, y: ((model(x) - y) ** 2).mean(), opt)
    >>> x, y = torch.ones(8, 4, device="xla"), torch.zeros(8, 1, device="xla")
    >>> losses = [step(x, y) for _ in range(20)]
    >>> losses[-1].item() < losses[0].item()
    True
  """
  api.check_function(loss_fn, "train_step", _TAKES)
  if not isinstance(layer_loop, int) or layer_loop < 0:
    raise errors.BadArgumentError(
        f"train_step: layer_loop={layer_loop!r}; give True (loop runs of {LOOP_FROM} or more "
        f"identical layer calls), False (no loops) or the least run length to loop, an int.")
  return TrainStep(loss_fn, optimizer, remat, fallback, layer_loop)
