"""jb.optim.Adafactor against torch.optim.Adafactor on eager CPU (matrices and vectors, weight
decay, given and default eps1, maximize; inside jb.train_step), its state_dict into torch's and
back, one node and one trace under a schedule."""
import copy

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


def model(dev):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dev)


def batches(steps):
  gen = torch.Generator().manual_seed(5)
  return [torch.randn(4, 6, generator=gen) for _ in range(steps)]


def run(net, opt, xs, dev, schedule=None):
  for x in xs:
    opt.zero_grad()
    net(x.to(dev)).square().mean().backward()
    opt.step()
    if schedule is not None:
      schedule.step()
    torch_xla.sync()
  return [p.detach().cpu() for p in net.parameters()]


CASES = {
    "defaults": dict(),
    "decay_eps_d": dict(lr=0.05, weight_decay=0.1, eps=(1e-20, 1e-3), d=1.5, beta2_decay=-0.6),
    "maximize": dict(lr=0.02, maximize=True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_adafactor(dev, case):
  cpu_model = model("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  ref = run(cpu_model, torch.optim.Adafactor(cpu_model.parameters(), **CASES[case]),
            batches(8), "cpu")
  ours_opt = jb.optim.Adafactor(xla_model.parameters(), **CASES[case])
  ours = run(xla_model, ours_opt, batches(8), dev)
  for a, b in zip(ours, ref):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dict_loads_into_torch_adafactor_and_back(dev):
  cpu_model = model("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  ours = jb.optim.Adafactor(xla_model.parameters(), lr=0.03)
  ref = torch.optim.Adafactor(cpu_model.parameters(), lr=0.03)
  run(xla_model, ours, batches(3), dev)
  run(cpu_model, ref, batches(3), "cpu")
  saved, expected = ours.state_dict(), ref.state_dict()
  for i, state in saved["state"].items():
    assert list(state) == list(expected["state"][i])  # step, row_var, col_var / variance
    assert float(state["step"]) == 3 and state["step"].device.type == "cpu"
  to_torch_model = copy.deepcopy(xla_model).cpu()
  to_torch = torch.optim.Adafactor(to_torch_model.parameters(), lr=0.03)
  to_torch.load_state_dict(saved)
  went_on = run(to_torch_model, to_torch, batches(2), "cpu")
  to_jb_model = copy.deepcopy(cpu_model).to(dev)
  to_jb = jb.optim.Adafactor(to_jb_model.parameters(), lr=0.03)
  to_jb.load_state_dict(ref.state_dict())
  for a, b, c in zip(went_on, run(xla_model, ours, batches(2), dev),
                     run(to_jb_model, to_jb, batches(2), dev)):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_in_the_one_node_training_step_with_a_schedule_and_one_trace(dev):
  cpu_model = model("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  ref = torch.optim.Adafactor(cpu_model.parameters(), lr=0.02, weight_decay=0.1)
  ours = jb.optim.Adafactor(xla_model.parameters(), lr=0.02, weight_decay=0.1)
  schedules = [torch.optim.lr_scheduler.LambdaLR(o, jb.optim.warmup_cosine(2, 6))
               for o in (ref, ours)]
  step = jb.train_step(lambda x: xla_model(x).square().mean(), ours)
  jb.clear_cache()
  for x in batches(6):
    ref.zero_grad()
    cpu_model(x).square().mean().backward()
    ref.step()
    step(x.to(dev))
    for schedule in schedules:
      schedule.step()
    torch_xla.sync()
  assert jb.cache_info().misses == 1
  for a, b in zip(xla_model.parameters(), cpu_model.parameters()):
    torch.testing.assert_close(a.detach().cpu(), b, rtol=1e-5, atol=1e-6)


def test_is_one_graph_node_and_refuses_bad_input(dev):
  net = model(dev)
  opt = jb.optim.Adafactor(net.parameters())
  net(torch.ones(2, 6, device=dev)).sum().backward()
  opt.step()
  ir = torch_xla._XLAC._get_xla_tensors_text(list(net.parameters()))
  assert ir.count("xla::adafactor_step") == 1
  torch_xla.sync()
  assert jb.optim.optimizers()["adafactor"] is jb.optim.Adafactor
  with pytest.raises(jb.errors.BadArgumentError, match="Adafactor: needs .* d >= 1"):
    jb.optim.Adafactor(net.parameters(), d=0.5)
