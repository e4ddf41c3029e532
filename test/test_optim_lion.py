"""jb.optim.Lion against a reference written from the paper on eager CPU (alone, with clipping and
a schedule, and inside jb.train_step); one node, one trace while the learning rate changes."""
import copy

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


def reference_lion_step(params, states, lr, betas, weight_decay):
  """Lion (Chen et al. 2023, Algorithm 2) on CPU tensors, in place."""
  beta1, beta2 = betas
  for p in params:
    m = states.setdefault(p, torch.zeros_like(p))
    p.mul_(1 - lr * weight_decay)
    p.add_(torch.sign(beta1 * m + (1 - beta1) * p.grad), alpha=-lr)
    m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def mlp(dev):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dev)


def batches(steps):
  gen = torch.Generator().manual_seed(4)
  return [torch.randn(4, 6, generator=gen) for _ in range(steps)]


def loss_of(model, x):
  return model(x).square().mean()


@pytest.mark.parametrize("clip", [None, 0.05])
def test_matches_the_reference_with_clipping_and_a_schedule(dev, clip):
  cpu_model = mlp("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  options = dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.5)
  ours = jb.optim.Lion(xla_model.parameters(), max_grad_norm=clip, **options)
  schedule = torch.optim.lr_scheduler.LambdaLR(ours, jb.optim.warmup_linear(2, 6))
  states, clipped = {}, 0
  for x in batches(6):
    lr = ours.param_groups[0]["lr"]
    cpu_model.zero_grad()
    loss_of(cpu_model, x).backward()
    norm = torch.nn.utils.clip_grad_norm_(cpu_model.parameters(), clip or float("inf"))
    clipped += bool(clip and norm > clip)
    with torch.no_grad():
      reference_lion_step(list(cpu_model.parameters()), states, lr, options["betas"],
                          options["weight_decay"])
    ours.zero_grad()
    loss_of(xla_model, x.to(dev)).backward()
    ours.step()
    schedule.step()
    torch_xla.sync()
    if clip is None:  # computed only for clipping
      assert ours.grad_norm is None
    else:
      torch.testing.assert_close(ours.grad_norm.cpu(), norm)
  for a, b in zip(xla_model.parameters(), cpu_model.parameters()):
    torch.testing.assert_close(a.detach().cpu(), b, rtol=1e-5, atol=1e-6)
  for p, ref_p in zip(xla_model.parameters(), cpu_model.parameters()):
    torch.testing.assert_close(ours.state[p]["exp_avg"].cpu(), states[ref_p])
  assert clip is None or clipped >= 3


def test_in_the_one_node_training_step_and_one_trace_under_a_schedule(dev):
  cpu_model = mlp("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  ours = jb.optim.Lion(xla_model.parameters(), lr=0.01, weight_decay=0.1)
  schedule = torch.optim.lr_scheduler.LambdaLR(ours, jb.optim.warmup_cosine(2, 6))
  step = jb.train_step(lambda x: loss_of(xla_model, x), ours)
  states, losses, ref_losses = {}, [], []
  jb.clear_cache()
  for x in batches(6):
    lr = ours.param_groups[0]["lr"]
    cpu_model.zero_grad()
    loss = loss_of(cpu_model, x)
    loss.backward()
    with torch.no_grad():
      reference_lion_step(list(cpu_model.parameters()), states, lr, (0.9, 0.99), 0.1)
    ref_losses.append(loss.detach())
    losses.append(step(x.to(dev)))
    schedule.step()
    torch_xla.sync()
  assert jb.cache_info().misses == 1  # six learning rates, one trace
  torch.testing.assert_close(torch.stack([l.cpu() for l in losses]), torch.stack(ref_losses))
  for a, b in zip(xla_model.parameters(), cpu_model.parameters()):
    torch.testing.assert_close(a.detach().cpu(), b, rtol=1e-5, atol=1e-6)


def test_is_known_by_name_and_refuses_bad_input(dev):
  assert jb.optim.optimizers()["lion"] is jb.optim.Lion
  with pytest.raises(jb.errors.BadArgumentError, match="Lion: needs lr, weight_decay >= 0"):
    jb.optim.Lion(mlp(dev).parameters(), lr=-1.0)
  cpu_model = torch.nn.Linear(2, 2)
  opt = jb.optim.Lion(cpu_model.parameters())
  cpu_model(torch.ones(1, 2)).sum().backward()
  with pytest.raises(jb.errors.BadArgumentError, match="Use a torch optimizer for the others"):
    opt.step()
