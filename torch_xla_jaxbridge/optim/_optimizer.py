"""`RuleOptimizer`: a `torch.optim.Optimizer` whose whole step is one graph node running a `Rule`.

The parameters, gradients and states of every group go through one `call_jax`: the gradients'
global norm (and clipping, with `max_grad_norm`), then the rule per parameter. Values that change
between steps (learning rate and the rest of the hyperparameters, step counts) travel as one
float32 device input, so torch's LR schedulers never re-trace. Each parameter and state tensor
then takes its new value in place (written over its old buffer), as torch's optimizers update
theirs, so `state_dict()` is torch's layout and holders of it see later steps.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._core import call, sharding
from torch_xla_jaxbridge.optim._plan import Plan, make_plan
from torch_xla_jaxbridge.optim._state import TorchLayout
from torch_xla_jaxbridge.optim._step import apply_rule


def _zeros_on_device(buffers: list) -> None:
  """Makes each new state buffer (all zeros, still pending) device data copied from host zeros:
  the first step's program is then every later step's, compiled once (pending zeros folded into
  it made it a second program), and no program is compiled for the zeros (one per model's state
  sizes kept XLA:CPU's memory maps growing model after model). Host zeros that are only read
  stay the kernel's shared zero page. Not inside `torch_xla.compile(full_graph=True)`, where
  nothing may reach the device: there the step compiles twice, as before."""
  for buffer in buffers:
    zeros = torch.zeros(buffer.shape, dtype=buffer.dtype).to(buffer.device)
    torch_xla_private.replace_data(buffer, zeros)


class RuleOptimizer(TorchLayout):
  """A torch optimizer over `rule` (a class attribute); see `AdamW` for one built on it.

  Args:
    params: parameters or parameter groups, as for any torch optimizer.
    defaults: the group defaults (the subclass's constructor arguments).
    max_grad_norm: clip the gradients by their global 2-norm first, as
      `torch.nn.utils.clip_grad_norm_` over all groups would (None: no clipping). `p.grad` is
      left unscaled; `grad_norm` holds the norm before clipping after every step (None without
      clipping; `max_grad_norm=float("inf")` computes it and never clips).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.Lion(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step()
  """

  def __init__(self, params: Iterable, defaults: dict, *,
               max_grad_norm: float | None = None):
    if max_grad_norm is not None and not max_grad_norm > 0:
      raise errors.BadArgumentError(
          f"{type(self).__name__}: max_grad_norm={max_grad_norm}; give a positive norm, or None "
          f"for no clipping.")
    super().__init__(params, defaults)
    self.max_grad_norm = max_grad_norm
    self.grad_norm: torch.Tensor | None = None
    self._update: Callable[[], Any] | None = None  # `step_running`'s, for one step()
    self._plan: Plan | None = None  # `prepare`'s, committed by `take`

  @torch.no_grad()
  def step(self, closure: Callable[[], Any] | None = None) -> Any:
    """Updates every parameter that has a gradient; returns the closure's loss, if given."""
    if self._update is not None:  # `step_running`'s update (jb.train_step's own node)
      run, self._update = self._update, None
      return run()
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
    self.check_params(params)
    self.apply_gradients(params, [p.grad for p in params])
    return loss

  def apply_gradients(self, params: list, grads: list) -> None:
    """One update of `params` (each in a param group) by `grads`, as one graph node: what
    `step()` does with the `.grad`s (and `jb.train_step` where it falls back).

    Example:
      >>> import torch, torch_xla_jaxbridge as jb
      >>> w = torch.nn.Parameter(torch.ones(2, device="xla"))
      >>> jb.optim.SGD([w], lr=0.5).apply_gradients([w], [torch.ones(2, device="xla")])
      >>> w.detach().cpu().tolist()
      [0.5, 0.5]
    """
    self.grad_norm = None
    if params:
      states, scalars, statics = self.prepare(params)
      results = call.call_jax(
          self._apply_rule, (params, list(grads), states, scalars.to(params[0].device)), statics,
          name=f"{self.rule.name}_step")
      self.take(params, results)

  def _apply_rule(self, *args: Any, **statics: Any) -> tuple:
    """`apply_rule`, a method so that its programs are cached with this optimizer (and go when
    it goes)."""
    return apply_rule(*args, **statics)

  def step_running(self, update: Callable[[], Any]) -> Any:
    """One `step()` whose update is `update()` (its result returned): the step's hooks run and
    LR schedulers count it. `jb.train_step` makes its one-node update this way.

    Example:
      >>> import torch, torch_xla_jaxbridge as jb
      >>> opt = jb.optim.SGD(torch.nn.Linear(2, 2).to("xla").parameters(), lr=0.1)
      >>> opt.step_running(lambda: "updated")
      'updated'
    """
    self._update = update
    try:
      return self.step()
    finally:
      self._update = None

  def check_params(self, params: list, grads: bool = True) -> None:
    """Refuses parameters the one-node update cannot hold: not on XLA, a sparse gradient
    (`grads`: read from `p.grad`), complex ones for a rule that is `real_only`."""
    name = type(self).__name__
    for p in params:
      sparse = grads and p.grad.is_sparse
      complex_ = self.rule.real_only and p.is_complex()
      if not p.is_xla or sparse or complex_:
        what = (" with a sparse gradient" if sparse else f" of dtype {p.dtype}" if complex_
                else "")
        raise errors.BadArgumentError(
            f"{name}: a parameter of shape {tuple(p.shape)} is on {p.device}{what}; "
            f"jb.optim.{name} updates {'real ' if self.rule.real_only else ''}XLA tensors with "
            f"dense gradients. Use {self._torch_counterpart()} for the others.")

  def _torch_counterpart(self) -> str:
    name = type(self).__name__
    return f"torch.optim.{name}" if hasattr(torch.optim, name) else "a torch optimizer"

  def groups_key(self) -> tuple:
    """The ids of each group's parameters, now: a parameter swapped into a group's list, or
    moved to another group, gives another key.

    Example:
      >>> import torch, torch_xla_jaxbridge as jb
      >>> p = torch.nn.Parameter(torch.zeros(2))
      >>> jb.optim.SGD([p], lr=0.1).groups_key() == ((id(p),),)
      True
    """
    return tuple(tuple(map(id, g["params"])) for g in self.param_groups)

  def prepare(self, params: list) -> tuple:
    """For one step of `params` (in `param_groups` order, each with a gradient): their state
    dicts of XLA tensors (zeros on a parameter's first step; without SPMD the flat buffers
    holding them, `statics["layout"]` saying where), the step's scalars (a CPU float32
    tensor: each row's hyperparameters, then max_grad_norm) and `apply_rule`'s static
    arguments. Changes nothing until `take` commits it (new states, step counts), so a step that
    fails in between leaves the optimizer as it was. `jb.train_step` calls it too."""
    rule = self.rule
    # the groups' options, and which parameters each holds (one moved to another group takes
    # that group's hyperparameters, as in torch)
    signature = (tuple(tuple(sorted(rule.options(g).items())) for g in self.param_groups),
                 self.groups_key())
    if self._plan is None or not self._plan.fits(params, signature, self.state):
      self._plan = make_plan(rule, self.param_groups, self.state, params, signature,
                             self.init_state, flat=not sharding.spmd_enabled())
      if (self._plan.flat is not None and len(self._plan.created) == len(params) and
          torch_xla_private.execution_allowed()):
        _zeros_on_device(self._plan.flat.buffers)
    plan = self._plan
    scalars: list[float] = []
    names: tuple = ()
    for row in plan.rows:
      hyper = rule.hyperparameters(row.group, row.step + 1 if rule.counts_steps else 1.0)
      names = names or tuple(hyper)
      scalars.extend(hyper[n] for n in names)
    scalars.append(float(self.max_grad_norm or 0.0))
    statics = dict(rule=rule, names=names, options=tuple(row.options for row in plan.rows),
                   rows=plan.row_of, clip=self.max_grad_norm is not None,
                   layout=plan.flat and plan.flat.layout)
    return plan.states, torch.tensor(scalars, dtype=torch.float32), statics
