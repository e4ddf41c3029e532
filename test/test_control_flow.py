"""torch.cond, torch.while_loop and jb.fori_loop inside bridged code, against eager torch."""
import copy

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

import torch_xla_jaxbridge as jb
from parity import rel_err


def signed_scale(x, w):
  return torch.cond(x.sum() > 0, lambda t: t * w, lambda t: t - w, (x,))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_both_branches_with_gradients(dev, sign):
  x, w = sign * torch.rand(4) + sign, torch.tensor([3.0])
  rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
  ref = signed_scale(rx, rw)
  (ref * torch.arange(4.0)).sum().backward()
  bx, bw = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
  out = jb.bridge(signed_scale)(bx, bw)
  (out * torch.arange(4.0, device=dev)).sum().backward()
  assert rel_err(out, ref) < 1e-6
  assert rel_err(bx.grad, rx.grad) < 1e-6 and rel_err(bw.grad, rw.grad) < 1e-6


def nested(x):
  def positive(t):
    return torch.cond(t.max() > 2, lambda u: u * 10, lambda u: u + 1, (t,))

  return torch.cond(x.min() > 0, positive, lambda t: -t, (x,))


@pytest.mark.parametrize("values", [[1.0, 3.0], [1.0, 1.5], [-1.0, 5.0]])
def test_nested_cond(dev, values):
  x = torch.tensor(values)
  torch.testing.assert_close(jb.bridge(nested)(x.to(dev)).cpu(), nested(x))


class Gate(torch.nn.Module):
  """A branch that reads the module's own parameters."""

  def __init__(self):
    super().__init__()
    self.up, self.down = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

  def forward(self, x):
    return torch.cond(x.mean() > 0, lambda t: self.up(t), lambda t: self.down(t).relu(), (x,))


def test_branches_read_module_parameters(dev):
  torch.manual_seed(0)
  for x in (torch.rand(3, 4), -torch.rand(3, 4)):
    ref = Gate()
    bridged = jb.BridgeModule(copy.deepcopy(ref).to(dev))
    ref(x).sum().backward()
    bridged(x.to(dev)).sum().backward()
    for (name, p), (_, r) in zip(bridged.named_parameters(), ref.named_parameters()):
      assert rel_err(p.grad, r.grad) < 1e-5, name


def halve_until_small(x, tol):
  return while_loop(lambda v: v.norm() > tol, lambda v: (v / 2,), (x,))[0]


def test_while_loop_with_a_data_dependent_trip_count(dev):
  for start in (3.0, 40.0, 0.5):
    x = torch.full((4,), start)
    torch.testing.assert_close(jb.bridge(halve_until_small)(x.to(dev), 1.0).cpu(),
                               halve_until_small(x, 1.0))


def test_gradient_through_while_loop_is_refused_clearly(dev):
  x = torch.full((4,), 8.0, device=dev, requires_grad=True)
  out = jb.bridge(halve_until_small)(x, 1.0)
  with pytest.raises(jb.errors.ControlFlowError, match=r"halve_until_small: a gradient was asked "
                     r"through torch.while_loop.*Use jb.fori_loop"):
    out.sum().backward()


def powers(x, w):
  return jb.fori_loop(0, 3, lambda i, v: v * w + i, x)


def test_fori_loop_matches_python_and_differentiates(dev):
  x, w = torch.rand(3), torch.tensor(1.5)
  rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
  ref = powers(rx, rw)
  ref.sum().backward()
  bx, bw = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
  out = jb.bridge(powers)(bx, bw)
  out.sum().backward()
  assert rel_err(out, ref) < 1e-6 and rel_err(bw.grad, rw.grad) < 1e-6
  with pytest.raises(jb.errors.BadArgumentError, match="fori_loop: lower and upper must be Python"):
    jb.fori_loop(0, torch.tensor(3), lambda i, v: v, x)


def test_same_code_runs_outside_bridged_code(dev):
  x = torch.tensor([1.0, 3.0], device=dev)
  torch.testing.assert_close(nested(x).cpu(), nested(x.cpu()))
  torch.testing.assert_close(halve_until_small(x, 1.0).cpu(), halve_until_small(x.cpu(), 1.0))
