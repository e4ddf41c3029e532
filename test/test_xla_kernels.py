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
  monkeypatch.setattr(module, "gmm", functools.partial(module.gmm, interpret=True))


def test_torch_xla_gmm_in_bridged_code(dev, interpreted_megablox):
  inputs, expected = grouped_inputs()
  out = jb.bridge(torch_xla_gmm)(*[t.to(dev) for t in inputs])
  assert user_nodes(out) == ["torch_xla_gmm_fwd"]
  torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_torch_xla_gmm_lowers_to_one_tpu_kernel():
  inputs, _ = grouped_inputs()
  forward, _ = jb.lower_bridged(torch_xla_gmm, *inputs, platform="tpu")
  assert forward.count("tpu_custom_call") == 1
