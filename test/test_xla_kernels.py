"""torch_xla's own JAX entry point (`torch_xla.core.xla_builder.call_jax`, which its Pallas kernels
use) inside bridged code: the JAX function runs inline in the trace, as `jb.call_jax` does.

On CPU the kernels run in Pallas interpret mode; torch_xla's `custom_kernel.gmm` itself never
asks for interpret mode (it is a TPU kernel: on CPU it fails with "Only interpret mode is
supported on CPU backend"), so its test turns interpret mode on in JAX's megablox module, and a
second test lowers it for TPU without running it.
"""
import copy
import functools
import importlib

import pytest
import torch
import torch_xla
import torch_xla.core.xla_builder as xb

import torch_xla_jaxbridge as jb
from kernels import rms_norm
from test_composition import user_nodes
from torch_xla_jaxbridge.recipes.llama import RMSNorm


class XbNorm(torch.nn.Module):
  """RMSNorm by the Pallas kernel, called the way torch_xla's kernels call JAX."""

  def __init__(self, dim):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

  def forward(self, x):
    return xb.call_jax(rms_norm, (torch.tanh(x), self.weight)) * 2


def test_xb_call_jax_in_a_bridge_module_runs_inline(dev):
  cpu = XbNorm(16)
  reference = RMSNorm(16)
  reference.weight = copy.deepcopy(cpu.weight)
  x = torch.randn(6, 16, requires_grad=True)
  expected = reference(torch.tanh(x)) * 2
  expected.pow(2).sum().backward()

  model = copy.deepcopy(cpu).to(dev)
  xx = x.detach().to(dev).requires_grad_(True)
  out = jb.BridgeModule(model)(xx)
  assert user_nodes(out) == ["XbNorm_fwd"]  # one node: the kernel is inside it
  out.pow(2).sum().backward()
  torch_xla.sync()
  torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(xx.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(model.weight.grad.cpu(), reference.weight.grad, rtol=1e-5,
                             atol=1e-5)


def test_xb_call_jax_is_torch_xla_own_outside_bridged_code(dev):
  original = xb.call_jax
  jb.bridge(lambda t: xb.call_jax(lambda a: a * 3, (t,)))(torch.ones(2, device=dev))
  assert xb.call_jax is original and original.__module__ == "torch_xla.core.xla_builder"
  torch.testing.assert_close(xb.call_jax(lambda a: a + 1, (torch.ones(2, device=dev),)).cpu(),
                             torch.full((2,), 2.0))


def test_the_name_splash_attention_imported_is_hooked_too(dev):
  splash = importlib.import_module("torch_xla.experimental.splash_attention")
  seen = []

  @jb.bridge
  def f(t):
    seen.append(splash.call_jax is xb.call_jax and splash.call_jax.__module__)
    return splash.call_jax(lambda a: a * 2, (t,))

  torch.testing.assert_close(f(torch.ones(2, device=dev)).cpu(), torch.full((2,), 2.0))
  assert seen == ["torch_xla_jaxbridge._integrations.torch_xla_kernels"]
  assert splash.call_jax.__module__ == "torch_xla.core.xla_builder"  # restored


def grouped_inputs():
  torch.manual_seed(0)
  lhs, rhs = torch.randn(256, 128), torch.randn(2, 128, 128)
  sizes = torch.tensor([100, 156], dtype=torch.int32)
  expected = torch.cat([lhs[:100] @ rhs[0], lhs[100:] @ rhs[1]])
  return (lhs, rhs, sizes), expected


def torch_xla_gmm(lhs, rhs, sizes):
  from torch_xla.experimental import custom_kernel

  return custom_kernel.gmm(lhs, rhs, sizes, (128, 128, 128))


@pytest.fixture
def interpreted_megablox(monkeypatch):
  """JAX's megablox kernels (what torch_xla's gmm calls) in interpret mode, for this test."""
  # the package's __init__ exports a function named gmm, hiding the module of that name
  module = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  for name in ("gmm", "tgmm"):
    monkeypatch.setattr(module, name, functools.partial(getattr(module, name), interpret=True))


def test_torch_xla_gmm_in_bridged_code(dev, interpreted_megablox):
  inputs, expected = grouped_inputs()
  out = jb.bridge(torch_xla_gmm)(*[t.to(dev) for t in inputs])
  assert user_nodes(out) == ["torch_xla_gmm_fwd"]
  torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_torch_xla_gmm_lowers_to_one_tpu_kernel():
  inputs, _ = grouped_inputs()
  forward, _ = jb.lower_bridged(torch_xla_gmm, *inputs, platform="tpu")
  assert forward.count("tpu_custom_call") == 1


def torch_xla_gmm_with_gradients(lhs, rhs, sizes):
  from torch_xla.experimental import custom_kernel

  return custom_kernel.GMM.apply(torch.tanh(lhs), rhs, sizes, (128, 128, 128)).pow(2).sum()


def test_torch_xla_gmm_autograd_function_matches_lazytensor(dev, interpreted_megablox):
  (lhs, rhs, sizes), _ = grouped_inputs()
  results = {}
  for mode in ("LazyTensor", "bridged"):
    inputs = [lhs.to(dev).requires_grad_(), rhs.to(dev).requires_grad_(), sizes.to(dev)]
    fn = jb.bridge(torch_xla_gmm_with_gradients, fallback=False) if mode == "bridged" else (
        torch_xla_gmm_with_gradients)
    loss = fn(*inputs)
    loss.backward()  # GMM's own backward: torch_xla's gmm and tgmm kernels
    results[mode] = [loss.cpu()] + [t.grad.cpu() for t in inputs[:2]]
  for got, want in zip(results["bridged"], results["LazyTensor"]):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
  eager = [lhs.clone().requires_grad_(), rhs.clone().requires_grad_()]
  h = torch.tanh(eager[0])
  torch.cat([h[:100] @ eager[1][0], h[100:] @ eager[1][1]]).pow(2).sum().backward()
  torch.testing.assert_close(results["bridged"][1], eager[0].grad, rtol=1e-4, atol=1e-2)
  torch.testing.assert_close(results["bridged"][2], eager[1].grad, rtol=1e-4, atol=1e-2)


def test_torch_xla_gmm_trains_in_a_train_step_as_in_lazytensor(dev, interpreted_megablox):
  (lhs, rhs, sizes), _ = grouped_inputs()
  results = {}
  for run in ("LazyTensor", "train_step"):
    experts = torch.nn.Parameter(rhs.clone().to(dev))
    optimizer = jb.optim.SGD([experts], lr=1e-4)
    tokens, groups = lhs.to(dev), sizes.to(dev)
    loss_fn = lambda t, g: torch_xla_gmm_with_gradients(t, experts, g)  # noqa: E731
    if run == "train_step":
      loss = jb.train_step(loss_fn, optimizer, fallback=False)(tokens, groups)
    else:
      loss = loss_fn(tokens, groups)
      loss.backward()  # GMM's own backward: torch_xla's gmm and tgmm kernels
      optimizer.step()
    torch_xla.sync()
    results[run] = [loss.cpu(), experts.detach().cpu()]
  for got, want in zip(results["train_step"], results["LazyTensor"]):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
  assert not torch.equal(results["train_step"][1], rhs)  # the step moved the experts


def torch_xla_tgmm(lhs, rhs, sizes):
  from torch_xla.experimental import custom_kernel

  return custom_kernel.tgmm(lhs.t(), rhs, sizes, (128, 128, 128))


def test_torch_xla_tgmm_in_bridged_code(dev, interpreted_megablox):
  (lhs, _, sizes), _ = grouped_inputs()
  grad = torch.randn(256, 128)
  out = jb.bridge(torch_xla_tgmm, fallback=False)(lhs.to(dev), grad.to(dev), sizes.to(dev))
  expected = torch.stack([lhs[:100].t() @ grad[:100], lhs[100:].t() @ grad[100:]])
  torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-3)


@pytest.fixture
def interpreted_splash(monkeypatch):
  """JAX's splash attention kernel (what torch_xla's splash_attention calls) in interpret mode."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

  monkeypatch.setattr(splash_attention_kernel, "make_splash_mha",
                      functools.partial(splash_attention_kernel.make_splash_mha, interpret=True))


class SplashBlock(torch.nn.Module):
  """Self-attention through torch_xla's splash_attention (its custom ops and autograd Function)."""

  def __init__(self):
    super().__init__()
    self.qkv, self.out = torch.nn.Linear(64, 3 * 64), torch.nn.Linear(64, 64)

  def forward(self, x):
    import numpy as np
    from torch_xla.distributed.spmd import Mesh
    from torch_xla.experimental.splash_attention import SplashAttentionConfig, splash_attention

    mesh = Mesh(np.arange(1), (1, 1, 1), ("data", "fsdp", "model"))
    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=("data", None, None, None),
                                   segment_ids_partition_spec=("data", None)).to_json()
    batch, seq, _ = x.shape
    q, k, v = self.qkv(x).view(batch, seq, 3, 1, 64).permute(2, 0, 3, 1, 4)
    attended = splash_attention(q, k, v, config, None, True)
    return self.out(attended.permute(0, 2, 1, 3).reshape(batch, seq, 64))


@pytest.mark.parametrize("mode", ["BridgeModule", "train_step"])
def test_torch_xla_splash_attention_trains_as_in_lazytensor(dev, interpreted_splash, mode):
  torch.manual_seed(0)
  initial, x = SplashBlock().state_dict(), torch.randn(2, 128, 64)
  results = {}
  for run in ("LazyTensor", mode):
    model = SplashBlock()
    model.load_state_dict(initial)
    model = model.to(dev)
    optimizer = jb.optim.SGD(model.parameters(), lr=0.1)
    if run == "train_step":
      loss = jb.train_step(lambda b: model(b).pow(2).mean(), optimizer, fallback=False)(
          x.to(dev))
    else:
      run_model = jb.BridgeModule(model, fallback=False) if run == "BridgeModule" else model
      loss = run_model(x.to(dev)).pow(2).mean()
      loss.backward()
      optimizer.step()
    torch_xla.sync()
    results[run] = [loss.cpu()] + [p.detach().cpu() for p in model.parameters()]
  for got, want in zip(results[mode], results["LazyTensor"]):
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_torch_xla_flash_attention_fails_here_as_in_lazytensor(dev):
  from torch_xla.experimental import custom_kernel

  q = torch.randn(1, 1, 128, 64, device=dev)
  with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
    custom_kernel.flash_attention(q, q, q)  # a TPU custom call: LazyTensor cannot run it here
  with pytest.warns(jb.errors.FallbackWarning, match="flash_attention"):
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
      jb.bridge(custom_kernel.flash_attention)(q, q, q)  # falls back: the same error, no worse


def test_torch_xla_quantized_matmul_int8_matches_lazytensor(dev):
  from torch_xla.experimental import custom_kernel

  torch.manual_seed(0)
  x, scale = torch.randn(8, 32), torch.rand(16)
  w = torch.randint(-128, 127, (16, 32), dtype=torch.int8)
  fn = lambda *t: custom_kernel.quantized_matmul_int8(*t)  # noqa: E731
  inputs = [t.to(dev) for t in (x, w, scale)]
  lazy = fn(*inputs).cpu()
  bridged = jb.bridge(fn, fallback=False)(*inputs).cpu()
  torch.testing.assert_close(bridged, lazy, rtol=0, atol=0)
  # XLA:CPU's float32 matmul sums in its own order: a few ulps from eager's
  torch.testing.assert_close(lazy, (x @ w.float().t()) * scale, rtol=1e-5, atol=1e-5)


def _ragged_inputs():
  """Two sequences (3 and 2 new tokens, 5 and 7 tokens of cache) over 4-token pages; 4 query
  heads over 2 kv heads (k and v interleaved in the pages)."""
  torch.manual_seed(0)
  q = torch.randn(6, 4, 8)
  kv_pages = torch.randn(5, 4, 4, 8)
  kv_lens = torch.tensor([5, 7, 0], dtype=torch.int32)
  page_indices = torch.tensor([[0, 1], [2, 3], [4, 4]], dtype=torch.int32)
  cu_q_lens = torch.tensor([0, 3, 5, 5], dtype=torch.int32)
  num_seqs = torch.tensor([2], dtype=torch.int32)
  return q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs


@pytest.mark.parametrize("use_kernel", [False, True])
def test_torch_xla_ragged_paged_attention_runs_as_in_lazytensor(dev, use_kernel):
  from torch_xla.experimental import custom_kernel

  def attention(*inputs):  # a loop over the sequences, read from the tensors (data-dependent)
    return custom_kernel.ragged_paged_attention(*inputs, sm_scale=0.5, use_kernel=use_kernel)

  inputs = [t.to(dev) for t in _ragged_inputs()]
  if use_kernel:  # a TPU kernel: LazyTensor cannot run it here, nor can the bridge
    with pytest.raises(NotImplementedError, match="TPU version must be 4 or higher"):
      attention(*inputs).cpu()
    with pytest.warns(jb.errors.FallbackWarning, match="ragged_paged_attention"):
      with pytest.raises(NotImplementedError, match="TPU version must be 4 or higher"):
        jb.bridge(attention)(*inputs).cpu()
    return
  lazy = attention(*inputs).cpu()
  with pytest.warns(jb.errors.FallbackWarning, match="attention"):  # reads ints from tensors
    bridged = jb.bridge(attention)(*inputs).cpu()
  torch.testing.assert_close(bridged, lazy, rtol=0, atol=0)
  eager = custom_kernel._ragged_paged_attention_nonkernel(*_ragged_inputs(), None, None,
                                                          sm_scale=0.5)
  torch.testing.assert_close(lazy, eager, rtol=1e-5, atol=1e-5)


def test_torch_xla_multi_queries_paged_attention_torch_path_runs_as_in_lazytensor(dev):
  from torch_xla.experimental import custom_kernel

  torch.manual_seed(0)
  q = torch.randn(2, 3, 4, 8)  # batch 2, 3 queries, 4 query heads over 2 kv heads
  k_pages, v_pages = torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4, 8)
  lengths = torch.tensor([5, 7], dtype=torch.int32)
  page_indices = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
  q_lens = torch.tensor([3, 2], dtype=torch.int32)

  def attention(*inputs):  # reads the lengths on the host (`.cpu()`): data-dependent
    return custom_kernel.multi_queries_paged_attention(*inputs, 2, 2, use_kernel=False)

  inputs = [t.to(dev) for t in (q, k_pages, v_pages, lengths, page_indices, q_lens)]
  lazy = attention(*inputs).cpu()
  with pytest.warns(jb.errors.FallbackWarning, match="attention"):
    bridged = jb.bridge(attention)(*inputs).cpu()
  torch.testing.assert_close(bridged, lazy, rtol=0, atol=0)
  eager = attention(q, k_pages, v_pages, lengths, page_indices, q_lens)
  torch.testing.assert_close(lazy, eager, rtol=1e-5, atol=1e-5)
