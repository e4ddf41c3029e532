"""`jb.optim.SGD`: torch.optim.SGD's update as a rule."""
from typing import Iterable

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge.optim._optimizer import RuleOptimizer
from torch_xla_jaxbridge.optim._rule import Rule, register


def _state_shapes(shape, dtype, options):
  return {"momentum_buffer": (shape, dtype)} if options["momentum"] else {}


def _update(p, g, state, hyper, options):
  g = -g if options["maximize"] else g
  if options["decay"]:
    g = g + hyper["weight_decay"].astype(g.dtype) * p
  if not options["momentum"]:
    return p - hyper["lr"].astype(p.dtype) * g, {}
  momentum = hyper["momentum"].astype(g.dtype)
  buf = g if options["first"] else (momentum * state["momentum_buffer"] +
                                    hyper["one_minus_dampening"].astype(g.dtype) * g)
  g = g + momentum * buf if options["nesterov"] else buf
  return p - hyper["lr"].astype(p.dtype) * g, {"momentum_buffer": buf}


def _hyperparameters(group, step):
  return {"lr": float(group["lr"]), "momentum": float(group["momentum"]),
          "one_minus_dampening": 1.0 - float(group["dampening"]),
          "weight_decay": float(group["weight_decay"])}


def _options(group):
  return {"momentum": group["momentum"] != 0, "decay": group["weight_decay"] != 0,
          "nesterov": bool(group["nesterov"]), "maximize": bool(group["maximize"])}


@register
class SGD(RuleOptimizer):
  """`torch.optim.SGD` (same arguments, update rule and `state_dict()`) whose step is one node.

  For parameters on the XLA device. The momentum buffer of a parameter starts as its first
  gradient, as in torch, and lives in `state[p]["momentum_buffer"]`; without momentum there is
  no state. `max_grad_norm` clips first (see `RuleOptimizer`).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step()
  """
  rule = Rule("sgd", _state_shapes, _update, _hyperparameters, _options,
              first_step_differs=True, real_only=False)

  def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0,
               dampening: float = 0, weight_decay: float = 0, nesterov: bool = False, *,
               maximize: bool = False, max_grad_norm: float | None = None):
    if lr < 0 or momentum < 0 or weight_decay < 0:
      raise errors.BadArgumentError(
          f"SGD: lr, momentum and weight_decay must be >= 0; got lr={lr}, momentum={momentum}, "
          f"weight_decay={weight_decay}.")
    if nesterov and (momentum <= 0 or dampening != 0):
      raise errors.BadArgumentError("SGD: nesterov=True needs momentum > 0 and dampening = 0.")
    super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                  weight_decay=weight_decay, nesterov=nesterov,
                                  maximize=maximize), max_grad_norm=max_grad_norm)
