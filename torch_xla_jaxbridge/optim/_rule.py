"""An optimizer as an update rule: JAX functions over one parameter's arrays, and their registry.

A `Rule` says how one parameter and its state change in a step; `RuleOptimizer` makes a
`torch.optim.Optimizer` of it whose whole step is one graph node, and `jb.train_step` runs the
same rule inside its own node. Adding an optimizer is one module: its rule, its optimizer class
(the constructor's arguments and checks) and `register`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

# A rule's functions, by what they take and give (positional: a lambda's names are its own).


class StateShapes(Protocol):
  """`state_shapes(shape, dtype, options) -> {name: (shape, dtype)}`."""

  def __call__(self, shape: tuple, dtype: Any, options: dict, /) -> dict: ...


class Update(Protocol):
  """`update(param, grad, state, hyper, options) -> (new param, new state)`, on JAX arrays."""

  def __call__(self, param: Any, grad: Any, state: dict, hyper: dict, options: dict, /
               ) -> tuple: ...


class Hyperparameters(Protocol):
  """`hyperparameters(group, step) -> {name: float}`, read on the host at each step."""

  def __call__(self, group: dict, step: float, /) -> dict: ...


class Options(Protocol):
  """`options(group) -> {name: hashable}`: the group's static choices."""

  def __call__(self, group: dict, /) -> dict: ...


def _no_options(group: dict) -> dict:
  return {}


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one parameter is updated, as JAX functions over arrays.

  Attributes:
    name: the optimizer's name (the recipe's `train.optimizer`).
    state_shapes: `(shape, dtype, options) -> {name: (shape, dtype)}`, the parameter's state
      by torch's names (`exp_avg`, ...); every state tensor starts at zero, as in torch.
    update: `(param, grad, state, hyper, options) -> (new_param, new_state)`, one step of one
      parameter. `hyper` maps the names `hyperparameters` gives to float32 scalars (device
      data, so a changing learning rate never re-traces); `options` is the static dict
      `options` gives (part of the trace), plus `first` when `first_step_differs`.
    hyperparameters: `(group, step) -> {name: float}`, read on the host at every step from the
      parameter's group and its step count (1 on its first step), in float64 as torch does.
    options: `group -> {name: hashable}`, the group's static choices (amsgrad, maximize).
    counts_steps: the state holds torch's per-parameter `step` count (a CPU float32 tensor).
    first_step_differs: the step that creates a parameter's state is traced apart
      (`options["first"]`): SGD's momentum buffer starts as the gradient.
    real_only: complex parameters are refused (an update that is not linear in the gradient).

  Example:
    >>> rule = Rule("plain_sgd", state_shapes=lambda shape, dtype, options: {},
    ...             update=lambda p, g, state, hyper, options: (p - hyper["lr"] * g, state),
    ...             hyperparameters=lambda group, step: {"lr": group["lr"]})
    >>> rule.hyperparameters({"lr": 0.1}, 1)
    {'lr': 0.1}
  """
  name: str
  state_shapes: StateShapes
  update: Update
  hyperparameters: Hyperparameters
  options: Options = _no_options
  counts_steps: bool = False
  first_step_differs: bool = False
  real_only: bool = True


_OPTIMIZERS: dict[str, type] = {}
_Class = TypeVar("_Class", bound=type)


def register(optimizer_class: _Class) -> _Class:
  """Class decorator: makes `optimizer_class` (a `RuleOptimizer` with a `rule`) known by its
  rule's name to `optimizers()`, where the recipe looks `train.optimizer` up.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> register(jb.optim.AdamW) is jb.optim.AdamW
    True
  """
  rule: Rule = getattr(optimizer_class, "rule")  # a RuleOptimizer's class attribute
  _OPTIMIZERS[rule.name] = optimizer_class
  return optimizer_class


def optimizers() -> dict[str, type]:
  """The one-node optimizers by name, in registration order.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> jb.optim.optimizers()["adamw"].__name__
    'AdamW'
  """
  return dict(_OPTIMIZERS)
