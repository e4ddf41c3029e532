"""memory_report: the numbers come from the compiled program of the step's sync."""
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._compat import torch_xla_private


def _mlp_step(width):
  model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(),
                              torch.nn.Linear(width, 4)).to("xla")
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  x = torch.randn(8, 32, device="xla")
  torch_xla.sync()

  def step():
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
  return step


def test_in_place_update_is_aliased_and_counted_once():
  w = torch.ones(128, 128, device="xla")
  torch_xla.sync()
  report = jb.memory_report(lambda: w.add_(1))
  assert report.alias_bytes == 128 * 128 * 4
  assert report.output_bytes == 128 * 128 * 4
  assert report.total_bytes == report.argument_bytes + report.temp_bytes
  assert torch.equal(w.cpu(), torch.full((128, 128), 2.0))  # the step ran
  assert "total" in str(report)


def test_bigger_model_gives_more_bytes():
  small, big = jb.memory_report(_mlp_step(64)), jb.memory_report(_mlp_step(512))
  assert big.argument_bytes > small.argument_bytes and big.total_bytes > small.total_bytes
  # SGD updates every parameter in place: each is aliased
  assert big.alias_bytes >= (32 * 512 + 512 + 512 * 4 + 4) * 4


def _stacked_step(remat):
  from torch_xla_jaxbridge.recipes.llama import DecoderLayer

  torch.manual_seed(0)
  layers = [DecoderLayer(64, 2, 2, 128) for _ in range(4)]
  stack = jb.StackedLayers(layers, remat=remat).to("xla")
  positions = torch.arange(32, device="xla")
  h = torch.randn(2, 32, 64, device="xla")
  torch_xla.sync()

  def step():
    stack(h, positions).square().mean().backward()
  return step


@pytest.mark.slow  # 40-85 s (make slow)
def test_stacked_layers_full_remat_needs_less_temp():
  none = jb.memory_report(_stacked_step(None))
  full = jb.memory_report(_stacked_step("full"))
  assert full.temp_bytes < none.temp_bytes


def test_plain_and_bridged_steps_both_report():
  plain = jb.memory_report(_mlp_step(64))
  layer = torch.nn.Linear(32, 32).to("xla")
  bridged = jb.BridgeModule(layer)
  x = torch.randn(8, 32, device="xla")
  torch_xla.sync()
  report = jb.memory_report(lambda: bridged(x).sum().backward())
  assert plain.outputs > 0 and report.outputs > 0 and report.argument_bytes >= 32 * 32 * 4


def test_reports_torch_xlas_live_tensors():
  report = jb.memory_report(_mlp_step(64))
  assert report.unreached >= 0
  x = torch.ones(3, device="xla") * 2
  assert torch_xla_private.tensor_state(x)[0] in torch_xla_private.live_pending_ids(str(x.device))
  torch_xla.sync()


def test_bad_calls_say_what_to_do():
  with pytest.raises(jb.errors.BadArgumentError, match="as a function"):
    jb.memory_report(torch.ones(2))
  with pytest.raises(jb.errors.BadArgumentError, match="nothing for torch_xla.sync"):
    jb.memory_report(lambda: None)


def _llama_report(mode, remat=None, layers=2):
  """The compiled step memory of a small recipe Llama whose decoder layers run as `mode` says."""
  from torch_xla_jaxbridge.recipes.llama import Llama

  torch.manual_seed(0)
  model = Llama(vocab=64, dim=64, layers=layers, heads=4, kv_heads=2, hidden=256)
  if mode == "BridgeModule":
    model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat) for l in model.layers)
  elif mode == "StackedLayers":
    model.layers = jb.StackedLayers(model.layers, remat=remat)
  model.to("xla")
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  tokens = torch.randint(0, 64, (4, 128), device="xla")
  torch_xla.sync()

  def step():
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
  return jb.memory_report(step)


@pytest.fixture(scope="module")
def lazy_tensor_step():
  return _llama_report("LazyTensor")


@pytest.mark.parametrize("mode", ["BridgeModule", "StackedLayers"])
def test_bridged_step_without_remat_needs_no_more_than_lazy_tensor(lazy_tensor_step, mode):
  bridged = _llama_report(mode)
  # the same parameters (scalars aside), and no more in all
  assert abs(bridged.argument_bytes - lazy_tensor_step.argument_bytes) < 64
  # no more in all, with room: 0.82x / 0.87x here (XLA:CPU's temp block moves by a few KiB with
  # what the process compiled before); 1.0003x while bridged softmax kept its exponentials
  assert bridged.total_bytes <= 0.95 * lazy_tensor_step.total_bytes


def test_per_layer_remat_saves_memory_in_the_step():
  # a policy's recomputation runs after the following layers' backward, not merged with the
  # forward it repeats: the step keeps far less than without a policy
  none, full = _llama_report("BridgeModule", None), _llama_report("BridgeModule", "full")
  assert full.temp_bytes < 0.7 * none.temp_bytes


def test_compile_only_leaves_the_step_pending():
  w = torch.ones(64, 64, device="xla")
  torch_xla.sync()
  report = jb.memory_report(lambda: w.mul_(3), sync=False)
  assert report.alias_bytes == 64 * 64 * 4
  assert torch_xla_private.tensor_state(w)[2]  # still a graph to run
  torch_xla.sync()
  assert torch.equal(w.cpu(), torch.full((64, 64), 3.0))
