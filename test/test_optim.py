"""jb.optim.SGD: torch.optim.SGD's results with one graph node per parameter group."""
import copy

import pytest
import torch
import torch_xla

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


def test_one_graph_node_per_group_and_no_retrace_when_lr_changes(dev):
  model = mlp(dev)
  opt = jb.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(),
                                                          "lr": 0.01}], lr=0.1, momentum=0.9)
  schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
  train(model, opt, 2, dev, schedule)
  traces = jb.cache_info().misses
  model(torch.ones(2, 6, device=dev)).sum().backward()
  opt.step()
  ir = torch_xla._XLAC._get_xla_tensors_text([p for p in model.parameters()])
  assert ir.count("xla::sgd_step") == 2  # one node per group
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
