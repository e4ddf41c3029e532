"""What one optimizer step needs besides the gradients, kept from step to step.

Parameters of one group at one step count share their hyperparameters: a `Row`. A `Plan` maps
each parameter of a step onto its row and holds the state tensors the step reads, so a step
costs Python work per row (the hyperparameters, read on the host) and not per parameter; it is
made again only when the parameters, their groups' static options or the state change. A row's
parameters share one `step` tensor (torch's CPU count, updated in place as torch does). Without
SPMD the states live in flat buffers (`_flat`): the step reads and writes a few tensors, not two
or three per parameter.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_xla_jaxbridge.optim._flat import FlatBuffers, FlatLayout, FlatState
from torch_xla_jaxbridge.optim._rule import Rule


@dataclasses.dataclass
class Row:
  """Parameters of one group at one step count (and first step or not)."""
  group: dict
  step: float  # the count before this step (0 for new parameters)
  first: bool  # the step that makes these parameters' state
  options: dict  # the rule's static options for them
  step_tensor: torch.Tensor | None  # shared by the row's parameters (rules that count steps)


@dataclasses.dataclass
class Plan:
  """The rows and states of the parameters `ids` (in `param_groups` order).

  Example:
    >>> plan = Plan(ids=(), signature=(), rows=[], row_of=(), states=[], created=[])
    >>> plan.fits([], (), {})
    True
  """
  ids: tuple  # id of each parameter
  signature: tuple  # each group's static options when the plan was made
  rows: list
  row_of: tuple  # each parameter's row
  states: list  # each parameter's state tensors read by the rule (not its step); flat: buffers
  created: list  # (parameter, state) made by this plan, kept when its step is committed
  targets: list | None = None  # the parameters and states a step replaces, once checked
  flat: FlatBuffers | None = None  # the buffers holding the states (`states` is its list)
  holders: list = dataclasses.field(default_factory=list)  # (parameter, FlatState) to commit

  def fits(self, params: list, signature: tuple, state: Any) -> bool:
    """Whether the plan serves a step of `params` under these group options, with the
    optimizer's `state` still holding the plan's tensors (a state the user replaced or cleared
    makes a new plan, never a silently ignored change)."""
    if self.created or signature != self.signature or tuple(map(id, params)) != self.ids:
      return False
    if self.flat is not None:
      return all(found is holder and not found.changed and found.step is self.rows[row].step_tensor
                 for found, (_, holder), row in zip(map(state.get, params), self.holders,
                                                    self.row_of))
    for p, kept, row in zip(params, self.states, self.row_of):
      found = state.get(p) or {}
      if found.get("step") is not self.rows[row].step_tensor:
        return False
      for key, tensor in kept.items():
        if found.get(key) is not tensor:
          return False
    return True


def make_plan(rule: Rule, groups: list, state: Any, params: list, signature: tuple,
              init_state: Any, flat: bool = False) -> Plan:
  """The plan of a step of `params` (each in one of `groups`, in their order): each parameter's
  row by (group, step count, first step), states read from `state` or made by
  `init_state(p, options)` for a parameter without one; with `flat`, held in flat buffers.

  Example:
    >>> from torch_xla_jaxbridge.optim._sgd import SGD
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = SGD([p], lr=0.1)
    >>> plan = make_plan(SGD.rule, opt.param_groups, opt.state, [p], (), opt.init_state)
    >>> len(plan.rows), plan.rows[0].first
    (1, True)
  """
  selected = {id(p) for p in params}
  rows: list[Row] = []
  by_key: dict = {}
  row_of: list[int] = []
  states: list[dict] = []
  created: list[tuple] = []
  for index, group in enumerate(groups):
    options = rule.options(group)
    for p in group["params"]:
      if id(p) not in selected:
        continue
      found = state.get(p) or {}
      first = not found
      if first:
        found = init_state(p, options)
        created.append((p, found))
      step = float(found["step"]) if rule.counts_steps else 0.0
      key = (index, step, first)
      if key not in by_key:
        by_key[key] = len(rows)
        shared = torch.tensor(step, dtype=torch.float32) if rule.counts_steps else None
        rows.append(Row(group, step, first, {**options, "first": first} if
                        rule.first_step_differs else options, shared))
      row_of.append(by_key[key])
      if rule.counts_steps:
        found["step"] = rows[by_key[key]].step_tensor  # one tensor, updated in place, a row
      states.append({k: v for k, v in found.items() if k != "step"})
  plan = Plan(tuple(map(id, params)), signature, rows, tuple(row_of), states, created)
  if flat and any(states):
    _flatten(plan, [state.get(p) for p in params], params)
  return plan


def _flatten(plan: Plan, found: list, params: list) -> None:
  """Puts `plan`'s states in flat buffers: the ones they are already in when every parameter's
  state is an unchanged view of the same buffers laid out for these parameters, else new ones."""
  owner = getattr(found[0], "owner", None)
  if owner is not None and owner.ids == plan.ids and all(
      isinstance(f, FlatState) and f.owner is owner and not f.changed for f in found):
    plan.holders = list(zip(params, found))
  else:
    layout = FlatLayout.of(plan.states)
    owner = FlatBuffers(layout, layout.gather(plan.states, params[0].device), plan.ids)
    plan.holders = [(p, FlatState(owner, i, plan.rows[row].step_tensor))
                    for i, (p, row) in enumerate(zip(params, plan.row_of))]
  plan.states, plan.flat = owner.buffers, owner
