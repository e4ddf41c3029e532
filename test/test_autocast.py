"""torch.autocast around and inside bridged code: the same dtypes and values as LazyTensor code."""
import copy

import pytest
import torch
import torch.nn.functional as F

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._integrations import autocast


class Block(torch.nn.Module):
  """Linear, LayerNorm, softmax, matmul, log_softmax, cross entropy, cat, pow: each op class."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)
    self.norm = torch.nn.LayerNorm(8)

  def forward(self, x, target):
    h = self.lin(x)
    p = torch.softmax(self.norm(h), -1)
    return {"linear": h, "norm": self.norm(h), "softmax": p, "matmul": p @ h.t(),
            "log_softmax": F.log_softmax(h, -1), "loss": F.cross_entropy(h, target),
            "cat": torch.cat([h, x]), "pow": h.pow(2), "sum": h.sum()}


def _run(module, x, target, device_type, dtype):
  with torch.autocast(device_type, dtype=dtype):
    out = module(x, target)
  sum(v.float().sum() for v in out.values()).backward()
  return out, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bridged_module_matches_lazy_tensor_under_xla_autocast(dev, dtype):
  torch.manual_seed(0)
  lazy = Block().to(dev)
  bridged = jb.BridgeModule(copy.deepcopy(lazy))
  x, target = torch.randn(4, 8).to(dev), torch.tensor([0, 3, 1, 7], device=dev)
  want, want_grads = _run(lazy, x, target, "xla", dtype)
  got, got_grads = _run(bridged, x, target, "xla", dtype)
  assert want["linear"].dtype == dtype and want["softmax"].dtype == torch.float32  # it applies
  assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
  tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
  for k in want:
    torch.testing.assert_close(got[k].float().cpu(), want[k].float().cpu(), atol=tol, rtol=tol,
                               msg=k)
  reference = copy.deepcopy(lazy).cpu()  # float32: both low-precision runs are compared with it
  reference.zero_grad(set_to_none=True)
  sum(v.float().sum() for v in reference(x.cpu(), target.cpu()).values()).backward()
  exact_grads = {n: p.grad for n, p in reference.named_parameters()}
  for name, grad in want_grads.items():
    assert got_grads[name].dtype == grad.dtype == torch.float32
    lazy_error = (grad.cpu() - exact_grads[name]).abs().max()
    bridged_error = (got_grads[name].cpu() - exact_grads[name]).abs().max()
    assert bridged_error <= 2 * lazy_error + tol, (name, bridged_error, lazy_error)


def test_cpu_autocast_leaves_xla_tensors_alone_in_both(dev):
  torch.manual_seed(0)
  lazy = Block().to(dev)
  bridged = jb.BridgeModule(copy.deepcopy(lazy))
  x, target = torch.randn(4, 8).to(dev), torch.tensor([0, 3, 1, 7], device=dev)
  want, _ = _run(lazy, x, target, "cpu", torch.bfloat16)
  got, _ = _run(bridged, x, target, "cpu", torch.bfloat16)
  assert {v.dtype for v in want.values()} == {v.dtype for v in got.values()} == {torch.float32}
  torch.testing.assert_close(got["matmul"].cpu(), want["matmul"].cpu())


def test_entering_and_leaving_autocast_traces_once_each(dev):
  layer = jb.BridgeModule(torch.nn.Linear(8, 8).to(dev))
  x = torch.randn(2, 8, device=dev)
  dtypes = []
  with torch.no_grad():
    for on in (True, False, True, False, True):
      with torch.autocast("xla", dtype=torch.bfloat16, enabled=on):
        dtypes.append(layer(x).dtype)
  assert dtypes == [torch.bfloat16, torch.float32] * 2 + [torch.bfloat16]
  info = jb.cache_info()
  assert (info.misses, info.hits) == (2, 3)
  assert info.retrace_reasons == ["Linear_fwd: autocast xla bfloat16 (weight cache on) -> off"]


def test_autocast_written_inside_the_bridged_function(dev):
  @jb.bridge
  def f(a, b):
    with torch.autocast("xla", dtype=torch.bfloat16):
      low = a @ b
      with torch.autocast("xla", enabled=False):
        full = a @ b
    return low, full

  a = torch.randn(4, 4, device=dev)
  low, full = f(a, a)
  assert (low.dtype, full.dtype) == (torch.bfloat16, torch.float32)
  torch.testing.assert_close(low.float().cpu(), (a @ a).cpu(), atol=5e-2, rtol=2e-2)


def test_autocast_disabled_inside_the_function_under_an_outer_region(dev):
  @jb.bridge
  def loss(a, b):
    low = a @ b
    with torch.autocast("xla", enabled=False):
      return low, (low.float() @ b)

  a = torch.randn(4, 4, device=dev)
  with torch.autocast("xla", dtype=torch.bfloat16):
    low, full = loss(a, a)
  assert (low.dtype, full.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("stacked", [False, True])
def test_scan_layers_under_autocast(dev, stacked):
  torch.manual_seed(0)
  layers = [torch.nn.Linear(8, 8).to(dev) for _ in range(3)]
  x = torch.randn(2, 8, device=dev)
  with torch.autocast("xla", dtype=torch.bfloat16):
    want = x
    for layer in layers:
      want = layer(want)
    if stacked:
      got = jb.StackedLayers(layers).to(dev)(x.bfloat16())
    else:
      got = jb.scan_layers(layers, x.bfloat16())
  assert got.dtype == want.dtype == torch.bfloat16
  torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=5e-2, rtol=5e-2)


def test_policy_table_names_exactly_torch_xlas_autocast_ops():
  assert set(autocast.XLA_POLICY) == torch_private.autocast_registrations("AutocastXLA")


def test_policy_for_torch_functions_and_aten_ops():
  assert autocast.policy_for(F.linear) == autocast.LOWER
  assert autocast.policy_for(torch.Tensor.softmax) == autocast.FP32
  assert autocast.policy_for(torch.ops.aten.cat.default) == autocast.PROMOTE
  assert autocast.policy_for(torch.ops.aten.pow.Tensor_Scalar) == autocast.FP32
  assert autocast.policy_for(torch.ops.aten.pow.Tensor_Tensor) is None
  assert autocast.policy_for(torch.pow) is None  # only one overload of pow is in the table
  assert autocast.policy_for(torch.sin) is None
