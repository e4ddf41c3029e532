"""`jb.optim.Adafactor`: torch.optim.Adafactor's update (factored second moments) as a rule."""
from __future__ import annotations

from typing import Iterable

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime
from torch_xla_jaxbridge.optim._optimizer import RuleOptimizer
from torch_xla_jaxbridge.optim._rule import Rule, register


def _state_shapes(shape, dtype, options):
  if len(shape) > 1:
    return {"row_var": (shape[:-1] + (1,), dtype),
            "col_var": (shape[:-2] + (1,) + shape[-1:], dtype)}
  return {"variance": (shape, dtype)}


def _lerp(jnp, start, end, weight):
  """torch's `lerp` (its two-sided formula, exact at weight 1)."""
  return jnp.where(weight < 0.5, start + weight * (end - start),
                   end - (end - start) * (1 - weight))


def _rms(jnp, x):
  return jnp.linalg.norm(x.reshape(-1)) / x.size ** 0.5


def _update(p, g, state, hyper, options):
  jnp = runtime.jax_module().numpy
  g = -g if options["maximize"] else g
  eps1 = hyper["eps1"] if options["eps1_given"] else jnp.finfo(p.dtype).eps
  weight = hyper["one_minus_beta2_t"]
  alpha = jnp.maximum(hyper["eps2"], _rms(jnp, p)) * hyper["rho"]
  if options["decay"]:
    p = p * hyper["decay"]
  if g.ndim > 1:
    row_var = _lerp(jnp, state["row_var"],
                    jnp.square(jnp.linalg.norm(g, axis=-1, keepdims=True)) / g.shape[-1], weight)
    col_var = _lerp(jnp, state["col_var"],
                    jnp.square(jnp.linalg.norm(g, axis=-2, keepdims=True)) / g.shape[-2], weight)
    estimate = (row_var @ col_var) / jnp.maximum(row_var.mean(axis=-2, keepdims=True), eps1)
    new_state = {"row_var": row_var, "col_var": col_var}
  else:
    estimate = _lerp(jnp, state["variance"], g * g, weight)
    new_state = {"variance": estimate}
  update = runtime.jax_module().lax.rsqrt(jnp.maximum(estimate, eps1 * eps1)) * g
  denom = jnp.maximum(1.0, _rms(jnp, update) / hyper["d"])
  return p - update * (alpha / denom), new_state


def _hyperparameters(group, step):
  lr, (eps1, eps2) = float(group["lr"]), group["eps"]
  return {"decay": 1 - lr * float(group["weight_decay"]),
          "one_minus_beta2_t": step ** float(group["beta2_decay"]),
          "rho": min(lr, 1 / step ** 0.5), "eps1": float(eps1 or 0.0), "eps2": float(eps2),
          "d": float(group["d"])}


def _options(group):
  return {"maximize": bool(group["maximize"]), "decay": group["weight_decay"] != 0,
          "eps1_given": group["eps"][0] is not None}


@register
class Adafactor(RuleOptimizer):
  """`torch.optim.Adafactor` (same arguments, update rule and `state_dict()`) whose step is one
  graph node: second moments factored into row and column statistics for matrices (`row_var`,
  `col_var`), a full `variance` for vectors, relative step sizes, update clipping by `d`.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.Adafactor(model.parameters(), lr=1e-2)
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step()
    >>> [tuple(t.shape) for t in opt.state[model.weight].values()]
    [(), (2, 1), (1, 4)]
  """
  rule = Rule("adafactor", _state_shapes, _update, _hyperparameters, _options,
              counts_steps=True)

  def __init__(self, params: Iterable, lr: float = 1e-2, beta2_decay: float = -0.8,
               eps: tuple = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, *,
               maximize: bool = False, max_grad_norm: float | None = None):
    if not (lr >= 0 and beta2_decay <= 0 and (eps[0] is None or eps[0] >= 0) and eps[1] >= 0
            and d >= 1 and weight_decay >= 0):
      raise errors.BadArgumentError(
          f"Adafactor: needs lr, weight_decay, eps >= 0, beta2_decay <= 0 and d >= 1; got "
          f"lr={lr}, beta2_decay={beta2_decay}, eps={tuple(eps)}, d={d}, "
          f"weight_decay={weight_decay}.")
    super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                                  weight_decay=weight_decay, maximize=maximize),
                     max_grad_norm=max_grad_norm)
