"""Code that cannot be bridged runs as plain LazyTensor code, narrowly and said once, with the
values eager CPU torch gives; strict mode raises; trace signals; any output structure; layers
compared by attribute values; several threads at once."""
import collections
import copy
import dataclasses
import gc
import threading
import types
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
import entries


class Block(torch.nn.Module):
  def __init__(self, width=8):
    super().__init__()
    self.inner = torch.nn.Linear(width, width)

  def forward(self, x):
    return torch.tanh(self.inner(x))


class CoinModel(torch.nn.Module):
  """Two blocks around a LayerDrop-like Python branch on a random draw (never taken here)."""

  def __init__(self):
    super().__init__()
    torch.manual_seed(0)
    self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    self.head = torch.nn.Linear(8, 1)

  def forward(self, x):
    for block in self.blocks:
      if torch.rand([]) < 0.0:  # data-dependent: cannot be traced
        continue
      x = block(x)
    return self.head(x).squeeze(-1)


def _assert_matches_eager(out, moved, model, x):
  """`out` of the XLA copy `moved` and its parameters' gradients equal eager `model`'s on `x`."""
  out.sum().backward()
  torch_xla.sync()
  expected = model(x)
  expected.sum().backward()
  torch.testing.assert_close(out.cpu(), expected)
  for p, q in zip(moved.parameters(), model.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad)


def eager_and_xla():
  model = CoinModel()
  return model, copy.deepcopy(model).to("xla")


def test_a_function_that_cannot_be_bridged_runs_as_lazy_tensor_code_said_once(dev):
  def branchy(x):
    if x.sum() > 0:
      return x * 2
    return x - 1

  f = jb.bridge(branchy)
  x = torch.randn(5)
  with pytest.warns(jb.errors.FallbackWarning, match=r"branchy runs as plain LazyTensor code "
                    r"\(DataDependentError: .*if x.sum\(\) > 0"):
    out = f(x.to(dev))
  torch.testing.assert_close(out.cpu(), branchy(x))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # said once
    torch.testing.assert_close(f((-x.abs()).to(dev)).cpu(), branchy(-x.abs()))
  row = jb.bridge_report().row("branchy")
  assert row.status == "fallback" and row.kind == "function" and row.traces == 1
  assert row.where.endswith("if x.sum() > 0:") and "test_fallback.py" in row.where


def test_strict_mode_raises_the_error(dev):
  f = jb.bridge(lambda x: x * 2 if x.sum() > 0 else x, fallback=False)
  with pytest.raises(jb.errors.DataDependentError, match="data-dependent Python control flow"):
    f(torch.ones(3, device=dev))
  layer = jb.BridgeModule(CoinModel().to(dev), fallback=False)
  with pytest.raises(jb.errors.DataDependentError, match=r"torch.rand\(\[\]\) < 0.0"):
    layer(torch.ones(2, 8, device=dev))


def test_a_bridge_module_falls_back_to_its_bridged_submodules(dev):
  model, moved = eager_and_xla()
  wrapped = jb.BridgeModule(moved)
  x = torch.randn(4, 8)
  with pytest.warns(jb.errors.FallbackWarning, match="CoinModel runs as plain LazyTensor code"):
    out = wrapped(x.to(dev))
  _assert_matches_eager(out, moved, model, x)
  rows = {r.name: r.status for r in jb.bridge_report().rows if r.name.startswith("CoinModel")}
  assert rows == {"CoinModel": "fallback", "CoinModel.blocks.0": "bridged",
                  "CoinModel.blocks.1": "bridged", "CoinModel.head": "bridged"}
  traces = jb.bridge_report().row("CoinModel").traces
  wrapped(x.to(dev))
  assert jb.bridge_report().row("CoinModel").traces == traces  # one failed try, not one a call


class PassOver(torch.nn.Module):
  """A forward that calls its grandchild directly (`self.model.blocks[i]`), never `self.model`,
  as Hugging Face's OPT calls `self.model.decoder`."""

  def __init__(self):
    super().__init__()
    self.model = CoinModel()

  def forward(self, x):
    if torch.rand([]) < 0.0:  # data-dependent: cannot be traced
      x = -x
    for block in self.model.blocks:
      x = block(x)
    return self.model.head(x).squeeze(-1)


def test_a_fallback_bridges_the_descendants_its_code_calls_past_their_parent(dev):
  model = PassOver()
  moved = copy.deepcopy(model).to(dev)
  x = torch.randn(4, 8)
  with pytest.warns(jb.errors.FallbackWarning, match="PassOver runs as plain LazyTensor code"):
    out = jb.BridgeModule(moved)(x.to(dev))
  _assert_matches_eager(out, moved, model, x)
  # each block one region (its Linear traced in line there, no region of its own)
  rows = {r.name: r.status for r in jb.bridge_report().rows if r.name.startswith("PassOver")}
  assert rows == {"PassOver": "fallback", "PassOver.model.blocks.0": "bridged",
                  "PassOver.model.blocks.1": "bridged", "PassOver.model.head": "bridged"}


def test_the_train_step_falls_back_and_trains_as_eager_adamw(dev):
  model, moved = eager_and_xla()
  ref = torch.optim.AdamW(model.parameters(), lr=0.1)
  opt = jb.optim.AdamW(moved.parameters(), lr=0.1)
  def coin_loss(x, y):
    return ((moved(x) - y) ** 2).mean()

  step = jb.train_step(coin_loss, opt)
  gen = torch.Generator().manual_seed(1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    for _ in range(3):
      x, y = torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)
      ref.zero_grad()
      expected = ((model(x) - y) ** 2).mean()
      expected.backward()
      ref.step()
      loss = step(x.to(dev), y.to(dev))
      torch_xla.sync()
      assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
  for p, q in zip(moved.parameters(), model.parameters()):
    torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    assert p.grad is None  # the step's gradients never reach p.grad
    assert float(opt.state[p]["step"]) == 3  # the failed one-node try advanced nothing
  rows = [r for r in jb.bridge_report().rows if r.name.startswith("train_step(coin_loss)")]
  assert [(r.name, r.status) for r in rows] == [  # the step, the model it reads, then its parts
      ("train_step(coin_loss)", "fallback"), ("train_step(coin_loss).moved", "fallback"),
      ("train_step(coin_loss).moved.blocks.0", "bridged"),
      ("train_step(coin_loss).moved.blocks.1", "bridged"),
      ("train_step(coin_loss).moved.head", "bridged")]


def test_bridge_modules_by_class_keeps_hooks_single_and_values(dev):
  model, moved = eager_and_xla()
  assert jb.bridge_modules(moved, [Block, "Linear"]) == ["blocks.0", "blocks.0.inner",
                                                          "blocks.1", "blocks.1.inner", "head"]
  calls = []
  moved.blocks[0].register_forward_hook(lambda m, args, out: calls.append(out.shape) or out * 2)
  model.blocks[0].register_forward_hook(lambda m, args, out: out * 2)
  x = torch.randn(4, 8)
  out = moved(x.to(dev))
  torch.testing.assert_close(out.cpu(), model(x))
  assert calls == [torch.Size([4, 8])]  # once, around the bridged call
  with pytest.raises(jb.errors.BadArgumentError, match="no submodule of CoinModel is a "
                     r"\['Conv2d'\]; its classes are \['Block', 'CoinModel', 'Linear', "):
    jb.bridge_modules(moved, ["Conv2d"])


def test_trace_signals_answer_as_under_torch_compile_only_in_the_tracing_thread(dev):
  seen, other = [], []
  ready, go = threading.Event(), threading.Event()

  def look(x):
    seen.append((torch.compiler.is_compiling(), torch._dynamo.is_compiling()))
    ready.set()
    go.wait(5)
    return x + 1

  def elsewhere():
    ready.wait(5)
    other.append(torch.compiler.is_compiling())
    go.set()

  watcher = threading.Thread(target=elsewhere)
  watcher.start()
  jb.bridge(look)(torch.ones(2, device=dev))
  watcher.join()
  assert seen == [(True, True)] and other == [False]
  assert not torch.compiler.is_compiling()
  with pytest.raises(jb.errors.DataDependentError):
    jb.bridge(lambda x: x if x.sum() > 0 else -x, fallback=False)(torch.ones(2, device=dev))
  assert not torch.compiler.is_compiling()  # restored after an error too


Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Result:
  value: torch.Tensor
  extra: object = None


torch.utils._pytree.register_dataclass(Result)


def nested(x):
  y = x * 2
  return {"a": [{"b": y, "c": (y + 1, None)}, y.sum()], "n": None, "k": 3, "s": "text",
          "p": Pair(y, x > 0), "r": Result(y - 1, "kept")}


def test_any_output_structure_comes_back_as_eager(dev):
  x = torch.randn(3, requires_grad=True)
  expected = nested(x)
  xla_x = x.detach().to(dev).requires_grad_()
  out = jb.bridge(nested, fallback=False)(xla_x)
  assert jax_structure(out) == jax_structure(expected)
  assert out["k"] == 3 and out["s"] == "text" and out["r"].extra == "kept"
  assert isinstance(out["p"], Pair) and out["p"].right.dtype == torch.bool
  total = lambda o: o["a"][0]["c"][0].sum() + o["p"].left.sum() + o["r"].value.sum()  # noqa
  total(out).backward()
  total(expected).backward()
  torch.testing.assert_close(xla_x.grad.cpu(), x.grad)


def jax_structure(tree):
  return torch.utils._pytree.tree_structure(tree)


@pytest.mark.parametrize("config", [
    lambda: types.SimpleNamespace(scale=2.0, names=["a"]),
    lambda: {"scale": 2.0, "names": ["a"]},
    lambda: Options(2.0, ("a",))])
def test_layers_with_equal_config_objects_share_one_trace(dev, config):
  layers = []
  for _ in range(3):
    layer = Block().to(dev)
    layer.config = config()  # a new object each, equal by value
    layers.append(jb.BridgeModule(layer, fallback=False))
  x = torch.ones(2, 8, device=dev, requires_grad=True)  # as the later layers' inputs
  for layer in layers:
    x = layer(x)
  assert jb.cache_info().misses == 1
  different = Block().to(dev)
  different.config = config()
  setattr(different.config, "scale", 3.0) if not isinstance(different.config, dict) else (
      different.config.update(scale=3.0))
  jb.BridgeModule(different, fallback=False)(x)
  assert jb.cache_info().misses == 2  # not merged with the others


@dataclasses.dataclass
class Options:
  scale: float
  names: tuple


def test_one_function_from_four_threads(dev):
  w = torch.randn(8, 8)
  w_xla = w.to(dev).requires_grad_()

  def f(x):
    return torch.tanh(x @ w_xla).sum()

  bridged = jb.bridge(f, fallback=False)
  failures, results = [], {}

  def work(i):
    try:
      for k in range(20):
        x = torch.full((2 + i % 2, 8), float(i + k) / 10)
        out = bridged(x.to(dev))
        grad, = torch.autograd.grad(out, w_xla)
        results[(i, k)] = (x, out, grad)
    except Exception as e:  # noqa: BLE001
      failures.append(repr(e))

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  torch_xla.sync()
  assert failures == [] and len(results) == 80
  w_cpu = w.clone().requires_grad_()
  for x, out, grad in results.values():
    expected = torch.tanh(x @ w_cpu).sum()
    torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.cpu(), torch.autograd.grad(expected, w_cpu)[0],
                               rtol=1e-5, atol=1e-5)
  assert jb.cache_info().misses == 4  # two shapes, forward and backward: not one per thread


def test_call_jax_says_what_it_needs(dev):
  with pytest.raises(jb.errors.BadArgumentError, match=r"call_jax: jax_func is a int \(42\); "
                     r"expected the JAX function"):
    jb.call_jax(42, (torch.ones(1, device=dev),))


def test_the_report_lists_live_regions_in_order_and_since_an_earlier_report(dev):
  x = torch.ones(2, 8, device=dev)
  first = copy.deepcopy(CoinModel()).to(dev)
  jb.bridge_modules(first, ["CoinModel"])
  with pytest.warns(jb.errors.FallbackWarning):
    first(x)
  before = jb.bridge_report()
  second = jb.BridgeModule(Block().to(dev))
  second(x)
  since = jb.bridge_report(since=before)
  assert [(r.name, r.status) for r in since.rows] == [("Block", "bridged")]
  names = [r.name for r in jb.bridge_report().rows]
  assert names.index("CoinModel") < names.index("CoinModel.blocks.0") < names.index("Block")
  del first
  gc.collect()
  assert [r.name for r in jb.bridge_report(since=before).rows] == ["Block"]
  assert not any(r.name.startswith("CoinModel") for r in jb.bridge_report().rows)
  with pytest.raises(jb.errors.BadArgumentError, match="since= takes a report"):
    jb.bridge_report(since=3)


class PlainTensorsOnly(torch.nn.Module):
  """A library's check that holds for plain torch_xla tensors and not while traced (the traced
  tensors are torchax's class): its AssertionError is not one of the package's errors."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)

  def forward(self, x):
    assert type(x) is torch.Tensor, "expected a torch.Tensor"
    return self.lin(x).relu()


@pytest.mark.parametrize("entry", ["BridgeModule", "bridge_modules", "train_step"])
def test_any_error_of_a_trace_falls_back_with_its_cause_and_line(dev, entry):
  torch.manual_seed(0)
  model = PlainTensorsOnly()
  moved = copy.deepcopy(model).to(dev)
  x = torch.randn(3, 8)
  before = jb.bridge_report()
  with pytest.warns(jb.errors.FallbackWarning, match=r"AssertionError: expected a torch.Tensor"):
    if entry == "train_step":
      step = jb.train_step(lambda b: moved(b).sum(), jb.optim.SGD(moved.parameters(), lr=0.5))
      loss = step(x.to(dev))
      expected = model(x).sum()
      expected.backward()
      torch.testing.assert_close(loss.cpu(), expected.detach())
      for p, q in zip(moved.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach() - 0.5 * q.grad)
    else:
      called = jb.BridgeModule(moved) if entry == "BridgeModule" else moved
      if entry == "bridge_modules":
        jb.bridge_modules(moved, [PlainTensorsOnly])
      _assert_matches_eager(called(x.to(dev)), moved, model, x)
  row = jb.bridge_report(since=before).rows[0]
  assert row.status == "fallback" and row.reason.startswith("JaxTracingError")
  assert row.where.endswith('assert type(x) is torch.Tensor, "expected a torch.Tensor"')


def test_an_error_plain_torch_xla_raises_too_reaches_the_user_as_its_own(dev):
  """Code that fails in any mode falls back, and the plain run raises torch's own error."""
  def bad_shapes(x):
    return x @ x

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    with pytest.raises(RuntimeError, match=r"mm\(\): cannot matrix-multiply") as raised:
      jb.bridge(bad_shapes)(torch.ones(2, 3, device=dev))
  assert not isinstance(raised.value, jb.errors.BridgeError)
  with pytest.raises(jb.errors.JaxTracingError, match="bad_shapes failed while being traced"):
    jb.bridge(bad_shapes, fallback=False)(torch.ones(2, 3, device=dev))


class Checked(torch.nn.Module):
  """Raises the user's own error for a batch it refuses, as plain torch code would."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)

  def forward(self, x):
    if x.shape[0] == 3:
      raise ValueError("batches of 3 are refused")
    return torch.tanh(self.lin(x))


@pytest.mark.parametrize("entry", [*entries.ENTRIES, "train_step"])
def test_an_error_of_the_users_code_reaches_the_caller_and_the_next_call_is_bridged(dev, entry):
  """One bad batch: the error plain torch_xla gives (its type and message), and the region stays
  bridged (it used to run as plain LazyTensor code for the rest of the run)."""
  torch.manual_seed(0)
  eager = torch.nn.Sequential(Checked())
  model = copy.deepcopy(eager).to(dev)
  if entry != "train_step":
    call = entries.bridged(entry, model, "Checked")
  else:
    opt = jb.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    call = jb.train_step(lambda x: model(x).square().mean(), opt)
  before = jb.bridge_report()
  good, bad = torch.randn(2, 4), torch.randn(3, 4)
  for x in (good, bad, good, good):
    if entry == "train_step":
      try:
        eager_opt.zero_grad()
        expected = eager(x).square().mean()
        expected.backward()
        eager_opt.step()
      except ValueError as e:
        expected = e
    else:
      try:
        expected = eager(x)
      except ValueError as e:
        expected = e
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", jb.errors.FallbackWarning)  # said while the call runs
      if isinstance(expected, ValueError):
        with pytest.raises(ValueError, match="batches of 3 are refused"):
          call(x.to(dev))
        continue
      got = call(x.to(dev))
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch_xla.sync()
  rows = jb.bridge_report(since=before).rows
  assert rows and all(r.status == "bridged" for r in rows), rows
  misses = jb.cache_info().misses
  call(good.to(dev))
  assert jb.cache_info().misses == misses  # the trace made before the bad batch, reused
