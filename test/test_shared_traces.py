"""Modules of one structure share their traces when they differ only in plain values (numbers,
strings) their forward never reads (`_bridge.auto.SharedForward`, `_core.settings_key`), or, with
a Hugging Face cache, only in the index of the cache slot they write (`_bridge.layer_slots`).
Values, gradients and caches against eager CPU torch; traces by the lowering cache's counters."""
import copy
import functools

import pytest
import torch
import torch_xla
import transformers

import torch_xla_jaxbridge as jb


class Block(torch.nn.Module):
  """`index` is never read; `scale` only when `flag` is set."""

  def __init__(self, index, flag, scale):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)
    self.index, self.flag, self.scale = index, flag, scale

  def forward(self, x):
    y = torch.tanh(self.lin(x))
    return x + (y * self.scale if self.flag else y)


def _blocks(settings):
  torch.manual_seed(0)
  return torch.nn.Sequential(*[Block(i, flag, scale) for i, (flag, scale) in enumerate(settings)])


def _forward_and_grads(model, x):
  out = model(x)
  out.square().sum().backward()
  return out, [p.grad for p in model.parameters()]


def _against_eager(settings, passes=1):
  """The bridged model's outputs and gradients equal eager's over `passes` calls; the traces."""
  eager = _blocks(settings)
  moved = copy.deepcopy(eager).to("xla")
  jb.bridge_modules(moved, ["Block"])
  jb.clear_cache()
  x = torch.randn(2, 8, requires_grad=True)  # every layer's input requires grad: one signature
  for _ in range(passes):
    for m in (eager, moved):
      m.zero_grad()
    out, grads = _forward_and_grads(moved, x.to("xla"))
    torch_xla.sync()
    expected, expected_grads = _forward_and_grads(eager, x)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected_grads):
      torch.testing.assert_close(g.cpu(), e, rtol=1e-4, atol=1e-5)
  return jb.cache_info().misses


def test_layers_differing_in_an_unread_index_share_one_trace():
  assert _against_eager([(False, 1.0)] * 4) == 2  # one forward and one backward for four layers


def test_layers_differing_in_a_read_value_trace_apart_and_keep_their_values():
  # scale is read (flag set): two values, two traces each way; the index is still unread
  assert _against_eager([(True, 1.0), (True, 1.0), (True, 2.0), (True, 2.0)]) == 4


def test_a_value_read_only_on_one_branch_is_compared_once_a_trace_reads_it():
  # the first trace reads `flag` alone, so layer 1 shares it; layer 2 takes the other branch
  # and reads `scale` too: from then on calls compare both, layer 3 traces on its own, and on
  # the second pass layer 1 (scale 2.0) no longer matches layer 0's trace: one trace more, once
  settings = [(False, 1.0), (False, 2.0), (True, 3.0), (True, 4.0)]
  misses = _against_eager(settings, passes=2)
  assert misses == 2 * 3 + 2


def test_changing_an_unread_value_keeps_the_trace_and_a_read_one_retraces():
  model = _blocks([(True, 1.0)]).to("xla")
  jb.bridge_modules(model, ["Block"])
  jb.clear_cache()
  x = torch.ones(2, 8, device="xla")
  with torch.no_grad():
    before = model(x).cpu()
    model[0].index = 7
    assert torch.equal(model(x).cpu(), before) and jb.cache_info().misses == 1
    model[0].scale = 3.0
    after = model(x).cpu()
  assert jb.cache_info().misses == 2
  expected = torch.ones(2, 8) + 3.0 * torch.tanh(model[0].lin.cpu()(torch.ones(2, 8)))
  torch.testing.assert_close(after, expected)


class Activated(torch.nn.Module):
  """Holds an activation of its own, a `functools.partial` (as Gemma's `GELUTanh` does)."""

  def __init__(self, approximate="tanh"):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)
    self.act = functools.partial(torch.nn.functional.gelu, approximate=approximate)

  def forward(self, x):
    return x + self.act(self.lin(x))


def test_layers_holding_equal_partials_share_one_trace():
  torch.manual_seed(0)
  eager = torch.nn.Sequential(Activated(), Activated(), Activated("none"))
  moved = copy.deepcopy(eager).to("xla")  # each copy its own partial object
  jb.bridge_modules(moved, ["Activated"])
  jb.clear_cache()
  x = torch.randn(2, 8, requires_grad=True)  # every layer's input requires grad: one signature
  torch.testing.assert_close(moved(x.to("xla")).cpu(), eager(x), rtol=1e-5, atol=1e-6)
  assert jb.cache_info().misses == 2  # the two tanh layers share a forward, the exact one apart


@pytest.mark.parametrize("use_cache", [False, True])
def test_hugging_face_layers_share_one_trace_with_or_without_a_cache(use_cache):
  config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
      use_cache=use_cache)
  torch.manual_seed(0)
  eager = transformers.LlamaForCausalLM(config)
  moved = copy.deepcopy(eager).to("xla")
  jb.bridge_modules(moved, ["LlamaDecoderLayer"])
  jb.clear_cache()
  ids = torch.randint(0, 128, (2, 16))
  optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, moved)]
  for _ in range(2):
    caches = []
    for model, optimizer, inputs in zip((eager, moved), optimizers, (ids, ids.to("xla"))):
      out = model(input_ids=inputs, labels=inputs)
      out.loss.backward()
      optimizer.step()
      optimizer.zero_grad()
      torch_xla.sync()
      caches.append(out.past_key_values)
    if use_cache:  # every layer's slot holds what eager's holds
      for theirs, mine in zip(*(cache.layers for cache in caches), strict=True):
        torch.testing.assert_close(mine.keys.cpu(), theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values.cpu(), theirs.values, rtol=1e-4, atol=1e-5)
    else:
      assert caches == [None, None]
  assert jb.cache_info().misses == 2  # four layers: one trace each way
  for p, q in zip(eager.parameters(), moved.parameters()):
    torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=2e-5)


class _ScaledGradient(torch.autograd.Function):
  """The identity, whose backward scales the gradient by `s` (as a gradient reversal does)."""

  @staticmethod
  def forward(ctx, x, s):
    ctx.s = s
    return x.view_as(x)

  @staticmethod
  def backward(ctx, grad):
    return grad * ctx.s, None


class CacheLayer(torch.nn.Module):
  """Writes its slot of a Hugging Face cache, and by `mode`: "reads_other" also reads the slot
  before its own ("catches": and catches the error that raises); "scaled" doubles its output at
  odd `layer_idx` (an op its index decides); "shifted" adds constants made from its `layer_idx`;
  "function" scales its input's gradient by `layer_idx + 1` in a `torch.autograd.Function`'s
  backward ("function_alike": by 2 in every layer); "grad_branch" scales by its index only where its input requires grad; "marks_cache"
  sets an attribute of the cache; "lazy" makes a tensor attribute at its first call."""

  def __init__(self, layer_idx, mode=None):
    super().__init__()
    self.proj = torch.nn.Linear(8, 8)
    self.layer_idx, self.mode, self.mask = layer_idx, mode, None

  def forward(self, x, cache):
    i, mode = self.layer_idx, self.mode
    if mode == "function":
      x = _ScaledGradient.apply(x, float(i + 1))
    if mode == "function_alike":
      x = _ScaledGradient.apply(x, 2.0)
    k = self.proj(x)
    if mode == "grad_branch" and k.requires_grad:
      k = k * (1.0 + i)
    keys, _ = cache.update(k[:, None], k[:, None], i)
    y = torch.tanh(keys[:, 0])
    if mode == "reads_other" and i > 0:
      y = y + cache.layers[i - 1].keys[:, 0]
    if mode == "catches" and i > 0:
      try:
        y = y + cache.layers[i - 1].keys[:, 0]
      except Exception:  # noqa: BLE001  (what a layer reaching for optional state may do)
        pass
    if mode == "scaled" and i % 2:
      y = y * 2
    if mode == "shifted":  # a constant made on the input's device and one on the CPU
      y = y + torch.tensor(float(i), device=y.device)
      y = y - torch.tensor(i / 2)
    if mode == "marks_cache":
      cache.last_layer = i == len(cache.layers) - 1
    if mode == "lazy":
      if self.mask is None:
        self.mask = torch.ones_like(y)
      y = y * self.mask
    return x + y


class CacheStack(torch.nn.Module):
  def __init__(self, layers=4, mode=None):
    super().__init__()
    self.layers = torch.nn.ModuleList(CacheLayer(i, mode) for i in range(layers))

  def forward(self, x):
    cache = transformers.DynamicCache(
        config=transformers.LlamaConfig(num_hidden_layers=len(self.layers)))
    for layer in self.layers:
      x = layer(x, cache)
    return x, cache


def _cache_stack_against_eager(mode=None, passes=2):
  """Outputs, gradients, every cache slot and the cache's attribute equal eager's over `passes`
  calls; no module keeps a meta tensor; the traces."""
  torch.manual_seed(0)
  eager = CacheStack(mode=mode)
  moved = copy.deepcopy(eager).to("xla")
  jb.bridge_modules(moved, ["CacheLayer"])
  jb.clear_cache()
  x = torch.randn(2, 8, requires_grad=True)
  for _ in range(passes):
    for m in (eager, moved):
      m.zero_grad()
    (out, cache), grads = _forward_and_grads_of_first(moved, x.to("xla"))
    torch_xla.sync()
    (expected, expected_cache), expected_grads = _forward_and_grads_of_first(eager, x)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected_grads):
      torch.testing.assert_close(g.cpu(), e, rtol=1e-4, atol=1e-5)
    assert len(cache.layers) == len(expected_cache.layers)
    for mine, theirs in zip(cache.layers, expected_cache.layers):
      assert mine.keys.device.type == "xla" and mine.is_initialized
      torch.testing.assert_close(mine.keys.detach().cpu(), theirs.keys.detach())
      torch.testing.assert_close(mine.values.detach().cpu(), theirs.values.detach())
    assert getattr(cache, "last_layer", None) == getattr(expected_cache, "last_layer", None)
    assert all(layer.mask is None or layer.mask.device.type == "xla" for layer in moved.layers)
  return jb.cache_info().misses


def _forward_and_grads_of_first(model, x):
  out = model(x)
  out[0].square().sum().backward()
  return out, [p.grad for p in model.parameters()]


def test_layers_writing_their_own_cache_slot_share_one_trace():
  assert _cache_stack_against_eager() == 2  # four layers, two passes: one trace each way


def test_layers_whose_index_changes_an_op_share_only_with_alike_layers():
  # odd layers double their output: layers 0 and 2 share one trace, 1 and 3 another
  assert _cache_stack_against_eager("scaled") == 4


def test_layers_whose_index_makes_a_constant_keep_their_own_traces():
  assert _cache_stack_against_eager("shifted") == 8


def test_a_layer_reading_another_layers_slot_is_passed_the_whole_cache():
  # each layer after the first reads the slot before its own: traced with the whole cache, each
  # layer its own trace each way (as before slots were shared)
  assert _cache_stack_against_eager("reads_other") == 8


def test_a_layer_catching_the_error_of_another_slot_is_passed_the_whole_cache():
  assert _cache_stack_against_eager("catches") == 8  # layer 0 reads no other slot: its own


@pytest.mark.parametrize("mode", ["function", "grad_branch"])
def test_layers_differing_only_in_their_backward_or_by_grad_keep_their_own_traces(mode):
  # a Function's backward records no op, but what its forward keeps on ctx is compared (each
  # layer keeps its whole-cache trace); a branch on requires_grad is taken in the fingerprint
  # as in the trace (the scale is an op's argument)
  assert _cache_stack_against_eager(mode) == 8


def test_layers_through_the_same_function_with_the_same_ctx_share_one_trace():
  # (BLOOM's GeLUFunction in training: its layers had kept a trace each)
  assert _cache_stack_against_eager("function_alike") == 2


def test_a_layer_setting_a_cache_attribute_writes_back_its_own_value():
  # layer 3 marks the cache as its last (its own trace); layers 1 and 2 see the mark layer 0 set
  assert _cache_stack_against_eager("marks_cache") == 6


def test_the_fingerprint_leaves_no_attribute_behind():
  # the lazily made tensor is kept outside the trace: the layers fall back, with eager's values
  _cache_stack_against_eager("lazy")
  report = jb.bridge_report()
  assert [report.row(f"layers.{i}").status for i in range(4)] == ["fallback"] * 4


class WindowLayer(torch.nn.Module):
  """Keeps its slot's last `layer_idx + 1` entries: a window its index decides, read only once
  the slot is longer."""

  def __init__(self, layer_idx):
    super().__init__()
    self.proj = torch.nn.Linear(8, 8)
    self.layer_idx = layer_idx

  def forward(self, x, cache):
    k = self.proj(x)[:, None]
    keys, _ = cache.update(k, k, self.layer_idx)
    if keys.shape[1] > self.layer_idx + 1:
      keys = keys[:, -(self.layer_idx + 1):]
    return x + torch.tanh(keys.sum(1))


def test_a_growing_slot_is_fingerprinted_again_at_each_length():
  torch.manual_seed(0)
  eager = torch.nn.ModuleList(WindowLayer(i) for i in range(3))
  moved = copy.deepcopy(eager).to("xla")
  jb.bridge_modules(moved, ["WindowLayer"])
  caches = [transformers.DynamicCache(config=transformers.LlamaConfig(num_hidden_layers=3))
            for _ in range(2)]
  with torch.no_grad():
    for _ in range(3):  # slot lengths 1, 2, 3: the windows start cutting one layer at a time
      x = torch.randn(2, 8)
      outs = []
      for layers, cache, device in ((eager, caches[0], "cpu"), (moved, caches[1], "xla")):
        h = x.to(device)
        for layer in layers:
          h = layer(h, cache)
        outs.append(h.cpu())
      torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
