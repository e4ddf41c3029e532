"""Module hooks inside bridged regions run at every call, as in plain torch_xla: a region whose
submodules hold a forward, forward pre- or backward hook runs that call as plain LazyTensor code
with its submodules bridged one by one (each hook around its own module's call), reported once;
without the hook it is bridged again from its cached trace. Values against plain torch_xla and
eager CPU torch on the same seed."""
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb

MODES = ["eager", "plain", "bridge_modules", "BridgeModule"]


class Block(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(4, 4)
    self.act = torch.nn.Tanh()

  def forward(self, x):
    return self.act(self.fc(x)) + x


def build(mode):
  """A two-block model on eager CPU or XLA, bridged as `mode` says; the same weights each time."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(Block(), Block())
  if mode == "eager":
    return model
  model = model.to("xla")
  if mode == "bridge_modules":
    jb.bridge_modules(model, ["Block"])
  if mode == "BridgeModule":
    return jb.BridgeModule(model)  # the whole model: the hooked module is a grandchild
  return model


def inputs(mode):
  x = torch.linspace(-1, 1, 8).reshape(2, 4)
  return x if mode == "eager" else x.to("xla")


def total(tensor):
  return tensor.sum().detach().cpu()  # float32: compared with float32 tolerances


def by_mode(run):
  """`run(mode)` for every mode; the bridged and plain ones compared with eager's."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    found = {mode: run(mode) for mode in MODES}
  for mode in MODES[1:]:
    torch.testing.assert_close(found[mode], found["eager"], msg=mode)
  return found


def test_a_forward_hook_added_after_the_first_call_changes_the_output():
  def run(mode):
    model, x = build(mode), inputs(mode)
    first = total(model(x))
    handle = model[0].fc.register_forward_hook(lambda m, i, o: o * 0.5)
    hooked = total(model(x))
    handle.remove()
    return [first, hooked, total(model(x))]

  found = by_mode(run)
  assert found["bridge_modules"][0] != found["bridge_modules"][1]
  assert found["BridgeModule"][0] != found["BridgeModule"][1]


def test_a_second_model_with_a_hook_runs_its_own_hook_not_the_first_models_trace():
  def run(mode):
    first, x = build(mode), inputs(mode)
    plain_value = total(first(x))
    second = build(mode)
    second[1].fc.register_forward_hook(lambda m, i, o: -o)
    return [plain_value, total(second(x)), total(first(x))]

  found = by_mode(run)
  assert found["BridgeModule"][0] != found["BridgeModule"][1]
  assert found["bridge_modules"][0] != found["bridge_modules"][1]


def test_a_pre_hook_that_changes_the_input():
  def run(mode):
    model, x = build(mode), inputs(mode)
    model[0].fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    return [total(model(x)) for _ in range(2)]

  by_mode(run)


@pytest.mark.parametrize("mode", ["bridge_modules", "BridgeModule"])
def test_a_counting_hook_counts_every_call(mode):
  def run(mode_):
    model, x, calls = build(mode_), inputs(mode_), []
    model[0].fc.register_forward_hook(lambda m, i, o: calls.append(1))
    model[1].act.register_forward_pre_hook(lambda m, i: calls.append(2))
    values = [total(model(x)) for _ in range(3)]
    return values, [float(len(calls)), float(sum(calls))]

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    found = {m: run(m) for m in ("eager", "plain", mode)}
  assert found["eager"][1] == [6.0, 9.0]
  torch.testing.assert_close(found[mode], found["eager"])
  torch.testing.assert_close(found["plain"], found["eager"])


def test_a_capture_hook_keeps_a_tensor_the_user_can_read():
  def run(mode):
    model, x, kept = build(mode), inputs(mode), []
    model[0].fc.register_forward_hook(lambda m, i, o: kept.append(o.detach()))
    model(x)
    model(x * 2)
    return [t.cpu() for t in kept]

  found = by_mode(run)
  assert len(found["bridge_modules"]) == 2


def test_a_full_backward_hook_on_a_submodule_fires_with_plains_gradients():
  def run(mode):
    model, x, seen = build(mode), inputs(mode), []
    model[0].fc.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].detach()))
    for _ in range(2):
      model(x).pow(2).sum().backward()
    if mode != "eager":
      torch_xla.sync()
    grads = [p.grad.cpu() for p in model.parameters()]
    return [t.cpu() for t in seen], grads

  found = by_mode(run)
  assert len(found["bridge_modules"][0]) == 2


def test_removing_the_hook_bridges_the_module_again_from_its_cached_trace():
  model, x = build("bridge_modules"), inputs("bridge_modules")
  model(x)
  torch_xla.sync()
  handle = model[0].fc.register_forward_hook(lambda m, i, o: o + 1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    model(x)
  assert jb.bridge_report().row("0").status == "fallback"
  handle.remove()
  before = jb.cache_info()
  out = model(x)
  after = jb.cache_info()
  assert after.misses == before.misses and after.hits > before.hits
  assert jb.bridge_report().row("0").status == "bridged"
  eager = build("eager")
  torch.testing.assert_close(out.cpu(), eager(inputs("eager")))


def test_the_fallback_is_reported_once_naming_the_hooked_submodule():
  model, x = build("bridge_modules"), inputs("bridge_modules")
  model[0].fc.register_forward_hook(lambda m, i, o: None)
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for _ in range(3):
      model(x)
  fallbacks = [w for w in said if issubclass(w.category, jb.errors.FallbackWarning)]
  assert len(fallbacks) == 1, [str(w.message) for w in said]
  row = jb.bridge_report().row("0")
  assert row.status == "fallback"
  assert row.reason.startswith("HookError: `0.fc` holds a forward hook")
  assert "hooks run at every call" in row.reason and "outside the bridged calls" in row.reason
  assert jb.bridge_report().row("1").status == "bridged"
  block = build("plain")[0]
  block.act.register_forward_pre_hook(lambda m, i: None)
  with pytest.raises(jb.errors.HookError, match="`Block.act` holds a forward pre-hook"):
    jb.BridgeModule(block, fallback=False)(x)


def _sgd_losses(mode, hook_calls, steps=3):
  """Losses of `steps` SGD steps of the two-block model with a counting hook on `0.fc`: eager and
  plain by backward and step, "train_step" by `jb.train_step`."""
  model = build("eager" if mode == "eager" else "plain")
  x = inputs("eager" if mode == "eager" else "plain")
  handle = model[0].fc.register_forward_hook(lambda m, i, o: hook_calls.append(1))
  loss_fn = lambda x: model(x).pow(2).mean()  # noqa: E731
  if mode == "train_step":
    step = jb.train_step(loss_fn, jb.optim.SGD(model.parameters(), lr=0.1))
    losses = [step(x).item() for _ in range(steps)]
    handle.remove()  # the same step bridges again
    return torch.tensor(losses), step(x).item()
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  losses = []
  for _ in range(steps):
    opt.zero_grad()
    loss = loss_fn(x)
    loss.backward()
    opt.step()
    losses.append(loss.item())
  handle.remove()
  return torch.tensor(losses), loss_fn(x).item()


def test_train_step_runs_a_step_with_a_submodule_hook_plain_and_bridges_again_without():
  found, calls = {}, {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    for mode in ("eager", "plain", "train_step"):
      calls[mode] = []
      found[mode] = _sgd_losses(mode, calls[mode])
  assert len(calls["train_step"]) == len(calls["plain"]) == len(calls["eager"]) == 3
  torch.testing.assert_close(found["plain"][0], found["eager"][0])
  torch.testing.assert_close(found["train_step"][0], found["eager"][0])
  rows = [r for r in jb.bridge_report().rows if r.kind == "step"]
  assert rows[-1].status == "bridged"  # the step after the hook's removal
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    _sgd_losses("train_step", [], steps=1)
  assert "`model.0.fc` holds a forward hook" in str(said[0].message)


def test_a_bridged_function_calling_a_hooked_module_runs_the_hook_every_call():
  def run(mode):
    model, x, calls = build("eager" if mode == "eager" else "plain"), inputs(mode), []
    model[1].fc.register_forward_hook(lambda m, i, o: calls.append(1) or o + 1)
    fn = lambda x: model(x) * 2  # noqa: E731
    if mode != "eager" and mode != "plain":
      fn = jb.bridge(fn)
    return [total(fn(x)) for _ in range(3)], float(len(calls))

  found = by_mode(run)
  assert found["bridge_modules"][1] == 3.0
  reason = jb.bridge_report().row("_lambda_").reason
  assert "HookError: `model.1.fc` holds a forward hook" in reason


def test_a_global_module_hook_runs_on_every_module_as_in_plain():
  from torch.nn.modules import module as torch_module

  def run(mode):
    model, x, calls = build(mode), inputs(mode), []
    handle = torch_module.register_module_forward_hook(lambda m, i, o: calls.append(type(m)))
    try:
      values = [total(model(x)) for _ in range(2)]
    finally:
      handle.remove()
    return values, sorted(c.__name__ for c in calls)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    found = {m: run(m) for m in ("eager", "plain", "bridge_modules")}
  assert found["bridge_modules"] == found["plain"]
  torch.testing.assert_close(found["bridge_modules"][0], found["eager"][0])


class Recording(torch.nn.Module):
  """Registers a hook on its child during its own forward and removes it (as Hugging Face's
  output recorders do): inside the trace, so still bridged."""

  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(4, 4)

  def forward(self, x):
    seen = []
    handle = self.fc.register_forward_hook(lambda m, i, o: seen.append(o))
    out = self.fc(x)
    handle.remove()
    return out + seen[0]


def test_hooks_the_forward_registers_and_removes_itself_stay_in_the_trace():
  torch.manual_seed(0)
  eager = Recording()
  torch.manual_seed(0)
  model = jb.BridgeModule(Recording().to("xla"))
  x = torch.ones(2, 4)
  for _ in range(2):
    torch.testing.assert_close(model(x.to("xla")).cpu(), eager(x))
  row = jb.bridge_report().row("Recording")
  assert row.status == "bridged" and row.traces == 1


def test_the_packages_own_traceable_hooks_keep_a_region_bridged():
  from torch_xla_jaxbridge._bridge import hf_checkpointing

  model, x = build("bridge_modules"), inputs("bridge_modules")
  model[0].fc.register_forward_pre_hook(hf_checkpointing.Reclaim([]))  # marked traceable
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    torch.testing.assert_close(model(x).cpu(), build("eager")(inputs("eager")))
  assert jb.bridge_report().row("0").status == "bridged"
