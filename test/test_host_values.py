"""Plain values a forward reads from outside its arguments and its module's attributes (a global,
a class attribute, an environment variable, a helper function's global) are part of a call's
cache key (`_core.host_values`): when one changes the call traces again, as plain torch_xla reads
it at every step, instead of running the old constant. Values against eager CPU torch; traces by
the lowering cache's counters."""
import copy
import os

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
import entries
from torch_xla_jaxbridge._core import host_values

SCALE = 1.0
_ENV = "JAXBRIDGE_TEST_DOUBLE"


def _scaled(y):
  return y * SCALE


class Block(torch.nn.Module):
  factor = 1.0

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)

  def forward(self, x):
    y = _scaled(self.lin(x)) * self.factor
    if os.environ.get(_ENV) == "1":
      y = y * 2
    return y


@pytest.fixture
def restore():
  global SCALE
  yield
  SCALE, Block.factor = 1.0, 1.0
  os.environ.pop(_ENV, None)


def _set(kind):
  global SCALE
  if kind == "global":
    SCALE = 3.0
  elif kind == "class attribute":
    Block.factor = 5.0
  else:
    os.environ[_ENV] = "1"


@pytest.mark.parametrize("kind", ["global", "class attribute", "environment variable"])
@pytest.mark.parametrize("entry", entries.ENTRIES)
def test_a_changed_outside_value_traces_again_and_gives_eagers_values(dev, restore, entry, kind):
  torch.manual_seed(0)
  eager = torch.nn.Sequential(Block())
  model = copy.deepcopy(eager).to(dev)
  call = entries.bridged(entry, model, "Block")
  x = torch.randn(2, 4)
  jb.clear_cache()
  for step in range(4):
    if step == 2:
      _set(kind)
    out = call(x.to(dev))
    out.square().sum().backward()
    expected = eager(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out.cpu(), expected, msg=f"step {step}")
    if step == 1:
      misses = jb.cache_info().misses
  assert jb.cache_info().misses == 2 * misses  # traced again once, at the change
  for p, q in zip(model.parameters(), eager.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad)


def test_a_value_set_back_reuses_its_trace(dev, restore):
  global SCALE
  model = torch.nn.Sequential(Block()).to(dev)
  jb.bridge_modules(model, ["Block"])
  x = torch.randn(2, 4, device=dev)
  first = model(x).cpu()
  misses, hits = jb.cache_info().misses, jb.cache_info().hits
  SCALE = 3.0
  torch.testing.assert_close(model(x).cpu(), first * 3)
  SCALE = 1.0
  torch.testing.assert_close(model(x).cpu(), first)
  assert jb.cache_info().misses == 2 * misses  # traced for 3.0 only
  assert jb.cache_info().hits > hits


def test_train_step_reads_a_changed_global_of_its_loss(dev, restore):
  global SCALE
  torch.manual_seed(0)
  eager = torch.nn.Linear(4, 1)
  model = copy.deepcopy(eager).to(dev)
  opt = jb.optim.SGD(model.parameters(), lr=0.1)
  eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
  step = jb.train_step(lambda x: _scaled(model(x)).square().mean(), opt)
  x = torch.randn(8, 4)
  for i in range(4):
    if i == 2:
      SCALE = 3.0
    loss = step(x.to(dev))
    torch_xla.sync()
    eager_opt.zero_grad()
    expected = _scaled(eager(x)).square().mean()
    expected.backward()
    eager_opt.step()
    torch.testing.assert_close(loss.cpu(), expected.detach(), msg=f"step {i}")
  torch.testing.assert_close(model.weight.cpu(), eager.weight.detach())


def test_what_is_found_and_what_is_not():
  found = host_values.of_modules(Block().modules())
  assert dict(zip(found.names, found.read())) == {
      "class attribute Block.factor": 1.0, f"environment variable {_ENV}": None,
      f"global {__name__}.SCALE": 1.0, f"global {__name__}._ENV": _ENV}
  # torch's own modules and instance attributes (settings, keyed apart) are not read here
  assert host_values.of_modules(torch.nn.Linear(2, 2).modules()).names == []

  class Instance(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.factor = 2.0

    def forward(self, x):
      return x * self.factor

  assert host_values.of_modules([Instance()]).names == []


class Config:
  def __init__(self):
    self.scale, self.unused = 1.0, 0


class Configured(torch.nn.Module):
  def __init__(self, config):
    super().__init__()
    self.config, self.lin = config, torch.nn.Linear(4, 4)

  def forward(self, x):
    return self.lin(x) * self.config.scale


def test_a_changed_attribute_of_a_held_config_traces_again(dev):
  torch.manual_seed(0)
  eager = Configured(Config())
  model = copy.deepcopy(eager).to(dev)
  jb.bridge_modules(model, ["Configured"])
  x = torch.randn(2, 4)
  jb.clear_cache()
  torch.testing.assert_close(model(x.to(dev)).cpu(), eager(x))
  misses = jb.cache_info().misses
  model.config.unused = eager.config.unused = 5  # not read by the forward: no new trace
  torch.testing.assert_close(model(x.to(dev)).cpu(), eager(x))
  assert jb.cache_info().misses == misses
  model.config.scale = eager.config.scale = 3.0
  torch.testing.assert_close(model(x.to(dev)).cpu(), eager(x))
  assert jb.cache_info().misses == 2 * misses
  assert jb.cache_info().retrace_reasons[-1].endswith(": Configured.config.scale 1.0 -> 3.0")
  assert host_values.of_modules(model.modules()).names == [
      "attributes Configured.config.{scale}"]


class Defaulted(Configured):
  """Sets a config default on its first call, as a Hugging Face classifier sets
  `config.problem_type` from its labels, and reads it."""

  def forward(self, x):
    if self.config.kind is None:
      self.config.kind = "doubled"
    return self.lin(x) * (2.0 if self.config.kind == "doubled" else 1.0)


@pytest.mark.parametrize("entry", [*entries.ENTRIES, "train_step"])
def test_a_config_value_the_first_call_sets_traces_again_once_and_says_so(dev, entry):
  """The second call starts from the value the first one's trace wrote: a value its program may
  depend on (a lazy default set before it is read, or a first-call-only branch), so it is
  traced for it, once, with a reason that names the value."""
  config = Config()
  config.kind = None
  torch.manual_seed(0)
  eager = Defaulted(copy.deepcopy(config))
  model = copy.deepcopy(eager).to(dev)
  x = torch.randn(2, 4)
  if entry == "train_step":
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    call = jb.train_step(lambda x: model(x).square().mean(),
                         jb.optim.SGD(model.parameters(), lr=0.1))
  else:
    call = entries.bridged(entry, model, "Defaulted")
  for step in range(3):
    out = call(x.to(dev))
    expected = eager(x)
    if entry == "train_step":
      expected = expected.square().mean()
      eager_opt.zero_grad()
      expected.backward()
      eager_opt.step()
    torch.testing.assert_close(out.cpu(), expected.detach(), msg=f"step {step}")
    if step == 0:
      misses = jb.cache_info().misses
  assert model.config.kind == eager.config.kind == "doubled"
  assert jb.cache_info().misses == 2 * misses  # at the second call only
  assert jb.cache_info().retrace_reasons[-1].endswith(
      "Defaulted.config.kind None -> 'doubled'"), jb.cache_info().retrace_reasons
