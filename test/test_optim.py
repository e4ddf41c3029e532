"""jb.optim: SGD and AdamW against torch's optimizers (AdamW with clip_grad_norm_ and LambdaLR)
on eager CPU, graph nodes, traces and compiles under a changing learning rate, state dicts into
torch's optimizers and back, the schedule helpers."""
import copy
import dataclasses
import pathlib
import re

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_jaxbridge as jb


def train(model, optimizer, steps, dev, schedule=None):
  torch.manual_seed(1)
  xs = [torch.randn(4, 6) for _ in range(steps)]
  for x in xs:
    optimizer.zero_grad()
    model(x.to(dev)).square().mean().backward()
    optimizer.step()
    if schedule is not None:
      schedule.step()
    torch_xla.sync()
  return [p.detach().cpu() for p in model.parameters()]


def mlp(dev):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dev)


@pytest.mark.parametrize("options", [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
])
def test_matches_torch_sgd(dev, options):
  ours_model, ref_model = mlp(dev), mlp(dev)
  ours = train(ours_model, jb.optim.SGD(ours_model.parameters(), **options), 3, dev)
  ref = train(ref_model, torch.optim.SGD(ref_model.parameters(), **options), 3, dev)
  for a, b in zip(ours, ref):
    torch.testing.assert_close(a, b)


def test_momentum_of_a_parameter_that_first_gets_a_gradient_later_matches_torch(dev):
  results = []
  for make in (jb.optim.SGD, torch.optim.SGD):
    model = mlp(dev)
    opt = make(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).to(dev)
    for step in range(3):
      opt.zero_grad()
      out = model(x) if step else model[2](model[1](x[:, :8].new_ones(4, 8)))  # layer 0 unused
      out.square().mean().backward()
      opt.step()
      torch_xla.sync()
    results.append([p.detach().cpu() for p in model.parameters()])
  for a, b in zip(*results):
    torch.testing.assert_close(a, b)


def test_one_graph_node_for_all_groups_and_no_retrace_when_lr_changes(dev):
  model = mlp(dev)
  opt = jb.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(),
                                                          "lr": 0.01}], lr=0.1, momentum=0.9)
  schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
  train(model, opt, 2, dev, schedule)
  traces = jb.cache_info().misses
  model(torch.ones(2, 6, device=dev)).sum().backward()
  opt.step()
  ir = torch_xla._XLAC._get_xla_tensors_text([p for p in model.parameters()])
  assert ir.count("xla::sgd_step") == 1  # every group in one node
  assert jb.cache_info().misses == traces  # new lr values, same trace
  ref_model = mlp(dev)
  ref_opt = torch.optim.SGD([{"params": ref_model[0].parameters()},
                             {"params": ref_model[2].parameters(), "lr": 0.01}], lr=0.1,
                            momentum=0.9)
  train(ref_model, ref_opt, 2, dev, torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5))
  ref_model(torch.ones(2, 6, device=dev)).sum().backward()
  ref_opt.step()
  torch_xla.sync()
  for a, b in zip(model.parameters(), ref_model.parameters()):
    torch.testing.assert_close(a.cpu(), b.cpu())
  state = opt.state_dict()["state"]
  assert set(state) == {0, 1, 2, 3} and all("momentum_buffer" in s for s in state.values())


def test_state_dict_round_trip_continues_identically(dev):
  model = mlp(dev)
  opt = jb.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  train(model, opt, 2, dev)
  twin = copy.deepcopy(model)
  twin_opt = jb.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
  twin_opt.load_state_dict(opt.state_dict())
  for a, b in zip(train(model, opt, 2, dev), train(twin, twin_opt, 2, dev)):
    torch.testing.assert_close(a, b)


def test_bad_input_says_what_to_do(dev):
  with pytest.raises(jb.errors.BadArgumentError, match="nesterov=True needs momentum"):
    jb.optim.SGD(mlp(dev).parameters(), lr=0.1, nesterov=True)
  cpu_model = torch.nn.Linear(2, 2)
  opt = jb.optim.SGD(cpu_model.parameters(), lr=0.1)
  cpu_model(torch.ones(1, 2)).sum().backward()
  with pytest.raises(jb.errors.BadArgumentError, match="Use torch.optim.SGD"):
    opt.step()


def test_without_momentum_the_state_stays_empty_as_in_torch(dev):
  model = mlp(dev)
  opt = jb.optim.SGD(model.parameters(), lr=0.1)
  train(model, opt, 1, dev)
  ref_model = mlp(dev)
  ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
  train(ref_model, ref, 1, dev)
  assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}


def two_groups(model, **second):
  return [{"params": model[0].parameters()}, {"params": model[2].parameters(), **second}]


def adamw_run(make, dev, steps=10, clip=None, factor=None, start=None):
  """(params, per-step grad norms) after `steps` AdamW steps of the MLP on `dev`; jb's AdamW on
  XLA, torch's (with clip_grad_norm_ when `clip`) otherwise. `start`: (model, optimizer) to go on
  from instead of a fresh model."""
  model, opt = start or (None, None)
  if model is None:
    model = mlp(dev)
    opt = make(model)
  schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor) if factor else None
  xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
  norms = []
  for x in xs:
    opt.zero_grad()
    model(x.to(dev)).square().mean().backward()
    if isinstance(opt, jb.optim.AdamW):
      opt.step()
      norms.append(opt.grad_norm)
    else:
      norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")))
      opt.step()
    if schedule is not None:
      schedule.step()
    torch_xla.sync()
  return ([p.detach().cpu() for p in model.parameters()],
          [n.cpu() if n is not None else None for n in norms])


ADAMW_CASES = {
    "default": (lambda m: m.parameters(), dict(lr=0.01), None, None),
    "weight_decay_amsgrad": (lambda m: m.parameters(),
                             dict(lr=0.02, weight_decay=0.1, amsgrad=True), None, None),
    "maximize_betas_eps_two_groups": (
        lambda m: two_groups(m, lr=0.003, betas=(0.5, 0.9), amsgrad=True, weight_decay=0.0),
        dict(lr=0.01, betas=(0.8, 0.99), eps=1e-3, maximize=True), None, None),
    "clipping_warmup_cosine": (lambda m: m.parameters(), dict(lr=0.05), 0.05,
                               jb.optim.warmup_cosine(3, 10, min_ratio=0.1)),
    "clipping_two_groups_warmup_linear": (lambda m: two_groups(m, lr=0.02), dict(lr=0.05), 0.1,
                                          jb.optim.warmup_linear(2, 10)),
    "norm_reported_never_clipped": (lambda m: m.parameters(), dict(lr=0.01), float("inf"), None),
}


@pytest.mark.parametrize("case", ADAMW_CASES)
def test_adamw_matches_torch_adamw_with_clip_grad_norm_and_lambda_lr(dev, case):
  groups, options, clip, factor = ADAMW_CASES[case]
  ours, our_norms = adamw_run(lambda m: jb.optim.AdamW(groups(m), max_grad_norm=clip, **options),
                              dev, clip=clip, factor=factor)
  ref, ref_norms = adamw_run(lambda m: torch.optim.AdamW(groups(m), **options), "cpu", clip=clip,
                             factor=factor)
  for a, b in zip(ours, ref):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
  if clip is None:  # the norm is computed only for clipping (a reduction per parameter)
    assert our_norms == [None] * len(ref_norms)
  else:
    torch.testing.assert_close(torch.stack(our_norms), torch.stack(ref_norms), rtol=1e-6, atol=0)
  if clip not in (None, float("inf")):  # the clipping was active
    assert sum(n > clip for n in ref_norms) >= 5


def test_adamw_ten_steps_of_a_changing_lr_trace_once_and_compile_once(dev):
  model = mlp(dev)
  opt = jb.optim.AdamW(two_groups(model, amsgrad=True), lr=0.01, max_grad_norm=0.5)
  schedule = torch.optim.lr_scheduler.LambdaLR(opt, jb.optim.warmup_cosine(3, 10))
  compiles, lrs = [], []
  for step in range(10):
    opt.zero_grad()
    model(torch.full((2, 6), float(step)).to(dev)).square().mean().backward()
    opt.step()
    lrs.append(opt.param_groups[0]["lr"])
    schedule.step()
    torch_xla.sync()
    compiles.append(met.metric_data("CompileTime")[0])
  assert len(set(lrs)) == 10
  assert jb.cache_info().misses == 1  # the one trace of adamw_step
  # the zero moments are device data before the first step: its graph is every later step's
  assert compiles[-1] == compiles[0]


def test_adamw_first_step_inside_a_full_graph_compile_runs_nothing_and_trains(dev):
  """`torch_xla.compile(full_graph=True)` forbids running anything while its step is traced:
  the new states stay pending zeros there (the step compiles twice, as it did before)."""
  torch.manual_seed(0)
  model = mlp(dev)
  reference = copy.deepcopy(model).cpu()
  opt = jb.optim.AdamW(model.parameters(), lr=0.01)
  ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)

  def step(m, o, x):
    o.zero_grad()
    loss = m(x).square().mean()
    loss.backward()
    o.step()
    return loss

  compiled = torch_xla.compile(lambda x: step(model, opt, x), full_graph=True)
  for i in range(3):
    x = torch.full((2, 6), float(i))
    assert torch.allclose(compiled(x.to(dev)).cpu(), step(reference, ref_opt, x), rtol=1e-5)
  for p, r in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.cpu(), r, rtol=1e-5, atol=1e-6)


def test_adamw_is_one_graph_node_and_its_grad_norm_needs_no_sync(dev):
  model = mlp(dev)
  opt = jb.optim.AdamW(two_groups(model, lr=0.1, weight_decay=0.0), lr=0.01, max_grad_norm=1.0)
  schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # torch's own scheduler
  model(torch.ones(2, 6, device=dev)).sum().backward()
  opt.step()  # the first step also fills the new states with zeros on the device, once
  schedule.step()
  torch_xla.sync()
  model(torch.ones(2, 6, device=dev)).sum().backward()
  executions = met.metric_data("ExecuteTime")[0]
  opt.step()
  schedule.step()
  assert met.metric_data("ExecuteTime")[0] == executions  # nothing ran on the device
  ir = torch_xla._XLAC._get_xla_tensors_text([*model.parameters(), opt.grad_norm])
  assert ir.count("xla::adamw_step") == 1  # both groups and the clipping: one node
  assert opt.grad_norm.device.type == "xla" and opt.grad_norm.shape == ()
  torch_xla.sync()
  assert [g["lr"] for g in opt.param_groups] == [0.0025, 0.025]


def test_adamw_state_dict_has_torch_layout_and_loads_into_torch_adamw_and_back(dev):
  make = lambda m: two_groups(m, lr=0.02, amsgrad=True)  # noqa: E731
  ours_model = mlp(dev)
  ours = jb.optim.AdamW(make(ours_model), lr=0.01, weight_decay=0.1)
  adamw_run(None, dev, steps=3, start=(ours_model, ours))
  ref_model = mlp("cpu")
  ref = torch.optim.AdamW(make(ref_model), lr=0.01, weight_decay=0.1)
  adamw_run(None, "cpu", steps=3, start=(ref_model, ref))
  saved, expected = ours.state_dict(), ref.state_dict()
  assert saved["state"].keys() == expected["state"].keys()
  for i, state in saved["state"].items():
    assert state.keys() == expected["state"][i].keys()  # step, exp_avg, exp_avg_sq, max_exp_avg_sq
    step = state["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 3
  assert all(set(g) <= set(e) for g, e in zip(saved["param_groups"], expected["param_groups"]))

  # ours -> torch's on the CPU: both go on with the same numbers (the one that loaded first:
  # torch increments its steps in place, which must not reach the other's)
  torch_model = copy.deepcopy(ours_model).cpu()
  to_torch = torch.optim.AdamW(make(torch_model), lr=0.01)
  to_torch.load_state_dict(saved)
  went_on = adamw_run(None, "cpu", steps=3, start=(torch_model, to_torch))[0]
  for a, b in zip(went_on, adamw_run(None, dev, steps=3, start=(ours_model, ours))[0]):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

  # torch's -> ours: the same
  jb_model = copy.deepcopy(ref_model).to(dev)
  to_jb = jb.optim.AdamW(make(jb_model), lr=0.01)
  to_jb.load_state_dict(ref.state_dict())
  went_on = adamw_run(None, "cpu", steps=3, start=(ref_model, ref))[0]
  for a, b in zip(went_on, adamw_run(None, dev, steps=3, start=(jb_model, to_jb))[0]):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adamw_bad_input_says_what_to_do(dev):
  with pytest.raises(jb.errors.BadArgumentError, match=r"max_grad_norm=0; give a positive norm"):
    jb.optim.AdamW(mlp(dev).parameters(), max_grad_norm=0)
  with pytest.raises(jb.errors.BadArgumentError, match=r"needs lr, eps, weight_decay >= 0"):
    jb.optim.AdamW(mlp(dev).parameters(), lr=-1e-3)
  cpu_model = torch.nn.Linear(2, 2)
  opt = jb.optim.AdamW(cpu_model.parameters())
  cpu_model(torch.ones(1, 2)).sum().backward()
  with pytest.raises(jb.errors.BadArgumentError, match="Use torch.optim.AdamW"):
    opt.step()
  complex_param = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64, device=dev))
  complex_param.grad = torch.ones_like(complex_param)
  with pytest.raises(jb.errors.BadArgumentError, match=r"dtype torch.complex64; .* Use torch.optim"):
    jb.optim.AdamW([complex_param]).step()
  with pytest.raises(jb.errors.BadArgumentError, match="0 <= warmup_steps <= total_steps"):
    jb.optim.warmup_cosine(20, 10)


@pytest.mark.parametrize("make", [lambda ps: jb.optim.SGD(ps, lr=0.1),
                                  lambda ps: jb.optim.AdamW(ps, lr=0.1)], ids=["SGD", "AdamW"])
def test_an_update_after_load_state_dict_reaches_the_state_dict(dev, make):
  model = mlp(dev)
  opt = make(model.parameters())
  model.load_state_dict({k: v.cpu() + 1 for k, v in model.state_dict().items()})  # copy_ each
  loaded = {k: v.cpu() for k, v in model.state_dict().items()}
  model(torch.ones(2, 6, device=dev)).sum().backward()
  opt.step()
  torch_xla.sync()
  for key, value in model.state_dict().items():  # state_dict reads detached aliases
    assert not torch.equal(value.cpu(), loaded[key]), key
    torch.testing.assert_close(value.cpu(), dict(model.named_parameters())[key].detach().cpu())


@pytest.mark.parametrize("make", [lambda ps: jb.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: jb.optim.AdamW(ps, lr=0.1, amsgrad=True)],
                         ids=["SGD", "AdamW"])
def test_the_step_writes_parameters_and_state_over_their_old_buffers(dev, make):
  model = mlp(dev)
  opt = make(model.parameters())

  def step():
    opt.zero_grad()
    model(torch.ones(2, 6, device=dev)).square().mean().backward()
    opt.step()

  step()
  torch_xla.sync()  # the state exists from here on
  state = [t for s in opt.state.values() for t in s.values() if t.device.type == "xla"]
  assert len(state) == {"SGD": 4, "AdamW": 12}[type(opt).__name__]
  updated = sum(t.numel() * 4 for t in [*model.parameters(), *state])
  report = jb.memory_report(step)
  assert report.alias_bytes == updated  # in place: one buffer per parameter and state tensor


def test_a_handed_out_state_dict_sees_later_steps_and_nothing_compiles_again(dev):
  """As torch's in-place optimizers: the state dict holds the live state tensors."""
  model, ref_model = mlp(dev), mlp("cpu")
  opt = jb.optim.AdamW(model.parameters(), lr=0.1)
  ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.1)
  compiles = []
  for step in range(6):
    for m, o in ((model, opt), (ref_model, ref_opt)):
      o.zero_grad()
      m(torch.full((2, 6), float(step)).to(m[0].weight.device)).square().mean().backward()
      o.step()
    torch_xla.sync()
    compiles.append(met.metric_data("CompileTime")[0])
    if step == 2:
      saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
  # the handed-out state tensors are views of the flat buffers: the sync after state_dict()
  # computes them once (one more program); the step's own program never changes
  assert compiles[1] == compiles[2] and compiles[3] == compiles[2] + 1
  assert compiles[-1] == compiles[3]
  params = list(model.parameters())
  for i, key in [(i, key) for i in range(4) for key in ("exp_avg", "exp_avg_sq")]:
    torch.testing.assert_close(saved["state"][i][key].cpu(), ref_saved["state"][i][key])
    assert saved["state"][i][key] is opt.state[params[i]][key]


def test_the_docs_table_lists_every_optimizer():
  text = (pathlib.Path(__file__).parents[1] / "docs" / "optim.md").read_text()
  rows = re.findall(r"^\| `(\w+)` \| `jb\.optim\.(\w+)` \|", text, re.M)
  assert rows == [(name, cls.__name__) for name, cls in jb.optim.optimizers().items()]


@pytest.mark.parametrize("change", ["replace a moment", "scale a moment in place",
                                    "clear the state"])
def test_a_state_changed_between_steps_is_used_as_torch_uses_it(dev, change):
  """The optimizer keeps its step plan from step to step: a state the user replaced or cleared
  makes a new plan, never a silently ignored change."""
  results = []
  for make in (jb.optim.AdamW, torch.optim.AdamW):
    model = mlp(dev)
    opt = make(model.parameters(), lr=0.1)
    for step in range(3):
      opt.zero_grad()
      model(torch.ones(2, 6, device=dev)).square().mean().backward()
      opt.step()
      torch_xla.sync()
      if step == 1 and change == "replace a moment":
        p = next(model.parameters())
        opt.state[p]["exp_avg"] = torch.full_like(p, 0.5)
      elif step == 1 and change == "scale a moment in place":  # a view of the flat buffer
        opt.state[list(model.parameters())[2]]["exp_avg_sq"].mul_(4.0)
      elif step == 1:
        opt.state.clear()
    results.append([p.detach().cpu() for p in model.parameters()])
  for a, b in zip(*results):
    torch.testing.assert_close(a, b)


def test_the_step_updates_one_flat_buffer_per_state_name_not_a_tensor_per_parameter(dev):
  """AdamW's moments of all parameters live in two buffers (exp_avg, exp_avg_sq) that the step
  writes in place; optimizer.state shows them per parameter as views, in torch's layout."""
  model = mlp(dev)
  opt = jb.optim.AdamW(model.parameters(), lr=0.1)
  step = jb.train_step(lambda x: model(x).square().mean(), opt)
  x = torch.ones(2, 6, device=dev)
  step(x)
  torch_xla.sync()
  report = jb.memory_report(lambda: step(x))
  params = list(model.parameters())
  assert report.outputs == len(params) + 2  # parameters, the two buffers (no norm: no clipping)
  assert report.alias_bytes == 3 * sum(p.numel() * 4 for p in params)
  state = opt.state[params[0]]
  assert list(state) == ["step", "exp_avg", "exp_avg_sq"]
  assert state["exp_avg"].shape == params[0].shape and state["exp_avg"] is state["exp_avg"]
  assert type(copy.deepcopy(state)) is dict  # pickled or copied as torch's plain dict


@pytest.mark.parametrize("make", [torch.optim.AdamW, jb.optim.AdamW])
def test_a_parameter_moved_to_another_group_takes_its_hyperparameters(dev, make):
  """The bias moves (parameter order unchanged) into a group with lr 0: it stops changing, as
  under eager torch.optim.AdamW."""
  def run(cls, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = cls([{"params": [model.weight, model.bias], "lr": 0.1}, {"params": [], "lr": 0.0}])
    x = torch.ones(3, 4, device=device)
    for step in range(4):
      if step == 2:
        del opt.param_groups[0]["params"][1]
        opt.param_groups[1]["params"].append(model.bias)
        moved = model.bias.detach().cpu().clone()
      model(x).square().sum().backward()
      opt.step()
      opt.zero_grad()
      if device != "cpu":
        torch_xla.sync()
    return model.bias.detach().cpu() - moved, model.weight.detach().cpu()

  bias_change, weight = run(make, dev)
  eager_change, eager_weight = run(torch.optim.AdamW, "cpu")
  assert not eager_change.any() and not bias_change.any()
  torch.testing.assert_close(weight, eager_weight, rtol=1e-5, atol=1e-6)


def test_the_gradients_norm_is_computed_only_for_clipping(dev):
  """Each parameter's norm is a reduction, a kernel of its own in the step's program: without
  clipping the step computes none (`grad_norm` is None), with it one per parameter."""
  def reductions(clip):
    torch.manual_seed(0)
    model = mlp(dev)
    opt = jb.optim.AdamW(model.parameters(), lr=0.01, max_grad_norm=clip)
    model(torch.ones(2, 6, device=dev)).sum().backward()
    opt.step()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(model.parameters()))
    torch_xla.sync()
    return opt.grad_norm, sum(" reduce(" in line for line in hlo.splitlines())

  unclipped_norm, unclipped = reductions(None)
  clipped_norm, clipped = reductions(1.0)
  assert unclipped_norm is None and clipped_norm is not None
  assert clipped - unclipped == len(list(mlp(dev).parameters())) + 1  # and the norm of norms


@pytest.mark.parametrize("entry", ["optimizer step", "train_step"])
def test_the_update_rule_is_traced_once_per_parameter_shape(dev, entry):
  traced_shapes = []

  def counting(p, g, state, hyper, options):
    traced_shapes.append(tuple(p.shape))
    return jb.optim.AdamW.rule.update(p, g, state, hyper, options)

  class CountingAdamW(jb.optim.AdamW):
    rule = dataclasses.replace(jb.optim.AdamW.rule, update=counting)

  torch.manual_seed(0)
  model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(dev)
  reference = copy.deepcopy(model)
  opt = CountingAdamW(model.parameters(), lr=0.1, weight_decay=0.1)
  ref_opt = jb.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
  x = torch.randn(4, 8).to(dev)
  for m, o in [(model, opt), (reference, ref_opt)]:
    if entry == "train_step":
      jb.train_step(lambda x: m(x).square().mean(), o, layer_loop=False)(x)
    else:
      m(x).square().mean().backward()
      o.step()
    torch_xla.sync()
  assert sorted(traced_shapes) == [(8,), (8, 8)]  # not once per parameter (8 of them)
  for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.cpu(), q.cpu(), rtol=0, atol=0)
