"""jb.checkpoint against eager CPU torch: values and gradients; the backward recomputes."""
import copy

import torch
import torch_xla

import torch_xla_jaxbridge as jb
from parity import rel_err


def block():
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def test_values_and_gradients_match_eager(dev):
  ref = block()
  model = copy.deepcopy(ref).to(dev)
  x = torch.randn(4, 8)
  ref_x, xla_x = x.clone().requires_grad_(), x.to(dev).requires_grad_()
  ref_out = torch.tanh(ref(ref_x))
  ref_out.pow(2).sum().backward()
  for _ in range(2):  # the second call reuses the first one's trace
    model.zero_grad()
    xla_x.grad = None
    out = torch.tanh(jb.checkpoint(model, xla_x, use_reentrant=False, preserve_rng_state=False))
    out.pow(2).sum().backward()
    torch_xla.sync()
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(xla_x.grad, ref_x.grad) < 1e-5
    for p, r in zip(model.parameters(), ref.parameters()):
      assert rel_err(p.grad, r.grad) < 1e-5


def test_the_backward_keeps_less(dev):
  model = block().to(dev)
  x = torch.ones(64, 8, device=dev, requires_grad=True)
  checkpointed = jb.saved_residuals(lambda x: jb.checkpoint(model, x), x)
  plain = jb.saved_residuals(lambda x: model(x), x)
  assert checkpointed.total_bytes < plain.total_bytes
