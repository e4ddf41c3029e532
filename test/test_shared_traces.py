"""Modules of one structure share their traces when they differ only in plain values (numbers,
strings) their forward never reads (`_bridge.auto.SharedForward`, `_core.settings_key`):
Hugging Face decoder layers differ in `self_attn.layer_idx`, read only with a cache. Values and
gradients against eager CPU torch; traces by the lowering cache's counters."""
import copy

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


@pytest.mark.parametrize("use_cache, traces", [(False, 2), (True, 8)])
def test_hugging_face_layers_share_a_trace_unless_a_cache_reads_their_index(use_cache, traces):
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
    for model, optimizer, inputs in zip((eager, moved), optimizers, (ids, ids.to("xla"))):
      loss = model(input_ids=inputs, labels=inputs).loss
      loss.backward()
      optimizer.step()
      optimizer.zero_grad()
      torch_xla.sync()
  assert jb.cache_info().misses == traces  # four layers: one trace each way, or one per layer
  for p, q in zip(eager.parameters(), moved.parameters()):
    torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=2e-5)
