"""The Pallas flash-attention kernel (interpret mode on CPU): values and gradients against plain
attention and torch's SDPA, no sequence x sequence buffer, and the recipe's `model.attention`."""
import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch_xla

import torch_xla_jaxbridge as jb

from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._interop.flash_attention import flash_attention, sdpa
from torch_xla_jaxbridge.recipes import config, llama


def reference(q, k, v, causal):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k, causal", [
    (32, 32, 8, 16, True), (32, 32, 16, 8, True), (16, 32, 8, 8, False), (32, 16, 8, 8, True)])
def test_values_and_gradients_match_plain_attention(q_len, kv_len, block_q, block_k, causal):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 3, q_len, 8))
  k, v = (jax.random.normal(key, (2, 3, kv_len, 8)) for key in keys[1:3])
  weights = jax.random.normal(keys[3], q.shape)
  flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, block_q=block_q,  # noqa: E731
                                          block_k=block_k)
  np.testing.assert_allclose(flash(q, k, v), reference(q, k, v, causal), atol=2e-6)
  grads = jax.grad(lambda *a: (flash(*a) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
  expected = jax.grad(lambda *a: (reference(*a, causal) * weights).sum(), argnums=(0, 1, 2))(
      q, k, v)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=5e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_the_sdpa_override_matches_eager_cpu_torch(dev, causal):
  torch.manual_seed(0)
  q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
  attend = jb.bridge(
      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
  k, v = k[:, :2], v[:, :2]  # grouped key/value heads: sdpa repeats them
  cpu = [t.clone().requires_grad_() for t in (q, k, v)]
  xla = [t.to(dev).requires_grad_() for t in (q, k, v)]
  F.scaled_dot_product_attention(*cpu, is_causal=causal, enable_gqa=True).pow(2).sum().backward()
  with jb.override_ops({F.scaled_dot_product_attention: sdpa}):
    out = attend(*xla)
  out.pow(2).sum().backward()
  expected = F.scaled_dot_product_attention(*cpu, is_causal=causal, enable_gqa=True)
  torch.testing.assert_close(out.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
  for got, want in zip(xla, cpu):
    torch.testing.assert_close(got.grad.cpu(), want.grad, atol=1e-5, rtol=1e-5)


def test_bad_shapes_blocks_and_masks_are_refused():
  q = jnp.ones((1, 2, 12, 4))
  with pytest.raises(jb.errors.BadArgumentError, match="q_len 12 is not a multiple of its block "
                                                       "size 8"):
    flash_attention(q, q, q, block_q=8)
  with pytest.raises(jb.errors.BadArgumentError, match="with the same batch, heads and head_dim; "
                                                       r"got q \(1, 2, 12, 4\), k \(1, 1, 12, 4\)"):
    flash_attention(q, q[:, :1], q[:, :1])
  with pytest.raises(jb.errors.BadArgumentError, match="causal or unmasked attention only; this "
                                                       "call passed attn_mask"):
    sdpa(q, q, q, attn_mask=jnp.ones((12, 12), bool))


def small_llama(attention):
  torch.manual_seed(0)
  return llama.Llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64,
                     attention=attention)


def wrap(model, mode, dev):
  model = model.to(dev)
  if mode == "layers":
    model.layers = torch.nn.ModuleList(jb.BridgeModule(layer) for layer in model.layers)
  elif mode == "scan":
    model.use_scan, model.scan_remat = True, "full"
  else:
    model.layers = jb.StackedLayers(model.layers, remat="minimal")
  return model


def step(model, tokens):
  loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
  loss.backward()
  return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["layers", "scan", pytest.param("stack", marks=pytest.mark.slow)])
def test_recipe_llama_with_flash_matches_the_reference(dev, mode):
  # 256 positions: two 128-position blocks per sequence in the kernel
  tokens = torch.randint(0, 64, (1, 257), generator=torch.Generator().manual_seed(0))
  base = small_llama("reference")
  flash = copy.deepcopy(base)
  flash.attention = "flash"
  loss, grads = step(wrap(base, mode, dev), tokens.to(dev))
  flash_loss, flash_grads = step(wrap(flash, mode, dev), tokens.to(dev))
  torch_xla.sync()  # one program for both steps (each .cpu() below would otherwise compile one)
  eager_loss, _ = step(small_llama("reference"), tokens)
  torch.testing.assert_close(flash_loss.cpu(), loss.cpu(), atol=1e-5, rtol=1e-5)
  torch.testing.assert_close(flash_loss.cpu(), eager_loss.detach(), atol=1e-5, rtol=1e-5)
  assert grads.keys() == flash_grads.keys()
  for name in grads:
    torch.testing.assert_close(flash_grads[name].cpu(), grads[name].cpu(), atol=1e-5,
                               rtol=1e-4, msg=name)


@pytest.mark.parametrize("mode", ["layers", "scan", "stack"])
def test_the_flash_step_has_no_sequence_by_sequence_buffer(dev, mode):
  seq = 256
  tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(0)).to(dev)
  square = re.compile(rf"\[(\d+,)*{seq},{seq}\]")  # any array whose last two sizes are seq, seq
  texts = {}
  for attention in ("reference", "flash"):
    model = wrap(small_llama(attention), mode, dev)
    loss, grads = step(model, tokens)
    texts[attention] = torch_xla_private.tensors_hlo_text([loss, *grads.values()])
    model.zero_grad(set_to_none=True)  # only lowered: nothing left for the teardown's sync to run
  assert square.search(texts["reference"]), "the reference step should hold the score matrix"
  assert not square.search(texts["flash"])
  assert "f32[128,128]" in texts["flash"]  # the kernel's score tile


def test_attention_config_key():
  assert config.load()["model"]["attention"] == "reference"
  assert config.load(["model.attention=flash"])["model"]["attention"] == "flash"
  with pytest.raises(config.ConfigError, match="model.attention: 'splash' is not valid; choose "
                                               "one of reference, flash"):
    config.load(["model.attention=splash"])
  with pytest.raises(config.ConfigError, match="remat.bridge=none runs plain LazyTensor layers, "
                                               "which would keep the reference attention"):
    config.load(["model.attention=flash", "remat.bridge=none"])


@pytest.mark.slow  # 40-90 s (make slow)
def test_the_recipe_trains_with_flash_as_with_the_reference(recipe_run):
  flash, _ = recipe_run("model.attention=flash")
  reference, _ = recipe_run()
  assert len(flash) == 3
  np.testing.assert_allclose(flash, reference, rtol=1e-5)
