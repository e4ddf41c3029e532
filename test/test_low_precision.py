"""Layer norm, group norm, GELU, SiLU and sigmoid on bfloat16 in bridged code: torch_xla's
dtypes, values within one rounding of plain torch_xla's, and values and gradients as close to the
float32 computation as plain's (the layer norm and group norm forward: the same values)."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import torch_xla_jaxbridge as jb

_MODULES = {
    "LayerNorm": lambda: torch.nn.LayerNorm(64),
    "LayerNorm bfloat16": lambda: torch.nn.LayerNorm(64).bfloat16(),
    "LayerNorm over two dims": lambda: torch.nn.LayerNorm((4, 16)),
    "GroupNorm": lambda: torch.nn.GroupNorm(4, 64),
    "GroupNorm bfloat16": lambda: torch.nn.GroupNorm(4, 64).bfloat16(),
    "GELU": torch.nn.GELU,
    "GELU tanh": lambda: torch.nn.GELU("tanh"),
    "SiLU": torch.nn.SiLU,
    "Sigmoid": torch.nn.Sigmoid,
}


def _run(module, x, g):
  """The output (read in its own dtype) and the gradients of `(module(x) * g).sum()`."""
  x = x.detach().requires_grad_()
  out = module(x)
  (out.float() * g).sum().backward()
  torch_xla.sync()
  return out.cpu(), x.grad.cpu().float(), [p.grad.cpu().float() for p in module.parameters()]


def _max_error(a, b):
  return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", list(_MODULES))
def test_each_op_on_bfloat16_as_plain_torch_xla(dev, name):
  torch.manual_seed(0)
  module = _MODULES[name]()
  x = (torch.randn(8, 64) * 3 + 1).bfloat16()
  if name.endswith("over two dims"):
    x = x.view(8, 4, 16)
  g = torch.randn(x.shape)
  exact = copy.deepcopy(module).float()
  exact_x = x.float().requires_grad_()
  (exact(exact_x) * g).sum().backward()
  reference = exact(x.float()).detach()
  plain = _run(copy.deepcopy(module).to(dev), x.to(dev), g.to(dev))
  before = jb.bridge_report()
  bridged = jb.BridgeModule(copy.deepcopy(module).to(dev))
  got = _run(bridged, x.to(dev), g.to(dev))
  assert [r.status for r in jb.bridge_report(since=before).rows] == ["bridged"]
  assert got[0].dtype == plain[0].dtype
  plain_error = _max_error(plain[0], reference)
  assert _max_error(got[0], plain[0]) <= 2 * plain_error
  assert _max_error(got[0], reference) <= 1.05 * plain_error
  if "Norm" in name:  # torch_xla's casting: the same values
    assert _max_error(got[0], plain[0]) == 0
  assert _max_error(got[1], exact_x.grad) <= 1.05 * _max_error(plain[1], exact_x.grad)
  for mine, theirs, want in zip(got[2], plain[2], (p.grad for p in exact.parameters())):
    assert _max_error(mine, want) <= 1.05 * _max_error(theirs, want) + 1e-6


def test_float32_inputs_compute_as_before(dev):
  torch.manual_seed(0)
  x, w, b = torch.randn(2, 8, 4, 4), torch.randn(8), torch.randn(8)

  def fn(x, w, b):
    return (F.layer_norm(x, (4, 4)), F.group_norm(x, 2, w, b), F.gelu(x), F.silu(x),
            torch.sigmoid(x))

  for got, want in zip(jb.bridge(fn)(x.to(dev), w.to(dev), b.to(dev)), fn(x, w, b)):
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_the_statistics_come_back_as_torch_xla_gives_them(dev):
  x = torch.tensor([[1.0, 3.0], [2.0, 6.0]]).bfloat16()

  @jb.bridge
  def stats(x):
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [2], None, None, 0.0)  # the packet
    _, group_mean, group_rstd = torch.ops.aten.native_group_norm(x, None, None, 2, 2, 1, 1, 0.0)
    return mean, rstd, group_mean, group_rstd

  mean, rstd, group_mean, group_rstd = stats(x.to(dev))
  assert (mean.dtype, rstd.dtype) == (torch.float32, torch.float32)  # as torch's meta says
  assert mean.cpu().flatten().tolist() == [2.0, 4.0] and tuple(mean.shape) == (2, 1)
  assert rstd.cpu().flatten().tolist() == [1.0, 0.5]
  assert group_mean.dtype == torch.bfloat16 and tuple(group_mean.shape) == (2, 1)
  assert group_mean.cpu().flatten().tolist() == [2.0, 4.0]
  assert group_rstd.cpu().flatten().tolist() == [1.0, 0.5]
