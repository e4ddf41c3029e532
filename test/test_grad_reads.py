"""Inside bridged code `torch.is_grad_enabled()` is the caller's grad mode (and keys the trace), and
`requires_grad` reads as in plain torch: True for the tensors standing for the caller's tensors
that require grad and for what ops compute from them; against plain torch_xla and eager CPU torch
under `BridgeModule`, `bridge_modules`, `bridge` and `train_step`."""
import copy
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


class Branchy(torch.nn.Module):
  """Adds 2 with grad mode on (else 1), 10 when its weight requires grad, 100 when its output
  does (else 1 each): /tmp/hunt/repro_3.py's module."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(2, 2)

  def forward(self, x):
    y = self.lin(x)
    a = 2.0 if torch.is_grad_enabled() else 1.0
    b = 10.0 if self.lin.weight.requires_grad else 1.0
    c = 100.0 if y.requires_grad else 1.0
    return y.sum() * 0 + a + b + c


def _branchy():
  torch.manual_seed(0)
  return Branchy()


def _by_class(model):
  jb.bridge_modules(model, [Branchy])
  return model


def _step(model):
  step = jb.train_step(lambda x: model(x), jb.optim.SGD(model.parameters(), lr=0.0))
  return lambda x: step(x)


ENTRIES = {"BridgeModule": jb.BridgeModule, "bridge_modules": _by_class,
           "bridge": lambda m: jb.bridge(lambda x: m(x), fallback=False), "train_step": _step}


@pytest.mark.parametrize("entry", ENTRIES)
def test_grad_mode_and_requires_grad_read_as_in_plain_torch(entry):
  eager = _branchy()(torch.ones(1, 2)).item()
  plain = _branchy().to("xla")(torch.ones(1, 2, device="xla")).item()
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)  # bridged, not fallen back
    call = ENTRIES[entry](_branchy().to("xla"))
    bridged = [call(torch.ones(1, 2, device="xla")).item() for _ in range(2)]
  assert eager == plain == 112.0 and bridged == [112.0, 112.0]


@pytest.mark.parametrize("entry", ["BridgeModule", "bridge_modules", "bridge"])
def test_under_no_grad_the_no_grad_branch_and_its_own_trace(entry):
  """Under `torch.no_grad()` grad mode reads off (the weight still requires grad, the output does
  not): 1 + 10 + 1, as plain. A frozen model runs the same no-vjp program with grad on or off,
  so the grad mode keys its trace: one trace per mode, each reused."""
  x = torch.ones(1, 2, device="xla")
  with torch.no_grad():
    plain = _branchy().to("xla")(x).item()
  call = ENTRIES[entry](_branchy().to("xla"))
  with torch.no_grad():
    assert [call(x).item() for _ in range(2)] == [plain, plain] == [12.0, 12.0]
  frozen = _branchy().to("xla").requires_grad_(False)
  with torch.no_grad():
    plain_frozen = frozen(x).item()
  assert (plain_frozen, frozen(x).item()) == (3.0, 4.0)
  jb.clear_cache()
  call = ENTRIES[entry](frozen)
  values = []
  for grad in (True, False, True, False):
    with torch.set_grad_enabled(grad):
      values.append(call(x).item())
  assert values == [4.0, 3.0, 4.0, 3.0]
  info = jb.cache_info()
  assert (info.misses, info.hits) == (2, 2)
  assert any("grad mode on -> off" in reason for reason in info.retrace_reasons)


class Reads(torch.nn.Module):
  """Returns `requires_grad` of what its forward computes, as bits (with grad mode in bit 0)."""

  def __init__(self):
    super().__init__()
    self.lin, self.frozen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    self.frozen.requires_grad_(False)

  def forward(self, x):
    y, f = self.lin(x), self.frozen(x)
    z = torch.zeros(1, 2, device=x.device)
    z.copy_(y)  # in place from a tensor that requires grad: z does too
    with torch.no_grad():
      no_grad = y * 2
    reads = [torch.is_grad_enabled(), x.requires_grad, self.lin.weight.requires_grad,
             y.requires_grad, self.frozen.weight.requires_grad, f.requires_grad,
             (f + y).requires_grad, y[0].requires_grad, torch.cat([f, y]).requires_grad,
             y.detach().requires_grad, torch.zeros_like(y).requires_grad,
             y.argmax().requires_grad, no_grad.requires_grad, z.requires_grad]
    return y.sum() * 0 + sum(int(r) << i for i, r in enumerate(reads))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["input", "input_requiring_grad"])
def test_requires_grad_of_leaves_and_of_what_ops_compute_reads_as_plain(grad, input_grad):
  def run(adopt, device):
    torch.manual_seed(0)
    model = adopt(Reads().to(device))
    x = torch.ones(1, 2, device=device, requires_grad=input_grad)
    with torch.set_grad_enabled(grad):
      return int(model(x).item())

  eager = run(lambda m: m, "cpu")
  assert run(lambda m: m, "xla") == eager
  assert run(lambda m: jb.BridgeModule(m, fallback=False), "xla") == eager


class Double(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x):
    return x * (3 if torch.is_grad_enabled() else 2)  # torch runs a forward with grad mode off

  @staticmethod
  def backward(ctx, grad):
    return grad * 2


class Regions(torch.nn.Module):
  """`requires_grad` of what regions traced as functions of arrays return: torch.cond, an
  autograd Function, torch_xla's checkpoint, a bridged module under remat inside."""

  def __init__(self, inner):
    super().__init__()
    self.lin, self.inner = torch.nn.Linear(2, 2), inner

  def forward(self, x):
    from torch_xla.utils.checkpoint import checkpoint

    h = self.lin(x)
    cond = torch.cond(h.sum() > 0, lambda t: t + 1, lambda t: t - 1, (h,))
    function, kept, inner = Double.apply(h), checkpoint(lambda t: t * 3, h), self.inner(x)
    reads = [cond.requires_grad, function.requires_grad, kept.requires_grad, inner.requires_grad]
    total = cond.sum() + function.sum() + kept.sum() + inner.sum()
    return total, total.detach() * 0 + sum(int(r) << i for i, r in enumerate(reads))


def test_what_regions_return_requires_grad_as_in_plain_and_they_stay_bridged():
  torch.manual_seed(0)
  model = Regions(torch.nn.Linear(2, 2))
  x = torch.ones(1, 2)
  moved, bridged = copy.deepcopy(model).to("xla"), copy.deepcopy(model).to("xla")
  bridged.inner = jb.BridgeModule(bridged.inner, remat="full")
  expected, expected_reads = moved(x.to("xla"))
  out, reads = jb.BridgeModule(bridged, fallback=False)(x.to("xla"))
  assert reads.item() == expected_reads.item() == 0b1111
  assert out.item() == pytest.approx(expected.item())
  out.backward()
  expected.backward()
  torch_xla.sync()
  for p, q in zip(bridged.parameters(), moved.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def test_a_tensor_hook_in_bridged_code_falls_back_and_runs_as_in_plain():
  """torch's own code reads torch's flag (nothing is recorded on traced tensors): registering a
  hook fails in the trace, so the module falls back and the hook runs, rather than being kept
  on a traced tensor where it would never run."""
  seen = []

  class Hooked(torch.nn.Linear):

    def forward(self, x):
      y = super().forward(x)
      y.register_hook(lambda grad: seen.append(grad.sum().item()))
      return y

  torch.manual_seed(0)
  model = jb.BridgeModule(Hooked(2, 2).to("xla"))
  with pytest.warns(jb.errors.FallbackWarning, match="register a hook"):
    out = model(torch.ones(1, 2, device="xla"))
  out.sum().backward()
  assert seen == [2.0]


class FrozenProj(torch.nn.Module):
  """`proj` runs under a grad-off block inside the forward: torch records none of it."""

  def __init__(self, block):
    super().__init__()
    self.proj, self.block = torch.nn.Linear(4, 4), block

  def forward(self, x):
    with self.block():
      k = self.proj(x)
    return x + torch.tanh(k)


@pytest.mark.parametrize("block", [torch.no_grad, lambda: torch.set_grad_enabled(False),
                                   torch.inference_mode], ids=["no_grad", "set_grad", "inference"])
@pytest.mark.parametrize("entry", ["BridgeModule", "bridge_modules", "bridge", "train_step"])
def test_what_a_no_grad_block_computes_gets_no_gradient_as_in_eager(entry, block):
  """The block's results carry no gradient into JAX's vjp: the input's gradient is eager's, and
  `proj`'s parameters, used only there, get none (zeros, or None as in eager)."""
  torch.manual_seed(0)
  eager, x = FrozenProj(block), torch.randn(2, 4)
  x_eager = x.clone().requires_grad_()
  eager(x_eager).square().sum().backward()
  assert eager.proj.weight.grad is None
  model = copy.deepcopy(eager).to("xla")
  x_xla = x.to("xla").requires_grad_()
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)  # bridged, not fallen back
    if entry == "train_step":
      loss = lambda t: model(t).square().sum()  # noqa: E731
      step = jb.train_step(loss, jb.optim.SGD(model.parameters(), lr=1.0))
      before = model.proj.weight.detach().cpu().clone()
      step(x_xla)
      torch.testing.assert_close(model.proj.weight.detach().cpu(), before)  # no gradient: kept
      return
    if entry == "bridge_modules":
      jb.bridge_modules(model, [FrozenProj])
    call = model if entry == "bridge_modules" else ENTRIES[entry](model)
    call(x_xla).square().sum().backward()
  torch.testing.assert_close(x_xla.grad.cpu(), x_eager.grad)
  for p in model.proj.parameters():
    assert p.grad is None  # as eager: no output depends on it


def _view_read(w, x):
  with torch.no_grad():
    v = w[0]
  return (v * x).sum() + w.sum()


def _in_place(w, x):
  y = w * 2
  with torch.no_grad():
    y.mul_(3)
  return (y * x).sum()


def _in_place_from_outside(w, x):
  y = w * 1
  with torch.no_grad():
    y.add_(x)
  return (y * y).sum()


def _through_a_view(w, x):
  y = w * 2
  with torch.no_grad():
    y[0].mul_(5)
  return (y * x).sum()


def _assignment(w, x):
  y = w * 3
  with torch.no_grad():
    y[2] = x[0]
  return (y * y).sum()


@pytest.mark.parametrize("fn", [_view_read, _in_place, _in_place_from_outside, _through_a_view,
                                _assignment])
def test_views_and_in_place_writes_under_no_grad_get_eagers_gradients(fn):
  """A view taken under no_grad carries no gradient; a write made there changes the value and
  leaves the written tensor's gradient path as it was (torch's graph does not see it)."""
  torch.manual_seed(0)
  w, x = torch.randn(3, 3), torch.randn(3, 3)
  eager_w = w.clone().requires_grad_()
  eager = fn(eager_w, x)
  eager.backward()
  xla_w = w.to("xla").requires_grad_()
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    bridged = jb.bridge(fn)(xla_w, x.to("xla"))
  bridged.backward()
  torch.testing.assert_close(bridged.cpu(), eager)
  torch.testing.assert_close(xla_w.grad.cpu(), eager_w.grad)
