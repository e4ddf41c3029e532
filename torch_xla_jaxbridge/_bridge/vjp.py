"""The two halves of `jax.vjp` as graph nodes, and their `torch.autograd.Function`.

The forward half returns the outputs and the residuals the backward needs; torch's backward runs
the backward half on them as a second node. With a remat policy, the recomputation runs in a
conditional XLA cannot fold, so it happens once the cotangents exist and is not merged with the
forward it repeats.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.spec import Residuals
from torch_xla_jaxbridge._compat import jax_private
from torch_xla_jaxbridge._core import call, dtypes, recompute, runtime, sharding

if TYPE_CHECKING:
  from torch_xla_jaxbridge._bridge.bridging import Bridged
  from torch_xla_jaxbridge._bridge.spec import Spec


def forward_half(run: Callable, policy: Callable | None, diff: Sequence[Any]) -> tuple:
  """The forward half of `jax.vjp` of `run(*diff)` (in `jax.checkpoint` under `policy`):
  `(floats, others, mutated, (Residuals, computed residuals), layout)` for `run`'s outputs
  `(floats, (others, mutated, layout))`."""
  jax = runtime.jax_module()
  if policy is not None:
    run = jax.checkpoint(run, policy=policy)
  with recompute.differentiated():
    floats, vjp_fn, (others, mutated, layout) = jax.vjp(run, *diff, has_aux=True)
  vjp_fn = jax_private.vjp_without_known_values(vjp_fn)  # no traced value in its tree
  residuals, tree = jax.tree.flatten(vjp_fn)
  # a residual that is one of the inputs (a weight kept for the input's gradient) is not
  # returned by the forward: that would add an output, and a copy, per parameter
  position = {id(x): i for i, x in enumerate(diff)}
  used = sorted({position[id(r)] for r in residuals if id(r) in position})
  index: dict[int | None, int] = {p: i for i, p in enumerate(used)}
  sources = tuple(index.get(position.get(id(r))) for r in residuals)
  computed = [r for r, source in zip(residuals, sources) if source is None]
  on_host = tuple(getattr(jax.typeof(r), "memory_space", None) == jax.memory.Space.Host
                  for r in computed)
  kept = Residuals(tree, sources, tuple(used), tuple(r.dtype for r in computed), on_host,
                   policy is not None, bool(jax.config.jax_enable_x64),
                   tuple(sorted(jax_private.tangents_unread(vjp_fn))))
  computed = [dtypes.torch_compatible(jax, r) for r in computed]
  return floats, others, mutated, (kept, computed), layout


def backward_half(saved: tuple[Residuals, list], inputs: Sequence[Any],
                  cotangents: Sequence[Any]) -> Any:
  """The backward half: gradients of the differentiable inputs, from the forward's residuals."""
  jax = runtime.jax_module()
  kept, computed = saved
  restored = [dtypes.restore(jax, r, d) for r, d in zip(computed, kept.dtypes)]
  # an offloaded residual arrives as it left the forward, in host memory; the vjp moves it back
  arrived = iter([jax.device_put(r, jax.memory.Space.Host) if host else r
                  for r, host in zip(restored, kept.on_host)])
  residuals = [next(arrived) if source is None else inputs[source] for source in kept.sources]
  vjp = lambda r, c: kept.tree.unflatten(r)(c)  # noqa: E731
  cotangents = list(cotangents)
  if kept.sequenced and any(c.size for c in cotangents):
    return recompute.in_conditional(vjp, residuals, cotangents)
  return vjp(residuals, cotangents)


class VjpFunction(torch.autograd.Function):

  @staticmethod
  def forward(ctx: Any, bridged: Bridged, spec: Spec, key_data: torch.Tensor, holder: list,
              other: tuple, *diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if bridged.offloads and runtime.lowering_platform() == "cpu":
      remat_policies.warn_offload_dropped("cpu")
    floats, others, mutated, saved, layout = call.call_jax(
        bridged.forward_half, (spec, diff, other, key_data), name=f"{bridged.name}_fwd")
    # every tensor the backward reads is saved as torch saves (and frees after the backward,
    # whoever still holds the graph): an attribute of ctx would keep the residuals alive, and
    # each would become an output of the step's program; torch checks the inputs' versions
    kept, computed = saved
    ctx.kept, ctx.inputs = kept, len(kept.inputs)
    ctx.save_for_backward(*[diff[i] for i in kept.inputs], *computed)
    ctx.bridged = bridged  # its backward programs are cached with it, and die with it
    ctx.shardings = sharding.shardings_of(diff)
    holder.append((layout, others, mutated))
    return tuple(floats)

  @staticmethod
  def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple:
    try:
      tensors = list(ctx.saved_tensors)
      saved = (ctx.kept, tensors[ctx.inputs:])
      with call.in_x64(ctx.kept.x64):  # the vjp (a recomputation too) was traced in it
        grads = call.call_jax(ctx.bridged.backward_half,
                              (saved, tensors[:ctx.inputs], cotangents),
                              name=f"{ctx.bridged.name}_bwd")
    except errors.JaxTracingError as e:
      if not jax_private.is_while_loop_gradient_error(e):
        raise
      raise errors.ControlFlowError(
          f"{ctx.bridged.name}: a gradient was asked through torch.while_loop, whose trip count "
          f"depends on the data; JAX's while loop is forward-only. Use jb.fori_loop(lower, upper, "
          f"body, init) when the count is known, run the loop under torch.no_grad(), or detach "
          f"its inputs.") from e
    sharding.shard_like(grads, ctx.shardings)  # a gradient is sharded as its input, not left to chance
    # an input no output depends on gets no gradient, as torch's autograd gives it none
    return (None, None, None, None, None,
            *[None if i in ctx.kept.no_gradient else g for i, g in enumerate(grads)])
