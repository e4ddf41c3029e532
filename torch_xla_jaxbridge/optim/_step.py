"""The step of a rule over every parameter, as one JAX function: global norm, clipping, updates."""
from __future__ import annotations

import functools
from typing import Any

from torch_xla_jaxbridge._core import runtime
from torch_xla_jaxbridge.optim._flat import FlatLayout
from torch_xla_jaxbridge.optim._rule import Rule


def _sum_of_squares(jnp, g):
  if jnp.iscomplexobj(g):
    return jnp.sum(jnp.abs(g) ** 2)
  g = g.astype(jnp.float32)
  return jnp.sum(g * g)


@functools.cache
def _traced_once(rule: Rule, options: tuple) -> Any:
  """`rule.update` with `options` (its items, sorted) as a `jax.jit` function, one per rule and
  options: inside the step's trace JAX traces and lowers it once per parameter shape and dtype,
  and the step calls that one program for every parameter of that shape (9 programs for a
  Llama's 288 parameters at 32 layers, instead of 288 traces)."""
  return runtime.jax_module().jit(
      lambda p, g, state, hyper: rule.update(p, g, state, hyper, dict(options)))


def apply_rule(params: list, grads: list, states: list, scalars: Any, *, rule: Rule,
               names: tuple, options: tuple, clip: bool, rows: tuple | None = None,
               layout: FlatLayout | None = None, moved: dict | None = None,
               unchanged: tuple = ()) -> tuple:
  """New parameters, new states and the gradients' global 2-norm (before clipping; None without
  `clip`: a reduction per parameter, one kernel each in the step's program) after one step of
  `rule`. `scalars` (float32): per row the values of `names` (hyperparameters), then
  the clipping norm; `options` per row; `rows` gives each parameter's row (None: a row each);
  with `clip` the gradients are first scaled as `torch.nn.utils.clip_grad_norm_` scales them.
  With `layout`, `states` (and the new states returned) are its flat buffers, read at the
  traced offsets of `moved` (`FlatLayout.moved`) where it has them. The parameters at positions
  `unchanged` (their gradients are zero by construction) keep their values and states.

  Example:
    >>> import jax.numpy as jnp
    >>> from torch_xla_jaxbridge.optim._rule import Rule
    >>> plain = Rule("plain", lambda shape, dtype, options: {},
    ...              lambda p, g, state, hyper, options: (p - hyper["lr"] * g, state),
    ...              lambda group, step: {"lr": group["lr"]})
    >>> new, _, norm = apply_rule([jnp.ones(2)], [jnp.full(2, 3.0)], [{}], jnp.array([0.5, 0.0]),
    ...                           rule=plain, names=("lr",), options=({},), clip=False)
    >>> new[0].tolist(), norm
    ([-0.5, -0.5], None)
  """
  jnp = runtime.jax_module().numpy
  buffers, states = states, layout.split(states, moved) if layout is not None else states
  grad_norm = None
  if clip:
    norms = jnp.stack([jnp.sqrt(_sum_of_squares(jnp, g)) for g in grads])  # as clip_grad_norm_:
    grad_norm = jnp.sqrt(jnp.sum(norms * norms))                           # the norm of norms
    scale = jnp.minimum(scalars[-1] / (grad_norm + 1e-6), 1.0)
    grads = [(g if jnp.iscomplexobj(g) else g.astype(jnp.float32)) * scale for g in grads]
  rows = rows if rows is not None else tuple(range(len(params)))
  table = scalars[:-1].reshape(len(options), len(names))
  hypers = [{name: table[r, k] for k, name in enumerate(names)} for r in range(len(options))]
  updates = [_traced_once(rule, tuple(sorted(o.items()))) for o in options]
  new_params, new_states = [], []
  for i, (p, g, state) in enumerate(zip(params, grads, states)):
    new_p, new_state = ((p, state) if i in unchanged else
                        updates[rows[i]](p, g, state, hypers[rows[i]]))
    new_params.append(new_p.astype(p.dtype))
    new_states.append({k: v.astype(state[k].dtype) if k in state else v
                       for k, v in new_state.items()})
  if layout is not None:
    new_states = layout.join(new_states, buffers, jnp)
  return new_params, new_states, grad_norm
