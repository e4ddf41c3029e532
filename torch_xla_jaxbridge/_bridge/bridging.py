"""`bridge`, `assume_pure`: torch code traced once per signature, its backward by `jax.vjp`.

A bridged call prepares its arguments (`spec.prepare`), adds one `call_jax` node: the forward half
of `jax.vjp` of the torchax-converted function, whose residuals stay in the graph as XLA tensors;
when torch's backward reaches the call, a second node applies the saved `vjp` function to the
output cotangents (`vjp`). Inside bridged code a bridged function runs in the enclosing trace
(`inline`).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import captures, inline, rollback, stateful, vjp
from torch_xla_jaxbridge._bridge import fallback as fallbacks
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge import spec as spec_
from torch_xla_jaxbridge._bridge.spec import Layout, register_static_pytree
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import call, modules, rng, runtime, tracing
from torch_xla_jaxbridge._core.runtime import PyTree

if TYPE_CHECKING:
  import jax

  from torch_xla_jaxbridge._bridge.api import Fallback

_F = TypeVar("_F", bound=Callable[..., Any])

# `(floats, others, mutated, layout)`: a call's outputs as `_invoke` and `keyed` give them
Outputs = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor], Layout]
Seed = int | torch.Tensor | None  # `rng_seed`
Invoke = Callable[[torch.Tensor], Any]  # `keyed`'s: the call, given the random key data
Arrays = Sequence["jax.Array"]


class Bridged(Generic[_F]):
  """A torch function traced once per signature through torchax; see `bridge`.

  Example:
    >>> double = Bridged(lambda x: x * 2)
    >>> double(torch.ones(2, device="xla")).cpu().tolist()
    [2.0, 2.0]
  """

  def __init__(self, fn: _F, *, remat: remat_policies.RematArg = None,
               name: str | None = None, lift: bool = True) -> None:
    self.policy = remat_policies.policy_for(remat)  # validates `remat`
    # False: `fn` is the bridge's own (a module's forward over a template module): what it holds
    # is not captured, its state comes as arguments
    self.lift = lift
    self.offloads = remat_policies.offloads(remat)
    self.fn = fn
    self.name = call.function_name(fn, name)
    self.seeded = False  # assume_pure(add_rng_seed_argument=True) passes its own seed
    self.draws_random: bool | None = None  # until traced; then: did any trace draw random numbers
    self.traces = 0  # how many times the torch code was traced (outside enclosing traces)
    self.x64 = True  # traced in JAX's 64-bit mode (`keyed`)
    # api.Fallback: its outcome, and the call when the code cannot be bridged;
    # None: the error propagates (to a caller that decides, e.g. auto.ModuleBridge)
    self.fallback: Fallback | None = None
    functools.update_wrapper(self, fn, updated=())

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    register_static_pytree()
    if self.seeded and "rng_seed" not in kwargs:
      raise errors.MissingSeedError(
          f"{self.name}: made with add_rng_seed_argument=True, so it takes a keyword rng_seed= "
          f"(an int or an integer tensor); none was given.")
    seed = kwargs.pop("rng_seed") if self.seeded else None
    if torch_private.torch_tracer_active():  # traced by torch (torch_xla's scan): plain code
      if self.fallback is not None and not torch_private.dynamo_compiling():  # (not in Dynamo's
        fallbacks.traced_by_torch(self.fallback.outcome)                     # graph)
      return self.fn(*args, **kwargs)
    if self.fallback is not None and off_xla((args, kwargs)):  # CPU tensors only: plain code
      return self.fn(*args, **kwargs)
    if _any_traced((args, kwargs)):  # called inside bridged code: run in the enclosing trace
      return inline.run_inline(self, args, kwargs, seed)
    if (fallback := self.fallback) is None:
      return self._bridged_call(args, kwargs, seed)
    return fallback.call(lambda: self._bridged_call(args, kwargs, seed), args, kwargs)

  def _bridged_call(self, args: tuple, kwargs: dict, seed: Seed) -> Any:
    grad_on = torch.is_grad_enabled()
    call_ = spec_.prepare(self.fn, self.name, args, kwargs,
                          lambda t: grad_on and t.requires_grad, lift=self.lift,
                          refuse_hooks=self.fallback is not None)
    device = _device(call_.diff, call_.other)
    floats, others, mutated, layout = self.keyed(
        lambda key: self._invoke(call_.spec, key, call_.diff, call_.other), device, seed)
    write_back(self.name, (call_.args, call_.kwargs), layout.mutated, mutated, call_.diff)
    outputs = layout.rebuild(floats, others, (call_.args, call_.kwargs))
    if call_.boxed:
      outputs, after = outputs
      stateful.write_back(call_.boxed, after, device)
    return stateful.unpack_outputs(outputs, device) if layout.packed else outputs

  def keyed(self, invoke: Invoke, device: torch.device, seed: Seed = None) -> Any:
    """`invoke(key_data)` with the random key this call needs. Code that never draws random
    numbers gets a constant key (drawing one costs host time, and a first call with a fresh key
    would make a first-step program that differs from the rest); when the trace `invoke` makes
    shows that it does draw, it is invoked again with a fresh key (`seed`: from that seed).

    Traced in JAX's 64-bit mode, whatever the inputs: torch's int64 indices and float64 values
    exist there (`_core.torch_dtypes`). JAX code written for 32-bit mode that the torch code
    calls (a Pallas kernel through torch_xla's `call_jax`) may fail to trace or lower in it: then
    the function is traced in 32-bit mode from then on, as before this rule (indices int32)."""
    try:
      return self._keyed(invoke, device, seed)
    except errors.JaxTracingError as e:
      if type(e) is not errors.JaxTracingError or not self.x64:  # not a matter of the mode
        raise
      self.x64 = False
      return self._keyed(invoke, device, seed)

  def _keyed(self, invoke: Invoke, device: torch.device, seed: Seed) -> Any:
    fresh = seed is not None or bool(self.draws_random)
    with call.in_x64(self.x64):
      result = invoke(rng.key_data(seed, device) if fresh else rng.constant_key_data(device))
      if not fresh and self.draws_random:  # this call traced code that does: a fresh key
        result = invoke(rng.key_data(None, device))
    return result

  def _invoke(self, spec: spec_.Spec, key_data: torch.Tensor, diff: list, other: list) -> Outputs:
    if diff:
      holder: list = []
      floats = vjp.VjpFunction.apply(self, spec, key_data, holder, tuple(other), *diff)
      layout, others, mutated = holder[0]
      return floats, others, mutated, layout
    floats, others, mutated, layout = call.call_jax(
        self._plain_half, (spec, tuple(other), key_data), name=f"{self.name}_fwd")
    return floats, others, mutated, layout

  def run(self, spec: spec_.Spec, diff: Arrays, other: Arrays,
          key_data: jax.Array | None) -> tuple[list, tuple[list, list, Layout]]:
    """The traced torch function on arrays: `(floats, (others, mutated, layout))`, the output
    leaves split into floating-point ones (differentiable) and the rest."""
    jax = runtime.jax_module()
    args, kwargs = spec.merge(diff, other)
    fn = captures.calling(self.fn, args)  # captured tensors put back where `fn` reads them
    fn = stateful.packing(fn)  # outputs only torch's pytrees know (a Hugging Face ModelOutput)
    if stateful.has_snapshots((args, kwargs)):
      fn = stateful.functionalized(fn)
    self.traces += 1
    aliases: list = []
    try:
      with rollback.tracing(self.name):
        outputs, mutated, drew_random = tracing.run_torch(
            fn, key_data, args, kwargs, fn_name=self.name, grad=spec.autograd(diff, other),
            aliases=aliases)
    except errors.CapturedTensorError as e:  # completed with where the search for captures stopped
      more = captures.hint(self.fn) if self.lift else ""
      if not more:
        raise
      raise type(e)(f"{e}{more}") from e.__cause__
    self.draws_random = bool(self.draws_random) or drew_random
    out_leaves, out_tree = jax.tree.flatten(outputs)
    kinds = spec_.output_kinds(out_leaves, aliases)
    floats = [x for x, kind in zip(out_leaves, kinds) if kind is True]
    others = [x for x, kind in zip(out_leaves, kinds) if kind is False]
    positions = tuple(sorted(mutated))
    layout = Layout(out_tree, kinds, positions, stateful.has_packed(outputs))
    return floats, (others, [mutated[i] for i in positions], layout)

  def _plain_half(self, spec: spec_.Spec, other: Arrays, key_data: jax.Array) -> Outputs:
    floats, (others, mutated, layout) = self.run(spec, (), other, key_data)
    return floats, others, mutated, layout

  def forward_half(self, spec: spec_.Spec, diff: Arrays, other: Arrays,
                   key_data: jax.Array) -> tuple:
    """The forward half of `jax.vjp` of `run`: outputs, and the residuals the backward needs."""
    return vjp.forward_half(lambda *d: self.run(spec, d, other, key_data), self.policy, diff)

  def backward_half(self, saved: tuple, inputs: Arrays, cotangents: Arrays) -> Any:
    """`vjp.backward_half`, a method so that its programs are cached with this function (and
    go when it goes), as the forward's are."""
    return vjp.backward_half(saved, inputs, cotangents)


def _any_traced(tree: PyTree) -> bool:
  traced = tracing.torchax_tensor_type()  # None until the first trace imports torchax
  return traced is not None and any(
      isinstance(leaf, traced) for leaf in runtime.jax_module().tree.leaves(tree))


def off_xla(tree: PyTree, state: torch.Tensor | None = None) -> bool:
  """Whether a call runs off the XLA device (an evaluation or an export on the CPU): `state`, one
  of a module's parameters or buffers, is not on it, or, where there is none, `tree` holds
  tensors and none of them is on it. Bridged code runs on XLA tensors: such a call runs the torch
  code itself (not bridged, and no fallback: back on XLA it is bridged again).

  Example:
    >>> off_xla((torch.ones(2),)), off_xla((torch.ones(2, device="xla"),)), off_xla((3,))
    (True, False, False)
  """
  if state is not None:
    return not _on_xla(state)
  tensors = [t for t in runtime.jax_module().tree.leaves(tree) if isinstance(t, torch.Tensor)]
  return bool(tensors) and not any(map(_on_xla, tensors))


def _on_xla(tensor: torch.Tensor) -> bool:
  """An XLA tensor, or a torchax one (inside bridged code, where it says it is on the XLA device
  it came from). `is_xla` first: reading `.device` of an XLA tensor cost about 5 us a call in a
  forward (4% of an 8-layer model's host time)."""
  return (tensor.is_xla  # type: ignore[attr-defined]  # not in torch's stubs
          or tensor.device.type in ("xla", "jax"))


def one_tensor(walk: modules.StateWalk) -> torch.Tensor | None:
  """The first parameter or buffer of a module's `walk` (what `off_xla` reads: one dictionary
  read per call), or None where it holds none.

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> one_tensor(modules.StateWalk(layer)) is layer.weight
    True
  """
  for entry in walk.entries:  # (prefix, submodule, parameter names, buffer names, ...)
    if (entry[2] or entry[3]) and (sub := entry[1]()) is not None:
      for table, keys in ((torch_private.parameters_table(sub), entry[2]),
                          (torch_private.buffers_table(sub), entry[3])):
        for key in keys:
          if (tensor := table.get(key)) is not None:
            return tensor
  return None


def _device(diff: list[torch.Tensor], other: list[torch.Tensor]) -> torch.device:
  for tensor in diff + other:
    if tensor.is_xla:  # type: ignore[attr-defined]  # torch's stubs lack is_xla
      return tensor.device
  import torch_xla
  return torch_xla.device()


def write_back(name: str, tree: PyTree, positions: Sequence[int], values: Sequence[Any],
               diff: Sequence[torch.Tensor]) -> None:
  """Applies the in-place updates the traced code made to its arguments, as eager torch would."""
  if not positions:
    return
  leaves = runtime.jax_module().tree.leaves(tree)
  diff_ids = {id(t) for t in diff}
  for pos, value in zip(positions, values):
    target = leaves[pos]
    if id(target) in diff_ids:
      raise errors.MutationError(
          f"{name}: an argument that requires grad (shape {tuple(target.shape)}) was modified in "
          f"place. Bridged code cannot write that back without losing its gradient: work on a "
          f"copy (`x = x.clone()`) or return the new value.")
    with torch.no_grad():
      target.copy_(value)
