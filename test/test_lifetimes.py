"""Nothing the package keeps holds a user's model alive: after a few training steps through each
entry point, `del` and one `gc.collect()` free the model, its parameters and its optimizer, and
the traces, compiled programs and report rows kept for them go too (a trace shared by
structurally identical modules stays exactly as long as one of them lives); a model built again
after its twin went is traced again, but torch_xla finds its compiled program."""
import gc
import warnings
import weakref

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_jaxbridge as jb

WIDTH = 7  # a width no other test's live module has: no trace is shared with one of theirs


def _mlp():
  return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                             torch.nn.Linear(WIDTH, WIDTH)).to("xla")


class Branchy(torch.nn.Module):
  """Data-dependent Python control flow: bridged, its region falls back and bridges its
  children."""

  def __init__(self):
    super().__init__()
    self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x):
    h = self.a(x)
    if h.sum() > 0:
      h = torch.relu(h)
    return self.b(h)


def _layers():
  return [torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)]


def _with_backreference():
  """A layer holding a bound method of its model: an attribute that refers back to the model
  (neither the model's structure key nor the walk of its submodules may keep it alive)."""
  model = _mlp()
  model[0].owner_forward = model.forward
  return model


def _bridge_module(m):
  return jb.BridgeModule(m)


# name -> (make the model, how it is trained: the forward made from it (None: the model itself),
# "bridge_modules" (its Linear layers bridged in place) or "train_step")
CASES = {
    "BridgeModule": (_mlp, _bridge_module),
    "BridgeModule remat=full": (_mlp, lambda m: jb.BridgeModule(m, remat="full")),
    "bridge_modules": (_mlp, "bridge_modules"),
    "BridgeModule, an attribute referring to the model": (_with_backreference, _bridge_module),
    "bridge": (_mlp, lambda m: jb.bridge(lambda x: m(x))),
    "assume_pure": (_mlp, lambda m: jb.assume_pure(lambda x: m(x))),
    "train_step": (_mlp, "train_step"),
    "StackedLayers": (lambda: jb.StackedLayers(_layers()).to("xla"), None),
    "scan_layers": (lambda: torch.nn.ModuleList(_layers()).to("xla"),
                    lambda m: lambda x: jb.scan_layers(m, x)),
    "fallback region": (lambda: Branchy().to("xla"), _bridge_module),
    "fallback train_step": (lambda: Branchy().to("xla"), "train_step"),
}


def _train(make, wrap):
  """Builds the model and trains it 2 steps; returns it and everything else the script holds."""
  model = make()
  x = torch.randn(4, WIDTH, device="xla")
  if wrap == "train_step":
    optimizer = jb.optim.AdamW(model.parameters(), lr=0.1)
    step = jb.train_step(lambda x: model(x).square().mean(), optimizer)
    losses = []
    for _ in range(2):
      losses.append(step(x))
      torch_xla.sync()
    return model, (optimizer, step, losses)
  if wrap == "bridge_modules":
    jb.bridge_modules(model, ["Linear"])
    forward = model
  else:
    forward = wrap(model) if wrap is not None else model
  optimizer = jb.optim.AdamW(model.parameters(), lr=0.1)
  losses = []
  for _ in range(2):
    losses.append(forward(x).square().mean())
    losses[-1].backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
  return model, (optimizer, forward, losses)


def _kept():
  return jb.cache_info().currsize, [row.name for row in jb.bridge_report().rows]


@pytest.mark.parametrize("case", list(CASES))
def test_a_dropped_model_is_freed_with_all_the_package_kept_for_it(case):
  gc.collect()
  before = _kept()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    model, rest = _train(*CASES[case])
  optimizer, losses = rest[0], rest[-1]
  assert losses[1].item() != losses[0].item()  # it trained
  during = _kept()
  assert during[0] > before[0]  # its programs were cached
  refs = [weakref.ref(o) for o in [model, optimizer, *model.modules(), *model.parameters()]]
  del model, rest, optimizer, losses
  gc.collect()
  assert [r() for r in refs if r() is not None] == []
  assert _kept() == before


def test_a_trace_shared_by_identical_modules_lives_as_long_as_one_of_them():
  gc.collect()
  before = jb.cache_info().currsize
  first, second = jb.BridgeModule(_mlp()), jb.BridgeModule(_mlp())
  x = torch.randn(4, WIDTH, device="xla")
  first(x).sum().backward()
  torch_xla.sync()
  traced = jb.cache_info()
  second(x).sum().backward()  # shares the first one's trace
  torch_xla.sync()
  assert jb.cache_info().misses == traced.misses
  ref = weakref.ref(first.wrapped)
  del first
  gc.collect()
  assert ref() is None
  assert jb.cache_info().currsize == traced.currsize  # the second one still uses the trace
  second(x).sum().backward()
  torch_xla.sync()
  assert jb.cache_info().misses == traced.misses
  del second
  gc.collect()
  assert jb.cache_info().currsize == before


def test_a_model_built_again_after_its_twin_was_dropped_is_traced_but_not_compiled_again():
  x = torch.randn(4, WIDTH, device="xla")
  torch_xla.sync()

  def train_one():
    model = jb.BridgeModule(_mlp())
    model(x).square().mean().backward()
    torch_xla.sync()  # its gradients
    assert model.wrapped[0].weight.grad is not None

  train_one()
  gc.collect()
  misses, compiles = jb.cache_info().misses, met.counter_value("UncachedCompile")
  train_one()
  assert jb.cache_info().misses > misses  # its trace went with the first model
  assert met.counter_value("UncachedCompile") == compiles  # torch_xla found the program
