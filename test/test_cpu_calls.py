"""Bridged code called off the XLA device (a model evaluated or exported on the CPU): the torch
code runs itself, with no warning, no fallback and no trace; back on XLA it is bridged again
with its cached trace."""
import copy
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._bridge import bridging
from torch_xla_jaxbridge._core import modules


class Block(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(8, 8)
    self.norm = torch.nn.LayerNorm(8)

  def forward(self, x):
    return self.norm(torch.relu(self.fc(x)) + x)


def _rows(since):
  """The status and trace count of each region made since the report `since`."""
  return {r.name: (r.status, r.traces) for r in jb.bridge_report(since=since).rows}


def _train_once(model, x):
  out = model(x)
  out.sum().backward()
  torch_xla.sync()
  return out


def test_a_model_bridged_by_class_evaluates_on_the_cpu_and_is_bridged_again_on_xla(dev):
  torch.manual_seed(0)
  eager = torch.nn.Sequential(Block(), Block())
  model = copy.deepcopy(eager).to(dev)
  before = jb.bridge_report()
  jb.bridge_modules(model, ["Block"])
  x = torch.randn(2, 8)
  _train_once(model, x.to(dev))
  bridged = _rows(before)
  assert bridged == {"0": ("bridged", 2), "1": ("bridged", 2)}  # forward and backward halves
  model.to("cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a FallbackWarning would fail the test
    with torch.no_grad():
      out = model(x)
  assert out.device.type == "cpu"
  with torch.no_grad():
    torch.testing.assert_close(out, eager(x))
  assert _rows(before) == bridged  # no fallback recorded, nothing traced
  model.to(dev)
  out = _train_once(model, x.to(dev))
  assert _rows(before) == bridged  # bridged again, with the trace it had
  expected = eager(x)
  expected.sum().backward()
  torch.testing.assert_close(out.cpu(), expected)
  for (name, p), q in zip(model.named_parameters(), eager.parameters()):
    torch.testing.assert_close(p.grad.cpu(), 2 * q.grad, msg=name)  # two backwards on XLA


def test_a_bridge_module_on_the_cpu_runs_its_hooks_once(dev):
  torch.manual_seed(0)
  inner = Block()
  eager = copy.deepcopy(inner)
  calls = []
  hook = inner.register_forward_hook(
      lambda m, args, out: calls.append(out.device.type) or out * 2)
  eager.register_forward_hook(lambda m, args, out: out * 2)
  before = jb.bridge_report()
  layer = jb.BridgeModule(inner)  # made on the CPU, used there first
  x = torch.randn(3, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    torch.testing.assert_close(layer(x), eager(x))
  assert calls == ["cpu"]
  rows = _rows(before)
  assert rows["Block"][0] == "bridged"
  layer.to(dev)
  with pytest.warns(jb.errors.FallbackWarning, match="hook"):  # on XLA a hooked call runs plain
    torch.testing.assert_close(layer(x.to(dev)).cpu(), eager(x))
  assert calls == ["cpu", "xla"]
  assert _rows(before)["Block"][0] == "fallback"  # for this call: its submodules were bridged
  hook.remove()
  misses = jb.cache_info().misses
  torch.testing.assert_close(layer(x.to(dev)).cpu(), eager(x) / 2)
  assert calls == ["cpu", "xla"]
  assert _rows(before)["Block"] == ("bridged", rows["Block"][1] + 1)  # traced on XLA, once
  assert jb.cache_info().misses == misses + 1


def test_a_cpu_module_given_xla_inputs_raises_torchs_own_error_and_records_nothing(dev):
  model = torch.nn.Sequential(Block())
  before = jb.bridge_report()
  jb.bridge_modules(model, ["Block"])
  with pytest.raises(RuntimeError) as caught:
    model(torch.randn(2, 8, device=dev))
  assert not isinstance(caught.value, jb.errors.BridgeError)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert model.to(dev)(torch.randn(2, 8, device=dev)).device.type == "xla"
  assert _rows(before)["0"][0] == "bridged"


@pytest.mark.parametrize("entry", ["bridge", "assume_pure"])
def test_a_bridged_function_of_cpu_tensors_runs_as_torch_code(dev, entry):
  w = torch.randn(4, 4)
  fn = lambda x, w: torch.relu(x @ w)  # noqa: E731
  bridged = jb.bridge(fn, name="cpu_fn") if entry == "bridge" else jb.assume_pure(fn)
  x = torch.randn(2, 4)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = bridged(x, w)
  assert out.device.type == "cpu"
  torch.testing.assert_close(out, fn(x, w))
  misses = jb.cache_info().misses
  torch.testing.assert_close(bridged(x.to(dev), w.to(dev)).cpu(), fn(x, w))
  assert jb.cache_info().misses == misses + 1  # bridged on XLA: one trace
  if entry == "bridge":
    assert jb.bridge_report().row("cpu_fn").status == "bridged"


def test_off_xla_reads_one_tensor_of_the_state_else_the_inputs(dev):
  layer = torch.nn.Linear(2, 2)
  walk = modules.StateWalk(layer)
  assert bridging.one_tensor(walk) is layer.weight
  assert bridging.off_xla((torch.ones(2, device=dev),), bridging.one_tensor(walk))  # the state
  layer.to(dev)
  assert bridging.one_tensor(walk).device.type == "xla"  # the live table, after `.to()`
  assert not bridging.off_xla((torch.ones(2),), bridging.one_tensor(walk))
  assert bridging.one_tensor(modules.StateWalk(torch.nn.ReLU())) is None
  assert bridging.off_xla(((torch.ones(2),), {"y": torch.ones(1)}))
  assert not bridging.off_xla(((torch.ones(2),), {"y": torch.ones(1, device=dev)}))
  assert not bridging.off_xla(((3, "a"), {}))  # no tensor: not known to be off XLA


def test_inside_bridged_code_the_traced_tensors_count_as_on_xla(dev):
  seen = []

  @jb.bridge
  def f(x):
    seen.append(bridging.off_xla((x,)))
    return x * 2

  f(torch.ones(2, device=dev))
  assert seen == [False]  # a BridgeModule called here is traced in line, under its own policy
