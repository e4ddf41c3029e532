"""Batch norm in bridged code: torch's outputs, gradients and running statistics (train and eval,
with and without affine parameters or running statistics, bfloat16), and the closed-form
backward's two reductions over the activation each way."""
import copy
import re

import pytest
import torch

import torch_xla_jaxbridge as jb
from parity import check_module


@pytest.mark.parametrize("make, shape", [
    (lambda: torch.nn.BatchNorm2d(3), (4, 3, 5, 5)),
    (lambda: torch.nn.BatchNorm1d(4, affine=False), (6, 4)),
    (lambda: torch.nn.BatchNorm1d(4, momentum=0.3), (6, 4, 3)),
    (lambda: torch.nn.BatchNorm2d(3, track_running_stats=False), (2, 3, 4, 4)),
], ids=["2d", "no_affine", "1d_over_length", "no_running_stats"])
def test_training_matches_eager_with_the_running_statistics(dev, make, shape):
  torch.manual_seed(0)
  model = make()
  with torch.no_grad():  # parameters away from their initial ones and zeros
    for p in model.parameters():
      p.uniform_(0.5, 1.5)
  x = torch.randn(*shape) * 3 + 1
  bridged, ref = check_module(model, x, dev=dev, tol=1e-5)
  for (name, a), b in zip(bridged.named_buffers(), ref.buffers()):
    torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=name)
  if model.track_running_stats:  # and in eval mode from those statistics
    torch.testing.assert_close(bridged.eval()(x.to(dev)).cpu(), ref.eval()(x), rtol=1e-5,
                               atol=1e-5)


def test_bfloat16_keeps_its_dtype_with_float32_statistics(dev):
  torch.manual_seed(0)
  model = torch.nn.BatchNorm2d(3).to(torch.bfloat16)
  x = (torch.randn(4, 3, 5, 5) * 3 + 100).to(torch.bfloat16)  # a large mean: bf16 sums would drift
  ref = copy.deepcopy(model)(x)
  out = jb.BridgeModule(model.to(dev))(x.to(dev))
  assert out.dtype == torch.bfloat16
  torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=0, atol=0.07)


def test_forward_and_backward_each_reduce_the_activation_twice():
  x = torch.ones(4, 8, 6, 6, requires_grad=True)
  forward, backward = jb.lower_bridged(torch.nn.BatchNorm2d(8), x, platform="cpu")
  for half in (forward, backward):  # the sum and the centred sum of squares; sum(g), sum(g x_hat)
    operands = re.findall(r"stablehlo\.reduce\(.*?: \((tensor<[^>]*>)", half)
    assert operands.count("tensor<4x8x6x6xf32>") == 2, operands
