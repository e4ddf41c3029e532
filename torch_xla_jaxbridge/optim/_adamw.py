"""`jb.optim.AdamW`: torch.optim.AdamW's update as a rule."""
from __future__ import annotations

from typing import Iterable

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime
from torch_xla_jaxbridge.optim._optimizer import RuleOptimizer
from torch_xla_jaxbridge.optim._rule import Rule, register


def _state_shapes(shape, dtype, options):
  shapes = {"exp_avg": (shape, dtype), "exp_avg_sq": (shape, dtype)}
  if options["amsgrad"]:
    shapes["max_exp_avg_sq"] = (shape, dtype)
  return shapes


def _update(p, g, state, hyper, options):
  f32 = runtime.jax_module().numpy.float32
  jnp = runtime.jax_module().numpy
  g = g.astype(f32)
  g = -g if options["maximize"] else g
  m = state["exp_avg"].astype(f32)
  m = m + hyper["one_minus_beta1"] * (g - m)                           # exp_avg.lerp_(g, 1 - b1)
  v = state["exp_avg_sq"].astype(f32) * hyper["beta2"] + hyper["one_minus_beta2"] * g * g
  new_state = {"exp_avg": m, "exp_avg_sq": v}
  if options["amsgrad"]:
    v = new_state["max_exp_avg_sq"] = jnp.maximum(state["max_exp_avg_sq"].astype(f32), v)
  denom = jnp.sqrt(v) / hyper["bias_correction2_sqrt"] + hyper["eps"]
  return p.astype(f32) * hyper["decay"] + hyper["neg_step_size"] * m / denom, new_state


def _hyperparameters(group, step):
  lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
  beta1, beta2 = (float(b) for b in group["betas"])
  return {"neg_step_size": -(lr / (1 - beta1**step)),
          "bias_correction2_sqrt": (1 - beta2**step)**0.5, "decay": 1 - lr * weight_decay,
          "one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
          "eps": float(group["eps"])}


def _options(group):
  return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"])}


@register
class AdamW(RuleOptimizer):
  """`torch.optim.AdamW` (same arguments, update rule and `state_dict()`), with gradient clipping
  by global norm, whose whole step is one graph node.

  `max_grad_norm` (None: no clipping) clips as `torch.nn.utils.clip_grad_norm_` over all groups
  would; after each step `grad_norm` holds the gradients' 2-norm before clipping, an XLA tensor
  computed in the step's graph (None without clipping: `max_grad_norm=float("inf")` reports the
  norm and never clips). The state is torch's: per parameter `step` (a CPU float32
  tensor), `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` with amsgrad, so state dicts load into
  `torch.optim.AdamW` and back.

  Example:
    >>> import torch, torch_xla, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> schedule = torch.optim.lr_scheduler.LambdaLR(opt, jb.optim.warmup_cosine(10, 100))
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step(); schedule.step(); torch_xla.sync()
    >>> round(opt.grad_norm.item(), 4)  # before clipping: sqrt(2 * 3**2 * 4 + 2 * 3**2)
    9.4868
  """
  rule = Rule("adamw", _state_shapes, _update, _hyperparameters, _options, counts_steps=True)

  def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
               maximize: bool = False, max_grad_norm: float | None = None):
    if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
      raise errors.BadArgumentError(
          f"AdamW: needs lr, eps, weight_decay >= 0 and 0 <= beta < 1; got lr={lr}, eps={eps}, "
          f"weight_decay={weight_decay}, betas={tuple(betas)}.")
    super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  amsgrad=amsgrad, maximize=maximize),
                     max_grad_norm=max_grad_norm)
