"""The state of a one-node optimizer kept in torch's layout and updated in place."""
from __future__ import annotations


import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge.optim._plan import Plan
from torch_xla_jaxbridge.optim._rule import Rule


class TorchLayout(torch.optim.Optimizer):
  """A torch optimizer's state as torch keeps it: per parameter a `step` count (a CPU float32
  tensor, for rules that count steps) and zero-initialized tensors by the rule's names, updated in
  place (written over their old buffers), so `state_dict()` loads into torch's optimizers and
  back and holders of it see later steps. Subclasses set `rule`."""
  rule: Rule
  _plan: Plan | None  # the step `prepare` made, committed by `take`

  def state_dict(self) -> dict:
    """torch's layout; step counts are copies (a consumer that increments its steps in place, as
    torch's optimizers do, leaves this optimizer's alone)."""
    saved = super().state_dict()
    saved["state"] = {k: {**v, **({"step": v["step"].clone()} if "step" in v else {})}
                      for k, v in saved["state"].items()}
    return saved

  def load_state_dict(self, state_dict: dict) -> None:
    """torch's, except that XLA tensors it would share with `state_dict` are copied, so a state
    loaded from another optimizer starts a state of its own (this one updates it in place)."""
    given = {id(v) for s in state_dict["state"].values() for v in s.values()
             if isinstance(v, torch.Tensor)}
    super().load_state_dict(state_dict)
    for p_state in self.state.values():
      for key, value in p_state.items():
        if id(value) in given and value.is_xla:
          p_state[key] = value.clone()

  def init_state(self, p: torch.Tensor, options: dict) -> dict:
    """The state a parameter starts with, as torch makes it on its first step: a step count of
    0 and zeros (kept once `take` commits the step; as in torch, a parameter whose rule keeps
    nothing gets no entry)."""
    state = {"step": torch.tensor(0.0, dtype=torch.float32)} if self.rule.counts_steps else {}
    for key, (shape, dtype) in self.rule.state_shapes(tuple(p.shape), p.dtype, options).items():
      state[key] = (torch.zeros_like(p, memory_format=torch.preserve_format)
                    if tuple(shape) == tuple(p.shape) and dtype == p.dtype else
                    torch.zeros(shape, dtype=dtype, device=p.device))
    return state

  def take(self, params: list, results: tuple) -> None:
    """Commits the step `prepare` planned: new states and step counts are kept, parameters and
    states take the values `apply_rule` returned (in place); sets `grad_norm`."""
    new_params, new_states, self.grad_norm = results
    plan = self._plan
    if plan is None:
      raise errors.UsageError("take() commits the step that prepare() planned: call prepare() first")
    for p, created in plan.created:
      if created and plan.flat is None:
        self.state[p] = created
    for p, holder in plan.holders:
      self.state[p] = holder
    for row in plan.rows:
      row.step += 1
      if row.step_tensor is not None:
        row.step_tensor.fill_(row.step)
    if plan.created:
      self._plan = None  # the next step reads the new states (and is no longer the first)
    if plan.targets is None and plan.flat is not None:
      plan.targets = list(params) + list(plan.flat.buffers)
    if plan.targets is not None:  # checked at an earlier step of this plan: same tensors
      news = list(new_params) + (list(new_states) if plan.flat is not None else
                                 [new for new_state in new_states for new in new_state.values()])
      torch_xla_private.replace_data_many(plan.targets, news)
    else:
      olds, news = list(params), list(new_params)
      for p, state, new_state in zip(params, plan.states, new_states):
        for key, new in new_state.items():
          old = state.get(key)
          if old is None or not old.is_xla or old.shape != new.shape or old.dtype != new.dtype:
            self.state[p][key] = new  # a state not on the device yet: the new value is it
            self._plan = None
          else:
            olds.append(old)
            news.append(new)
      torch_xla_private.replace_data_many(olds, news)
      if self._plan is plan:
        plan.targets = olds
    torch.autograd.graph.increment_version(params)  # in-place updates, as far as autograd knows

  def __setstate__(self, state: dict) -> None:
    super().__setstate__(state)
    self.__dict__["_plan"] = None
    self.__dict__.setdefault("_update", None)
    for group in self.param_groups:  # a state dict of another optimizer may lack some
      for key, value in self.defaults.items():
        group.setdefault(key, value)
    for p_state in self.state.values():  # our own CPU count, whatever the loaded one was
      if "step" in p_state:
        p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)
