"""A bridged call gives back an output that is one of its input tensors (returned as it came, or
after an in-place update) or an output returned twice as that very tensor, as torch code does:
an in-place update of the output afterwards shows in the input (or the twin), as in plain
torch_xla and eager torch. Against eager CPU torch, values and gradients."""
import copy

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
import entries


class Skip(torch.nn.Module):  # a disabled layer: its input, as it came
  def forward(self, x):
    return x


class ReluInPlace(torch.nn.Module):  # updates its input, returns it
  def forward(self, x):
    return x.relu_()


class Twin(torch.nn.Module):  # one tensor, returned twice
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)

  def forward(self, x):
    y = self.lin(x)
    return y, y


def _after_in_place(module, x, wrap):
  """What the caller sees after zeroing the first output in place: the input and the outputs."""
  with torch.no_grad():
    out = wrap(module)(x)
    first = out[0] if isinstance(out, tuple) else out
    first.mul_(0)
  return x, out


@pytest.mark.parametrize("make", [Skip, ReluInPlace, Twin])
@pytest.mark.parametrize("entry", entries.ENTRIES)
def test_an_output_that_is_an_input_or_another_output_is_that_tensor(dev, make, entry):
  torch.manual_seed(0)
  eager = make()
  model = copy.deepcopy(eager).to(dev)
  call = entries.bridged(entry, model, make.__name__)
  x = torch.randn(2, 4)
  expected_x, expected = _after_in_place(eager, x.clone(), lambda m: m)
  got_x, got = _after_in_place(model, x.to(dev), lambda m: call)
  torch.testing.assert_close(got_x.cpu(), expected_x)
  for a, b in zip(got if isinstance(got, tuple) else (got,),
                  expected if isinstance(expected, tuple) else (expected,)):
    torch.testing.assert_close(a.cpu(), b)
  if make is Twin:
    assert got[0] is got[1]
  else:
    assert got is got_x


def test_an_output_returned_twice_gets_the_gradient_of_both_uses(dev):
  torch.manual_seed(0)
  eager = Twin()
  model = jb.BridgeModule(copy.deepcopy(eager).to(dev))
  x = torch.randn(2, 4)
  a, b = eager(x)
  (a.square().sum() + 3 * b.sum()).backward()
  a, b = model(x.to(dev))
  assert a is b and a.requires_grad
  (a.square().sum() + 3 * b.sum()).backward()
  torch_xla.sync()
  for p, q in zip(model.parameters(), eager.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad)


def test_an_input_returned_as_it_came_keeps_its_gradient_path(dev):
  x = torch.randn(2, 4, requires_grad=True)
  on_xla = x.detach().to(dev).requires_grad_()
  mid = on_xla * 2
  out = jb.bridge(lambda t: t)(mid)
  assert out is mid
  out.sum().backward()
  torch.testing.assert_close(on_xla.grad.cpu(), torch.full((2, 4), 2.0))
