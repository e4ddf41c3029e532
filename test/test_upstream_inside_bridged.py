"""torch_xla's own wrappers called inside bridged code: they work there, with LazyTensor's values."""
import copy

import pytest
import torch
import torch_xla
from torch_xla.distributed.fsdp.utils import checkpoint_module
from torch_xla.experimental.assume_pure import PureModule as UpstreamPureModule
from torch_xla.experimental.assume_pure import assume_pure as upstream_assume_pure
from torch_xla.utils.checkpoint import checkpoint as torch_xla_checkpoint

import torch_xla_jaxbridge as jb


def _block():
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _values_and_grads(dev, fn, module):
  x = torch.linspace(-1, 1, 32).reshape(4, 8).to(dev).requires_grad_()
  loss = fn(x)
  loss.backward()
  torch_xla.sync()
  return [loss.cpu(), x.grad.cpu()] + [p.grad.cpu() for p in module.parameters()]


@pytest.mark.parametrize("wrapper", ["checkpoint", "checkpoint_module", "PureModule",
                                     "assume_pure"])
def test_an_upstream_wrapper_inside_bridged_code_matches_lazytensor(dev, wrapper):
  results = {}
  for mode in ("LazyTensor", "bridged"):
    block = _block().to(dev)
    if wrapper == "checkpoint":
      fn = lambda x: torch_xla_checkpoint(block, torch.sin(x)).pow(2).sum()  # noqa: E731
    elif wrapper == "assume_pure":
      pure = upstream_assume_pure(lambda t, *params: torch.func.functional_call(
          block, dict(zip(dict(block.named_parameters()), params)), (t,)))
      fn = lambda x: pure(torch.sin(x), *block.parameters()).pow(2).sum()  # noqa: E731
    else:
      wrapped = checkpoint_module(block) if wrapper == "checkpoint_module" else (
          UpstreamPureModule(block))
      fn = lambda x: wrapped(torch.sin(x)).pow(2).sum()  # noqa: E731
    results[mode] = _values_and_grads(dev, jb.bridge(fn, fallback=False) if mode == "bridged"
                                      else fn, block)
  for got, want in zip(results["bridged"], results["LazyTensor"]):
    torch.testing.assert_close(got, want)


def test_torch_xla_checkpoint_recomputes_inside_bridged_code():
  block = _block()
  x = torch.ones(4, 8, requires_grad=True)
  plain = jb.saved_residuals(lambda t: block(torch.sin(t)).pow(2).sum(), x)
  recomputed = jb.saved_residuals(
      lambda t: torch_xla_checkpoint(block, torch.sin(t)).pow(2).sum(), x)
  assert recomputed.total_bytes < plain.total_bytes
  assert not any(r.shape == (4, 16) for r in recomputed.rows)  # no hidden activation is kept


def test_torch_xla_scan_layers_inside_bridged_code_names_the_replacement(dev):
  from torch_xla.experimental.scan_layers import scan_layers

  layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3)).to(dev)
  fn = lambda x: scan_layers(layers, x).sum()  # noqa: E731
  with pytest.raises(jb.errors.JaxTracingError,
                     match=r"test_upstream_inside_bridged.py:\d+: .*scan_layers cannot run inside "
                           r"bridged code .* call jb.scan_layers there"):
    jb.bridge(fn, fallback=False)(torch.ones(2, 8, device=dev))
  with pytest.warns(jb.errors.FallbackWarning):  # by default it falls back: LazyTensor's values
    torch.testing.assert_close(jb.bridge(fn)(torch.ones(2, 8, device=dev)).cpu(),
                               fn(torch.ones(2, 8, device=dev)).cpu())


class ScannedByUpstream(torch.nn.Module):
  """A model whose layers torch_xla's own `scan_layers` runs (torchprime's `scan` option)."""

  def __init__(self):
    super().__init__()
    torch.manual_seed(0)
    self.layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
    self.head = torch.nn.Linear(8, 1)

  def forward(self, x):
    from torch_xla.experimental.scan_layers import scan_layers

    return self.head(scan_layers(self.layers, x)).sum()

  def eager(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x).sum()


def test_torch_xla_scan_layers_in_a_train_step_falls_back_with_eagers_values(dev):
  """The step cannot trace upstream's scan; in the plain run its layers (bridged by class, as a
  fallback does) are traced by upstream's AOTAutograd, where they run as plain torch code."""
  model = ScannedByUpstream()
  moved = copy.deepcopy(model).to(dev)
  step = jb.train_step(lambda x: moved(x), jb.optim.SGD(moved.parameters(), lr=0.1))
  x = torch.randn(4, 8)
  with pytest.warns(jb.errors.FallbackWarning, match="scan_layers cannot run inside bridged code"):
    loss = step(x.to(dev))
  expected = model.eager(x)
  expected.backward()
  torch.testing.assert_close(loss.cpu(), expected.detach())
  for p, q in zip(moved.parameters(), model.parameters()):
    torch.testing.assert_close(p.detach().cpu(), q.detach() - 0.1 * q.grad)


def test_layers_bridged_by_class_under_torch_xla_scan_layers_say_so_in_the_report(dev):
  """Upstream's scan traces them with AOTAutograd, where they run as plain torch code: values
  are eager's, and the row of the layer it traces (the first; the others' parameters are stacked
  into it, and they are never called) says why it is not bridged (it had no row at all)."""
  model = ScannedByUpstream()
  moved = copy.deepcopy(model).to(dev)
  before = jb.bridge_report()
  assert jb.bridge_modules(moved, [torch.nn.Sequential]) == ["layers.0", "layers.1", "layers.2"]
  x = torch.randn(4, 8)
  with pytest.warns(jb.errors.FallbackWarning, match="TracedByTorchError: called while torch's "
                    "own machinery traces it"):
    loss = moved(x.to(dev))
  loss.backward()
  expected = model.eager(x)
  expected.backward()
  torch.testing.assert_close(loss.cpu(), expected.detach())
  for p, q in zip(moved.parameters(), model.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad)
  rows = jb.bridge_report(since=before).rows
  assert [r.name for r in rows] == ["layers.0"]
  assert all(r.status == "fallback" and r.reason.startswith("TracedByTorchError") for r in rows)


def test_a_bridged_function_as_torch_xla_scan_body_runs_as_plain_code(dev):
  from torch_xla.experimental.scan import scan

  step = jb.bridge(lambda carry, x: (torch.tanh(carry + x), carry * 2))
  init, xs = torch.ones(3), torch.linspace(-1, 1, 12).reshape(4, 3)
  with pytest.warns(jb.errors.FallbackWarning, match="TracedByTorchError"):
    carry, ys = scan(step, init.to(dev), xs.to(dev))
  expected_carry, expected_ys = init, []
  for x in xs:
    expected_carry, y = torch.tanh(expected_carry + x), expected_carry * 2
    expected_ys.append(y)
  torch.testing.assert_close(carry.cpu(), expected_carry)
  torch.testing.assert_close(ys.cpu(), torch.stack(expected_ys))
