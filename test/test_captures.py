"""Captured tensors lifted: closures, globals, `self` attributes, partial arguments, the objects,
dicts, lists and tuples held there, and modules passed as arguments are inputs of the trace, read
fresh on every call, differentiated when they require grad, against eager CPU PyTorch."""
import collections
import copy
import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import models
import torch_xla_jaxbridge as jb
from parity import rel_err
from torch_xla_jaxbridge._bridge import reach

SCALE = None  # a global tensor read by `_scaled` (set by the tests)


def _scaled(x):
  return x * SCALE + sum(SCALE for _ in range(2))  # the generator's code reads SCALE too


def _misses():
  return jb.cache_info().misses


@pytest.mark.parametrize("make", [models.MLP, models.ConvNet], ids=["mlp", "convnet_bn"])
def test_closure_over_module_matches_eager(dev, make):
  torch.manual_seed(0)
  ref = make()
  model = copy.deepcopy(ref).to(dev)
  shape = (6, 8) if make is models.MLP else (4, 3, 6, 6)
  x = torch.randn(shape)

  @jb.bridge
  def loss_fn(inp):
    return (model(inp) ** 2).mean()

  loss = loss_fn(x.to(dev))
  loss.backward()
  ref_loss = (ref(x) ** 2).mean()
  ref_loss.backward()
  torch_xla.sync()
  assert rel_err(loss, ref_loss) < 1e-4
  grads = dict(model.named_parameters())
  for name, p in ref.named_parameters():
    assert grads[name].grad is not None, name
    assert rel_err(grads[name].grad, p.grad) < 1e-4, name
  for name, buf in ref.named_buffers():  # BatchNorm's running statistics written back
    torch.testing.assert_close(dict(model.named_buffers())[name].cpu(), buf, rtol=1e-5,
                               atol=1e-6)


def test_closure_called_five_times_traces_once(dev):
  model = models.MLP().to(dev)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  loss_fn = jb.bridge(lambda x: model(x).pow(2).mean(), name="loss_fn")
  x = torch.randn(6, 8, device=dev)
  losses = []
  for _ in range(5):
    loss = loss_fn(x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
    losses.append(loss.item())
  info = jb.cache_info()
  assert info.misses == 2  # one forward and one backward trace
  assert info.hits == 8
  assert losses[-1] < losses[0]  # each step read the updated parameters


def test_global_tensor_replaced_is_read_fresh(dev):
  global SCALE
  bridged = jb.bridge(_scaled)
  x = torch.ones(3, device=dev)
  SCALE = torch.tensor([1.0, 2.0, 3.0], device=dev)
  assert bridged(x).cpu().tolist() == [3.0, 6.0, 9.0]
  misses = _misses()
  SCALE = torch.tensor([10.0, 20.0, 30.0], device=dev)
  assert bridged(x).cpu().tolist() == [30.0, 60.0, 90.0]
  assert _misses() == misses
  SCALE = torch.ones(4, device=dev)  # a new shape: a new trace, with its reason
  assert bridged(torch.ones(4, device=dev)).cpu().tolist() == [3.0] * 4
  assert "shape (3,) -> (4,)" in jb.cache_info().retrace_reasons[-1]


def test_captured_tensor_updated_in_place_is_read_fresh(dev):
  bias = torch.zeros(3, device=dev)
  shift = jb.bridge(lambda x: x + bias, name="shift")
  x = torch.ones(3, device=dev)
  assert shift(x).cpu().tolist() == [1.0, 1.0, 1.0]
  misses = _misses()
  bias.add_(2.0)
  assert shift(x).cpu().tolist() == [3.0, 3.0, 3.0]
  bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
  assert shift(x).cpu().tolist() == [2.0, 3.0, 4.0]
  assert _misses() == misses


def test_captured_tensor_gradient_and_in_place_update(dev):
  w_cpu = torch.randn(4, 3, requires_grad=True)
  w = w_cpu.detach().to(dev).requires_grad_()
  steps = torch.zeros((), device=dev)

  @jb.bridge
  def f(x):
    steps.add_(1)  # an update of a captured tensor is written back, as for an argument
    return torch.tanh(x @ w).sum()

  x = torch.randn(2, 4)
  f(x.to(dev)).backward()
  f(x.to(dev))
  torch.tanh(x @ w_cpu).sum().backward()
  torch_xla.sync()
  assert rel_err(w.grad, w_cpu.grad) < 1e-5
  assert steps.item() == 2.0


def test_self_attributes_of_methods_modules_and_callables(dev):
  class Scaler:
    def __init__(self):
      self.scale = torch.full((3,), 2.0, device=dev, requires_grad=True)

    def __call__(self, x):
      return (x * self.scale).sum()

  scaler = Scaler()
  jb.bridge(scaler)(torch.ones(3, device=dev)).backward()
  assert scaler.scale.grad.cpu().tolist() == [1.0, 1.0, 1.0]

  torch.manual_seed(0)
  ref = models.MLP()
  model = copy.deepcopy(ref).to(dev)
  x = torch.randn(2, 8)
  for bridged in (jb.bridge(model), jb.bridge(model.forward)):
    model.zero_grad()
    bridged(x.to(dev)).sum().backward()
    torch_xla_sync_and_compare(model, ref, x)


def torch_xla_sync_and_compare(model, ref, x, loss=lambda net, inp: net(inp).sum()):
  ref.zero_grad()
  loss(ref, x).backward()
  torch_xla.sync()
  grads = dict(model.named_parameters())
  for name, p in ref.named_parameters():
    assert rel_err(grads[name].grad, p.grad) < 1e-4, name


def test_training_mode_and_module_identity_key_the_trace(dev):
  torch.manual_seed(0)
  ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
  model = copy.deepcopy(ref).to(dev)
  run = jb.bridge(lambda x: model(x), name="run")
  x = torch.randn(2, 4)
  run(x.to(dev))
  model.eval()
  torch.testing.assert_close(run(x.to(dev)).cpu(), ref.eval()(x), rtol=1e-5, atol=1e-6)
  assert _misses() == 2  # train and eval: two traces
  model = copy.deepcopy(ref).to(dev)  # another module in the same cell: its own trace
  with torch.no_grad():
    model[0].bias.fill_(5.0)
  torch.testing.assert_close(run(x.to(dev)).cpu(), model.cpu()(x), rtol=1e-5, atol=1e-6)
  assert _misses() == 3


def test_saved_residuals_of_a_closure(dev):
  w = torch.randn(8, 8, requires_grad=True)
  model = torch.nn.Linear(8, 8)

  def block(x):
    return torch.tanh(model(x) @ w)

  report = jb.saved_residuals(block, torch.ones(2, 8))
  names = report.names()
  assert "argument captured w" in names  # for the gradient with respect to model(x)
  explicit = jb.saved_residuals(lambda x, w_, m_w, m_b: torch.tanh(F.linear(x, m_w, m_b) @ w_),
                                torch.ones(2, 8), w, model.weight, model.bias)
  assert "argument args[0]" in names  # x, for the gradient of model.weight
  assert [(r.shape, r.bytes) for r in report.rows] == [(r.shape, r.bytes) for r in explicit.rows]


def test_captured_cpu_tensor_is_named(dev):
  table = torch.ones(3)
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"lookup reads `table` \(a cpu tensor of shape \(3,\)\).*\.to\('xla'\)"):
    jb.bridge(lambda x: x * table, name="lookup", fallback=False)(torch.ones(3, device=dev))


class Extension:  # holds its values as a C extension object does: no `__dict__` to read
  __slots__ = ("w",)


def test_a_tensor_the_search_cannot_reach_is_refused_naming_where_it_stopped(dev):
  box = types.SimpleNamespace(ext=Extension())
  box.ext.w = torch.ones(5, device=dev)

  @jb.bridge(fallback=False)
  def uses_extension(x):
    return x * box.ext.w

  with pytest.raises(jb.errors.CapturedTensorError,
                     match=r"uses_extension: a torch tensor of shape \(5,\) that is not an "
                     r"input .* used at .*test_captures.py:\d+: return x \* box.ext.w.*Pass it in "
                     r"as an argument \(or the model holding it\), or read it into a variable the "
                     r"function captures.* The search for captured tensors stopped at `box.ext` "
                     r"\(of type Extension: no `__dict__`, so its attributes cannot be read\)\."):
    uses_extension(torch.ones(5, device=dev))


class Trainer:  # a plain object holding the model (a transformers Trainer, a config object)
  def __init__(self, model, scale):
    self.model, self.cfg = model, types.SimpleNamespace(scale=scale, steps=3)

  def compute_loss(self, x):
    return (self.model(x) * self.cfg.scale).square().mean()


def loss_shapes(model, scale):
  """The same loss reached through objects, dicts, lists, tuples, methods and partials."""
  trainer = Trainer(model, scale)
  pair = collections.namedtuple("Pair", "model scale")(model, scale)
  setup = {"models": [model], "scale": (scale,)}
  compute = trainer.compute_loss
  return {"object attributes": lambda x: (trainer.model(x) * trainer.cfg.scale).square().mean(),
          "bound method of an object": trainer.compute_loss,
          "lambda calling a method": lambda x: trainer.compute_loss(x),
          "a bound method in a variable": lambda x: compute(x),
          "dict, list and tuple":
              lambda x: (setup["models"][0](x) * setup["scale"][0]).square().mean(),
          "namedtuple": lambda x: (pair.model(x) * pair.scale).square().mean(),
          "partial of a partial": functools.partial(functools.partial(_scaled_loss, model), scale)}


def _scaled_loss(model, scale, x):
  return (model(x) * scale).square().mean()


@pytest.mark.parametrize("shape", list(loss_shapes(None, None)))
def test_modules_and_tensors_reached_through_objects_match_eager(dev, shape):
  torch.manual_seed(0)
  ref = models.MLP()
  ref_scale = torch.linspace(0.5, 2.0, 4, requires_grad=True)
  model = copy.deepcopy(ref).to(dev)
  scale = ref_scale.detach().to(dev).requires_grad_()
  x = torch.randn(6, 8)
  loss = jb.bridge(loss_shapes(model, scale)[shape], fallback=False)(x.to(dev))
  loss.backward()
  ref_loss = loss_shapes(ref, ref_scale)[shape](x)
  ref_loss.backward()
  torch_xla.sync()
  assert rel_err(loss, ref_loss) < 1e-5
  assert rel_err(scale.grad, ref_scale.grad) < 1e-5
  grads = dict(model.named_parameters())
  for name, p in ref.named_parameters():
    assert rel_err(grads[name].grad, p.grad) < 1e-5, name


def test_a_module_passed_as_an_argument_is_lifted(dev):
  torch.manual_seed(0)
  ref = models.ConvNet()  # batch norm: its running statistics are written back
  model = copy.deepcopy(ref).to(dev)
  x = torch.randn(4, 3, 6, 6)
  bridged = jb.bridge(lambda net, inp: net(inp).square().mean(), name="loss", fallback=False)
  bridged(model, x.to(dev)).backward()
  torch_xla_sync_and_compare(model, ref, x, lambda net, inp: net(inp).square().mean())
  for name, buf in ref.named_buffers():
    torch.testing.assert_close(dict(model.named_buffers())[name].cpu(), buf, rtol=1e-5,
                               atol=1e-6)


def test_the_walk_is_kept_and_values_are_read_where_they_are_now(dev):
  cfg = types.SimpleNamespace(shift=None, steps=0, items=[torch.ones(3, device=dev)])
  f = jb.bridge(lambda x: x + cfg.items[0] + (0 if cfg.shift is None else cfg.shift), name="f")
  x = torch.zeros(3, device=dev)
  assert f(x).cpu().tolist() == [1.0, 1.0, 1.0]
  walks, misses = reach.walks, _misses()
  cfg.steps += 1  # a plain value changed: nothing to walk again
  cfg.items[0] = torch.full((3,), 2.0, device=dev)  # a tensor replaced: read where it is now
  assert f(x).cpu().tolist() == [2.0, 2.0, 2.0]
  assert (reach.walks, _misses()) == (walks, misses)
  cfg.shift = torch.full((3,), 10.0, device=dev)  # a tensor where None was: found, a new trace
  assert f(x).cpu().tolist() == [12.0, 12.0, 12.0]
  assert (reach.walks, _misses()) == (walks + 1, misses + 1)
  cfg.items.append(torch.ones(3, device=dev))  # the list changed: walked again, same trace
  assert f(x).cpu().tolist() == [12.0, 12.0, 12.0]
  assert reach.walks == walks + 2


def test_assigning_a_tensor_held_by_a_captured_object_is_refused(dev):
  state = types.SimpleNamespace(total=torch.zeros(3, device=dev))

  def accumulate(x):
    state.total = state.total + x  # would be lost: the trace cannot reach the caller's object
    return x

  with pytest.raises(jb.errors.MutationError, match=r"accumulate: .* assigned a new value to the "
                     r"captured `state.total`.*`state.total.copy_\(new\)`"):
    jb.bridge(accumulate, fallback=False)(torch.ones(3, device=dev))
  assert state.total.cpu().tolist() == [0.0, 0.0, 0.0]


def test_a_cpu_tensor_held_by_a_captured_object_is_named(dev):
  cfg = types.SimpleNamespace(table=torch.ones(3))
  with pytest.raises(jb.errors.CapturedTensorError,
                     match=r"stopped at `cfg.table` \(a cpu tensor, not lifted: move it with "
                     r"`.to\('xla'\)`\)"):
    jb.bridge(lambda x: x * cfg.table, name="lookup", fallback=False)(torch.ones(3, device=dev))


def test_assigning_a_captured_tensor_is_refused(dev):
  total = torch.zeros(3, device=dev)

  def accumulate(x):
    nonlocal total
    total = total + x  # would be lost: the trace cannot rebind the caller's variable
    return x

  with pytest.raises(jb.errors.MutationError, match=r"accumulate: .* assigned a new value to the "
                     r"captured `total`.*`total.copy_\(new\)`"):
    jb.bridge(accumulate, fallback=False)(torch.ones(3, device=dev))


FACTOR = 2.0  # a global plain value read by `_times_factor`


def _times_factor(x):
  return x * FACTOR


class _Scaled(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(3, 3)
    self.scale = 2.0

  def forward(self, x):
    return self.lin(x) * self.scale


def _plain_value_cases():
  """`(name, run, change)`: `run(x)` through one entry point reads a plain value that
  `change(value)` sets; the result must follow it as plain torch_xla's does."""
  cases = []
  box = {"k": 2.0}
  f = jb.bridge(lambda x: x * box["k"])
  cases.append(("bridge, a dict item", f, lambda v: box.update(k=v)))
  cfg = types.SimpleNamespace(k=2.0)
  g = jb.bridge(lambda x: x * cfg.k)
  cases.append(("bridge, an object's attribute", g, lambda v: setattr(cfg, "k", v)))
  h = jb.bridge(_times_factor)

  def set_factor(v):
    global FACTOR
    FACTOR = v
  cases.append(("bridge, a global", h, set_factor))
  k = 2.0
  closure = jb.bridge(lambda x: x * k)

  def set_k(v):
    nonlocal k
    k = v
  cases.append(("bridge, a closure variable", closure, set_k))
  layer = _Scaled().to("xla")
  cases.append(("BridgeModule", jb.BridgeModule(layer), lambda v: setattr(layer, "scale", v)))
  by_class = _Scaled().to("xla")
  jb.bridge_modules(by_class, ["_Scaled"])
  cases.append(("bridge_modules", by_class, lambda v: setattr(by_class, "scale", v)))
  stepped = _Scaled().to("xla")
  step = jb.train_step(lambda x: stepped(x).sum(), jb.optim.SGD(stepped.parameters(), lr=0.0))
  cases.append(("train_step, a module's attribute", lambda x: step(x),
                lambda v: setattr(stepped, "scale", v)))
  return cases


def test_a_plain_value_changed_between_calls_is_read_anew(dev):
  """A number the bridged code reads (a closure variable, a global, a dict item, an object's or
  a module's attribute) is part of the trace's key: a call after it changed traces again,
  as plain torch_xla computes with the new value, instead of reusing the old constant."""
  x = torch.ones(2, 3, device=dev)
  for name, run, change in _plain_value_cases():
    change(2.0)
    first = run(x).detach().cpu()
    change(3.0)
    misses = _misses()
    second = run(x).detach().cpu()
    torch.testing.assert_close(second, first * 1.5, msg=name)
    assert _misses() > misses, name
    change(3.0)
    misses = _misses()
    run(x)
    assert _misses() == misses, name  # an unchanged value: the cached trace


def test_plain_values_of_equal_value_and_other_type_are_traced_apart(dev):
  """`1`, `1.0` and `True` are equal in Python but not to torch: `x * 1` keeps an integer tensor
  integral, `x * 1.0` makes it floating point."""
  value = 1
  f = jb.bridge(lambda x: x * value)
  x = torch.arange(3, device=dev)
  assert f(x).dtype == torch.int64
  value = 1.0
  assert f(x).dtype == torch.float32


def test_a_forward_that_counts_its_calls_counts_each_call(dev):
  """A module attribute the forward writes is read anew on the next call: each call traces
  with the count it finds, as plain code counts."""
  class Counting(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.lin = torch.nn.Linear(2, 2)
      self.calls = 0

    def forward(self, x):
      self.calls += 1
      return self.lin(x) * self.calls

  model = Counting().to(dev)
  bridged = jb.BridgeModule(model)
  x = torch.ones(1, 2, device=dev)
  outputs = [bridged(x).detach().cpu() for _ in range(3)]
  assert model.calls == 3
  torch.testing.assert_close(outputs[2], outputs[0] * 3)


class RotaryTable(torch.nn.Module):
  """GPT-J's pattern: a table held as a plain tensor attribute (not a buffer), made on the CPU,
  moved to the input's device inside `forward` and stored back."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(4, 4)
    self.table = torch.linspace(-1, 1, 64).reshape(16, 4)

  def forward(self, x, positions):
    table = self.table
    if table.device != positions.device:
      table = table.to(positions.device)
      self.table = table
    return self.proj(x) * table[positions]


@pytest.mark.parametrize("entry", ["BridgeModule", "bridge_modules", "train_step"])
def test_a_plain_tensor_attribute_is_an_input_and_the_call_stays_bridged(dev, entry):
  torch.manual_seed(0)
  model = RotaryTable()
  moved = copy.deepcopy(model).to(dev)  # `.to` moves parameters and buffers, not the table
  x, positions = torch.randn(3, 4), torch.tensor([0, 5, 15])
  expected = model(x, positions)
  expected.sum().backward()
  before = jb.bridge_report()
  if entry == "bridge_modules":
    jb.bridge_modules(moved, [RotaryTable])
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    for _ in range(2):  # the second call reuses the first one's trace and device copy
      if entry == "train_step":
        moved.zero_grad()
        step = jb.train_step(lambda a, p: moved(a, p).sum(),
                             jb.optim.SGD(moved.parameters(), lr=0.0))
        out = step(x.to(dev), positions.to(dev))
        torch.testing.assert_close(out.cpu(), expected.sum().detach())
        continue
      called = jb.BridgeModule(moved) if entry == "BridgeModule" else moved
      moved.zero_grad()
      out = called(x.to(dev), positions.to(dev))
      out.sum().backward()
      torch.testing.assert_close(out.cpu(), expected)
      torch.testing.assert_close(moved.proj.weight.grad.cpu(), model.proj.weight.grad)
  assert all(r.status == "bridged" for r in jb.bridge_report(since=before).rows)
  assert moved.table.device.type == "cpu"  # read as an input: the forward did not move it


def test_an_xla_tensor_attribute_updated_in_place_is_read_fresh(dev):
  layer = torch.nn.Linear(2, 2).to(dev)
  layer.scale = torch.tensor(2.0, device=dev)  # a plain attribute, not a buffer

  class Scaled(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.layer = layer

    def forward(self, x):
      return self.layer(x) * self.layer.scale

  bridged = jb.BridgeModule(Scaled())
  x = torch.ones(1, 2, device=dev)
  first = bridged(x).cpu()
  layer.scale.fill_(3.0)
  torch.testing.assert_close(bridged(x).cpu(), first * 1.5)


class Remembers(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(2, 2)
    self.last = torch.zeros(1, 2)

  def forward(self, x):
    out = self.lin(x)
    self.last = out.detach()
    return out


def test_a_forward_assigning_a_tensor_attribute_falls_back_and_keeps_the_assignment(dev):
  moved = Remembers().to(dev)
  moved.last = moved.last.to(dev)
  x = torch.ones(1, 2, device=dev)
  with pytest.warns(jb.errors.FallbackWarning, match="assigned a new value to the tensor "
                                                     "attribute `last`"):
    out = jb.BridgeModule(moved)(x)
  torch.testing.assert_close(moved.last.cpu(), out.detach().cpu())
