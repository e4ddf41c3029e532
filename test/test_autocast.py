"""torch.autocast around and inside bridged code: the same dtypes and values as LazyTensor code,
op by op and over training steps."""
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



# op -> (function of x (8, 64), y (64, 64), w and b (64,), whether x is a bfloat16 activation)
_OPS = {
    "layer_norm": (lambda x, y, w, b: F.layer_norm(x, (64,), w, b), True),
    "layer_norm bf16 affine": (lambda x, y, w, b: F.layer_norm(
        x, (64,), w.to(x.dtype), b.to(x.dtype)), True),
    "layer_norm no affine": (lambda x, y, w, b: F.layer_norm(x, (64,)), True),
    "group_norm": (lambda x, y, w, b: F.group_norm(x, 4, w, b), True),
    "gelu": (lambda x, y, w, b: F.gelu(x), True),
    "gelu tanh": (lambda x, y, w, b: F.gelu(x, approximate="tanh"), True),
    "silu": (lambda x, y, w, b: F.silu(x), True),
    "sigmoid": (lambda x, y, w, b: torch.sigmoid(x), True),
    "softmax": (lambda x, y, w, b: torch.softmax(x, -1), True),
    "log_softmax": (lambda x, y, w, b: F.log_softmax(x, -1), True),
    "mm": (lambda x, y, w, b: x @ y, False),
    "bmm": (lambda x, y, w, b: torch.bmm(x.view(2, 4, 64), y.expand(2, 64, 64)), False),
    "addmm": (lambda x, y, w, b: torch.addmm(b, x, y), False),
    "baddbmm": (lambda x, y, w, b: torch.baddbmm(y[:4], x.view(2, 4, 64), y.expand(2, 64, 64)),
                False),
    "addbmm": (lambda x, y, w, b: torch.addbmm(y[:4], x.view(2, 4, 64), y.expand(2, 64, 64)),
               False),
    "linear": (lambda x, y, w, b: F.linear(x, y, b), False),
    "matmul of slices": (lambda x, y, w, b: x[:, :32] @ y[:32], False),  # torchax's views
    "einsum": (lambda x, y, w, b: torch.einsum("ij,jk->ik", x, y), False),
    "einsum sublist": (lambda x, y, w, b: torch.einsum(x, [0, 1], y, [1, 2], [0, 2]), False),
    "conv2d": (lambda x, y, w, b: F.conv2d(x.view(2, 4, 8, 8), y[:8].view(8, 4, 4, 4)), False),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_each_op_under_autocast_as_plain_torch_xla_computes_it(dev, op):
  """Bridged against plain torch_xla under bfloat16 autocast: the same dtype, and values within
  one rounding of plain's (as close to the op computed in float64 as plain's are, or closer)."""
  fn, activation = _OPS[op]
  gen = torch.Generator().manual_seed(0)
  x, y = torch.randn(8, 64, generator=gen) * 3 + 1, torch.randn(64, 64, generator=gen) / 8
  w, b = torch.randn(64, generator=gen) * 0.5 + 1, torch.randn(64, generator=gen) * 0.1
  if activation:
    x = x.bfloat16()  # as a linear's output under autocast
  exact = fn(*(t.double() for t in (x, y, w, b))).float()  # the op on the same values
  bridged, name = jb.bridge(fn, name=op.replace(" ", "_")), op.replace(" ", "_")
  with torch.autocast("xla", dtype=torch.bfloat16):
    want, got = fn(*(t.to(dev) for t in (x, y, w, b))), bridged(*(t.to(dev) for t in (x, y, w, b)))
  assert got.dtype == want.dtype
  # read in their own dtype: a conversion in the same graph can let XLA skip the rounding
  want, got = want.cpu().float(), got.cpu().float()
  plain_error = (want - exact).abs().max().item()
  assert (got - want).abs().max().item() <= 2 * plain_error + 1e-6, op
  if op != "addbmm":  # torchax's rounds the product and the added input apart: 1 ulp more here
    assert (got - exact).abs().max().item() <= 1.05 * plain_error + 1e-6, op
  assert jb.bridge_report().row(name).status == "bridged"


class _Layer(torch.nn.Module):
  """A pre-norm transformer layer: LayerNorm, attention over a fused projection's slices, GELU
  MLP with a SiLU gate, and a GroupNorm over the features."""

  def __init__(self, dim=32, heads=4):
    super().__init__()
    self.heads = heads
    self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
    self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
    self.up, self.gate = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(dim, 2 * dim)
    self.down, self.group = torch.nn.Linear(2 * dim, dim), torch.nn.GroupNorm(4, dim)

  def forward(self, x):
    b, s, d = x.shape
    q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
               for t in self.qkv(self.norm1(x)).chunk(3, -1))
    weights = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
    x = x + self.out((weights @ v).transpose(1, 2).reshape(b, s, d))
    h = self.norm2(x)
    x = x + self.down(F.gelu(self.up(h)) * F.silu(self.gate(h)))
    return self.group(x.reshape(b * s, d)).view(b, s, d)


def _train_under_autocast(model, mode, x, target, steps=2):
  if mode == "train_step":
    step = jb.train_step(lambda x, t: F.mse_loss(model(x).float(), t),
                         jb.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
  else:
    if mode == "by class":
      jb.bridge_modules(model, ["_Layer"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def step(x, t):
      optimizer.zero_grad()
      loss = F.mse_loss(model(x).float(), t)
      loss.backward()
      optimizer.step()
      return loss
  losses = []
  for _ in range(steps):
    with torch.autocast("xla", dtype=torch.bfloat16):
      losses.append(step(x, target).item())
  return losses


def test_decoder_layers_train_under_autocast_as_plain_torch_xla(dev):
  torch.manual_seed(0)
  model = torch.nn.Sequential(_Layer())
  x, target = torch.randn(2, 8, 32).to(dev), torch.randn(2, 8, 32).to(dev)
  plain = _train_under_autocast(copy.deepcopy(model).to(dev), "plain", x, target)
  assert plain[1] < plain[0]  # it trains
  for mode in ("by class", "train_step"):
    before, moved = jb.bridge_report(), copy.deepcopy(model).to(dev)
    losses = _train_under_autocast(moved, mode, x, target)
    assert losses == pytest.approx(plain, rel=1e-3), mode  # measured: 6e-5
    rows = jb.bridge_report(since=before).rows
    assert len(rows) == 1
    assert all(row.status == "bridged" for row in rows)
