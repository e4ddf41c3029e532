"""`jb.optim.Lion`: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms") as a rule: the sign of an interpolated momentum, with decoupled weight decay."""
from __future__ import annotations

from typing import Iterable

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime
from torch_xla_jaxbridge.optim._optimizer import RuleOptimizer
from torch_xla_jaxbridge.optim._rule import Rule, register


def _state_shapes(shape, dtype, options):
  return {"exp_avg": (shape, dtype)}


def _update(p, g, state, hyper, options):
  jnp = runtime.jax_module().numpy
  g = g.astype(jnp.float32)
  g = -g if options["maximize"] else g
  m = state["exp_avg"].astype(jnp.float32)
  direction = jnp.sign(hyper["beta1"] * m + hyper["one_minus_beta1"] * g)
  new_p = p.astype(jnp.float32) * hyper["decay"] - hyper["lr"] * direction
  return new_p, {"exp_avg": hyper["beta2"] * m + hyper["one_minus_beta2"] * g}


def _hyperparameters(group, step):
  lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
  return {"lr": lr, "decay": 1 - lr * float(group["weight_decay"]), "beta1": beta1,
          "one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2}


@register
class Lion(RuleOptimizer):
  """Lion: `p <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)`, then
  `m <- beta2 * m + (1 - beta2) * g`, the whole step one graph node. State per parameter:
  `exp_avg` (m). Lion's step is the same size for every coordinate, so its usual learning rate
  is 3-10x smaller than AdamW's and its weight decay as many times larger.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[model.weight])
    ['exp_avg']
  """
  rule = Rule("lion", _state_shapes, _update, _hyperparameters,
              lambda group: {"maximize": bool(group["maximize"])})

  def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple = (0.9, 0.99),
               weight_decay: float = 0.0, *, maximize: bool = False,
               max_grad_norm: float | None = None):
    if not (lr >= 0 and weight_decay >= 0 and all(0 <= b <= 1 for b in betas)):
      raise errors.BadArgumentError(
          f"Lion: needs lr, weight_decay >= 0 and 0 <= beta <= 1; got lr={lr}, "
          f"weight_decay={weight_decay}, betas={tuple(betas)}.")
    super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                  maximize=maximize), max_grad_norm=max_grad_norm)
