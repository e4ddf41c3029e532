"""assume_pure's upstream keywords (use_cache); the entry points' argument errors, raised when
the entry point is called and saying what was wrong and what to give."""
import re

import pytest
import torch

import torch_xla_jaxbridge as jb


def test_use_cache_false_traces_every_call(dev):
  scale = {"by": 2.0}

  def times(a):
    return a * scale["by"]

  cached, every_call = jb.assume_pure(times), jb.assume_pure(times, use_cache=False)
  x = torch.ones(2, device=dev)
  misses = jb.cache_info().misses
  assert cached(x).cpu().tolist() == [2.0, 2.0]
  assert cached(x).cpu().tolist() == [2.0, 2.0]  # nothing changed: the cached trace
  scale["by"] = 3.0
  assert cached(x).cpu().tolist() == [3.0, 3.0]  # a plain value it reads changed: traced again
  assert jb.cache_info().misses == misses + 2
  assert every_call(x).cpu().tolist() == [3.0, 3.0]
  assert every_call(x).cpu().tolist() == [3.0, 3.0]  # nothing changed, traced all the same
  assert jb.cache_info().misses == misses + 4


def test_bridge_modules_takes_one_class_or_name_as_a_list_of_it(dev):
  for one in ("Linear", torch.nn.Linear):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert jb.bridge_modules(net.to(dev), one) == ["0", "2"]
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      "bridge_modules: classes holds [3]; give module classes or their names")):
    jb.bridge_modules(torch.nn.Linear(2, 2), 3)


def test_bridge_modules_of_a_function_says_it_takes_a_module():
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      "bridge_modules: model is a function; it takes a torch.nn.Module, whose submodules of the "
      "given classes it bridges in place, e.g. `jb.bridge_modules(model, ['LlamaDecoderLayer'])`. "
      "For a function, use `jb.bridge(fn)`.")):
    jb.bridge_modules(lambda x: x, ["Linear"])


@pytest.mark.parametrize("entry", ["bridge", "bridge(remat=)", "assume_pure"])
def test_bridge_and_assume_pure_of_a_non_function_raise_at_once(entry):
  make = {"bridge": jb.bridge, "bridge(remat=)": jb.bridge(remat="full"),
          "assume_pure": jb.assume_pure}[entry]
  where = entry.split("(")[0]
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      f"{where}: its first argument is an int (3), not a function; it takes the torch function")):
    make(3)
  with pytest.raises(TypeError):  # as a TypeError too, where code catches that
    make("full")


def test_bridge_says_how_to_give_its_options():
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      "bridge: its first argument is a str ('full'), not a function; it takes the torch function "
      "to bridge: `@jb.bridge` above its `def`, or `jb.bridge(fn)`, with options as keywords")):
    jb.bridge("full")


def test_train_step_of_a_loss_tensor_says_it_takes_the_loss_function(dev):
  model = torch.nn.Linear(4, 1).to(dev)
  loss = model(torch.ones(2, 4, device=dev)).sum()
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      "train_step: its first argument is a Tensor of shape (), not a function; it takes the loss "
      "function, torch code that computes the loss and that each step calls with the step's "
      "arguments, not a loss already computed: `step = jb.train_step(lambda x, y: "
      "F.mse_loss(model(x), y), optimizer)`, then `loss = step(x, y)` each step.")):
    jb.train_step(loss, jb.optim.SGD(model.parameters(), lr=0.1))


def test_bridge_modules_called_again_returns_the_paths_and_applies_its_options(dev):
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(dev)
  x = torch.randn(3, 4, device=dev)
  assert jb.bridge_modules(net, ["Linear"]) == ["0", "2"]
  first = net(x).cpu()
  assert jb.bridge_modules(net, ["Linear"]) == ["0", "2"]  # a setup run twice
  torch.testing.assert_close(net(x).cpu(), first)
  assert jb.bridge_modules(net, ["Linear"], remat="full") == ["0", "2"]
  assert net[0].forward.args[1].remat == "full"
  torch.testing.assert_close(net(x).cpu(), first)
