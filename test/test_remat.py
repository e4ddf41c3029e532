"""Remat policies, host offload and the residual report, on the Llama-style decoder layer."""
import pathlib
import re
import warnings

import jax
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
import torch_xla
from torch.utils.checkpoint import checkpoint

import models
import torch_xla_jaxbridge as jb
from parity import check_module
from torch_xla_jaxbridge._bridge import remat

PROJECTIONS = {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi"}


def decoder_call():
  return models.DecoderLayer(), torch.randn(2, 8, 32, requires_grad=True), torch.arange(8)


def is_input(row):
  return row.name.startswith("argument ") or row.name in ("constant", "decoder_layer_input")


def test_residual_bytes_strictly_decrease():
  layer, x, pos = decoder_call()
  sizes = [jb.saved_residuals(layer, x, pos, remat=r).total_bytes
           for r in (None, "dots", "minimal", "full")]
  assert sizes[0] > sizes[1] > sizes[2] > sizes[3], sizes


def test_full_keeps_only_the_inputs():
  layer, x, pos = decoder_call()
  report = jb.saved_residuals(layer, x, pos, remat="full")
  assert all(is_input(row) for row in report.rows), str(report)
  assert "argument param attn.q_proj.weight" in report.names()
  with_names = jb.saved_residuals(layer, x, pos, remat=jb.Remat(save=("mlpwi",)))
  assert {r.name for r in with_names.rows if r.name in models.CHECKPOINT_NAMES} == {
      "mlpwi", "decoder_layer_input"}


def test_minimal_keeps_the_named_projections():
  layer, x, pos = decoder_call()
  report = jb.saved_residuals(layer, x, pos, remat="minimal")
  assert {r.name for r in report.rows if r.name in models.CHECKPOINT_NAMES} == (
      PROJECTIONS | {"decoder_layer_input"})
  assert report.host_bytes == 0


def test_offloaded_names_are_host_rows():
  layer, x, pos = decoder_call()
  report = jb.saved_residuals(layer, x, pos, remat="minimal_offloaded")
  host = [r for r in report.rows if r.where == "host"]
  assert {r.name for r in host} == PROJECTIONS
  assert report.host_bytes == sum(r.bytes for r in host) > 0
  assert "where" in str(report) and "host" in str(report)


@pytest.mark.parametrize("policy", [None, *jb.remat.presets(),
                                    jb.Remat(save=("mlpwi",), policy="dots"),
                                    jax.checkpoint_policies.everything_saveable])
def test_gradients_match_eager_for_every_policy(dev, policy):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the CPU offload warning has its own test
    check_module(models.DecoderLayer(), torch.randn(2, 8, 32), torch.arange(8), dev=dev,
                 remat=policy)


def test_assume_pure_takes_remat(dev):
  def block(x, w):
    return torch.tanh(jb.checkpoint_name(x @ w, "mlpwi")).sum()

  w = torch.randn(4, 4)
  saved = jb.saved_residuals(jb.assume_pure(block, remat="full"), torch.ones(2, 4),
                             w.requires_grad_())
  kept = jb.saved_residuals(jb.assume_pure(block), torch.ones(2, 4), w)
  assert all(r.name.startswith("argument") for r in saved.rows)
  assert not all(r.name.startswith("argument") for r in kept.rows)
  wx = w.detach().to(dev).requires_grad_()
  jb.assume_pure(block, remat="full")(torch.ones(2, 4, device=dev), wx).backward()
  wr = w.detach().clone().requires_grad_()
  block(torch.ones(2, 4), wr).backward()
  torch.testing.assert_close(wx.grad.cpu(), wr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_offload_lowering_places_residuals_on_host_and_back(platform):
  layer, x, pos = decoder_call()
  forward, backward = jb.lower_bridged(layer, x, pos, platform=platform,
                                       remat="minimal_offloaded")
  offloaded = len([r for r in jb.saved_residuals(layer, x, pos, remat="minimal_offloaded").rows
                   if r.where == "host"])
  assert forward.count('_xla_buffer_placement = "pinned_host"') == offloaded == 6
  assert backward.count('_xla_buffer_placement = "device"') == offloaded
  kept, _ = jb.lower_bridged(layer, x, pos, platform=platform, remat="minimal")
  assert "_xla_buffer_placement" not in kept


def test_offload_on_cpu_warns_once(dev):
  remat.warn_offload_dropped.cache_clear()
  layer = jb.BridgeModule(torch.nn.Linear(4, 4).to(dev), remat="minimal_offloaded")
  with pytest.warns(UserWarning, match="JAX drops host-memory placement on 'cpu'"):
    layer(torch.ones(2, 4, device=dev)).sum().backward()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layer(torch.ones(2, 4, device=dev)).sum().backward()


def test_bad_remat_values_list_the_choices():
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"remat: unknown preset 'minimum'; choose one of "
                     + re.escape(", ".join(jb.remat.presets()))):
    jb.bridge(lambda x: x, remat="minimum")
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"\['mlpwi'\] are in both `save` and `offload`"):
    jb.Remat(save=("mlpwi", "query_proj"), offload=("mlpwi",))
  with pytest.raises(jb.errors.BadArgumentError, match="remat: expected None"):
    jb.BridgeModule(torch.nn.Linear(2, 2), remat=3)


def test_a_registered_preset_is_one_entry_everywhere(dev):
  """One `register_preset` call: `remat=` takes the name, the recipe's config accepts it, the
  error lists name it."""
  from torch_xla_jaxbridge.recipes import config

  jb.remat.register_preset("dots_saveable_test", lambda: jax.checkpoint_policies.dots_saveable,
                           "every matmul output (for this test)")
  try:
    check_module(models.DecoderLayer(), torch.randn(2, 8, 32), torch.arange(8), dev=dev,
                 remat="dots_saveable_test")
    assert config.load(["remat.policy=dots_saveable_test"])["remat"]["policy"] == (
        "dots_saveable_test")
    with pytest.raises(jb.errors.BadArgumentError, match="dots_saveable_test"):
      jb.bridge(lambda x: x, remat="minimum")
  finally:
    del remat._PRESETS["dots_saveable_test"]


def test_the_docs_table_lists_every_preset():
  text = (pathlib.Path(__file__).parents[1] / "docs" / "remat.md").read_text()
  documented = re.findall(r'^\| `"(\w+)"` \|', text, re.M)
  assert documented == list(jb.remat.presets())


def test_checkpoint_name_is_the_identity_outside_bridged_code(dev):
  for t in (torch.ones(3), torch.ones(3, device=dev)):
    assert jb.checkpoint_name(t, "query_proj") is t
  with pytest.raises(jb.errors.BadArgumentError, match="name: expected a non-empty string"):
    jb.checkpoint_name(torch.ones(1), "")


class CheckpointedBlock(torch.nn.Module):
  """Uses torch's activation checkpointing, imported both ways model code does."""

  def __init__(self):
    super().__init__()
    self.a, self.b = models.SwiGLU(16, 64), models.SwiGLU(16, 64)

  def forward(self, x):
    x = checkpoint(self.a, x, use_reentrant=False)
    return torch_checkpoint.checkpoint(self.b, x, use_reentrant=False)


def test_torch_utils_checkpoint_recomputes_inside_bridged_code(dev):
  block, x = CheckpointedBlock(), torch.randn(4, 16, requires_grad=True)
  plain = models.SwiGLU(16, 64)
  recomputed = jb.saved_residuals(block, x).total_bytes
  stored = 2 * jb.saved_residuals(plain, x).total_bytes
  assert recomputed < stored
  check_module(CheckpointedBlock(), torch.randn(4, 16), dev=dev)
  with torch.no_grad():  # outside bridged code torch's own checkpoint still runs
    block(x)


@pytest.mark.parametrize("first", [float("nan"), float("inf"), -2.0, 0.0])
def test_a_policys_backward_takes_every_cotangent(dev, first):
  # the backward of a call with a policy runs in a conditional on the first cotangent value: it
  # must be taken for NaN, infinities, negatives and zero alike (elementwise: no sums of inf)
  w = torch.rand(3, 4) + 0.5
  wave = jb.bridge(lambda x, w: torch.sin(x) * w, remat="full")
  grad_out = torch.randn(3, 4)
  grad_out[0, 0] = first
  x = torch.rand(3, 4, requires_grad=True)
  (torch.sin(x) * w).backward(grad_out)
  xx = x.detach().to(dev).requires_grad_()
  wave(xx, w.to(dev)).backward(grad_out.to(dev))
  torch.testing.assert_close(xx.grad.cpu(), x.grad, equal_nan=True)


class DropoutBlock(torch.nn.Module):
  """Reads an int64 argument its backward does not keep: its forward is traced in 64-bit mode."""

  def __init__(self):
    super().__init__()
    self.linear, self.dropout = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)

  def forward(self, x, positions):
    return self.dropout(self.linear(x)) + 0.5


def test_a_policys_backward_node_is_lowered_in_its_forwards_64_bit_mode(dev):
  # the recomputed dropout's random bits and constants were 64-bit in the forward; the backward
  # node, whose inputs are all float32, lowered them in 32-bit mode and failed in MLIR
  results = []
  for policy in (None, "full"):
    torch.manual_seed(0)
    block = jb.BridgeModule(DropoutBlock().to(dev), remat=policy, fallback=False)
    x = torch.linspace(-1, 1, 32).reshape(4, 8).to(dev)
    torch_xla.manual_seed(5)
    block(x, torch.arange(4, device=dev)).square().sum().backward()
    results.append([p.grad.cpu() for p in block.parameters()])
  for got, want in zip(*results):
    torch.testing.assert_close(got, want)
