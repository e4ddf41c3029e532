"""A tensor no output of bridged code depends on (unused, detached, read under `no_grad`, cast to
an integer) gets no gradient, as in eager torch: `.grad` stays None, `torch.autograd.grad` refuses
it without `allow_unused`, and optimizers skip it, so weight decay does not move it. Against eager
CPU torch and plain torch_xla, under `BridgeModule`, `bridge_modules`, `bridge` and `train_step`."""
import copy
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


class PartlyUsed(torch.nn.Module):
  """Only `used` reaches the output with a gradient; the others are read in ways torch's
  autograd does not record, or not at all."""

  def __init__(self):
    super().__init__()
    self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    self.detached, self.frozen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    self.counted = torch.nn.Parameter(torch.full((4,), 2.5))

  def forward(self, x):
    with torch.no_grad():
      k = self.frozen(x)
    extra = self.detached.weight.detach().sum() + self.counted.long().sum()
    return torch.tanh(self.used(x)) * k + extra


UNREACHED = ["unused", "detached", "frozen", "counted"]


def _by_class(model):
  jb.bridge_modules(model, [PartlyUsed])
  return model


ENTRIES = {"BridgeModule": jb.BridgeModule, "bridge_modules": _by_class,
           "bridge": lambda m: jb.bridge(m.forward)}


def _unreached(model):
  return [p for name, p in model.named_parameters() if name.split(".")[0] in UNREACHED]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_what_no_output_depends_on_gets_no_gradient_as_in_eager(entry):
  torch.manual_seed(0)
  eager, x = PartlyUsed(), torch.randn(3, 4)
  eager(x).square().sum().backward()
  assert all(p.grad is None for p in _unreached(eager))
  model = copy.deepcopy(eager).to("xla")
  model.zero_grad(set_to_none=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)  # bridged, not fallen back
    ENTRIES[entry](model)(x.to("xla")).square().sum().backward()
  assert all(p.grad is None for p in _unreached(model))
  for name in ("used.weight", "used.bias"):
    torch.testing.assert_close(model.get_parameter(name).grad.cpu(),
                               eager.get_parameter(name).grad)


def test_autograd_grad_of_an_unreached_tensor_refuses_it_as_eager_does():
  torch.manual_seed(0)
  model = jb.BridgeModule(PartlyUsed().to("xla"))
  x = torch.randn(3, 4).to("xla")
  with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
    torch.autograd.grad(model(x).sum(), [model.unused.weight])
  assert torch.autograd.grad(model(x).sum(), [model.unused.weight], allow_unused=True) == (None,)


def _trained(mode, steps=3):
  """PartlyUsed after `steps` AdamW steps with weight decay: its parameters on CPU, by name,
  and the optimizer and model."""
  torch.manual_seed(0)
  model, x = PartlyUsed(), torch.randn(3, 4)
  if mode != "eager":
    model, x = model.to("xla"), x.to("xla")
  adamw = jb.optim.AdamW if mode == "train_step" else torch.optim.AdamW
  opt = adamw(model.parameters(), lr=0.1, weight_decay=0.5)
  run = jb.BridgeModule(model) if mode == "BridgeModule" else model
  step = jb.train_step(lambda m, t: m(t).square().sum(), opt) if mode == "train_step" else None
  for _ in range(steps):
    if step is not None:
      step(model, x)
      continue
    run(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
  return {name: p.detach().cpu() for name, p in model.named_parameters()}, opt, model


@pytest.mark.parametrize("mode", ["BridgeModule", "train_step"])
def test_weight_decay_leaves_unreached_parameters_as_plain_torch_xla_does(mode):
  """torch's AdamW skips a parameter whose .grad is None; a zero gradient would decay it."""
  eager, _, _ = _trained("eager")
  plain, _, _ = _trained("plain")
  got, opt, model = _trained(mode)
  torch.manual_seed(0)
  initial = dict(PartlyUsed().named_parameters())
  for name, value in got.items():
    torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value, eager[name], rtol=1e-5, atol=1e-5)
    if name.split(".")[0] in UNREACHED:
      assert torch.equal(value, initial[name].detach()), name  # neither decayed nor stepped
  for p in _unreached(model):  # and their moments never moved
    assert all(not t.cpu().any() for k, t in opt.state[p].items() if k != "step")
