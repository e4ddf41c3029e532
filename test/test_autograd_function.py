"""`torch.autograd.Function` inside bridged code: its own backward is used, as eager torch uses it."""
import pytest
import torch

import torch_xla_jaxbridge as jb


class StraightThroughRound(torch.autograd.Function):
  """round() forward, the incoming gradient times 3 backward: JAX's own gradient would be 0."""

  @staticmethod
  def forward(ctx, x):
    return torch.round(x)

  @staticmethod
  def backward(ctx, grad):
    return grad * 3


class ScaledSquare(torch.autograd.Function):
  """x * x * scale with ctx attributes (a tensor and a number) and an integer argument."""

  @staticmethod
  def forward(ctx, x, scale, power):
    ctx.save_for_backward(x)
    ctx.scale, ctx.power = scale, power
    return x ** power * scale, (x * 0).sum()

  @staticmethod
  def backward(ctx, grad, grad_sum):
    (x,) = ctx.saved_tensors
    assert ctx.needs_input_grad == (True, True, False)
    return grad * ctx.power * x ** (ctx.power - 1) * ctx.scale, (grad * x ** ctx.power).sum(), None


class SetupContextCube(torch.autograd.Function):
  """The setup_context style, with a keyword default."""

  @staticmethod
  def forward(x, shift=1.0):
    return (x + shift) ** 3

  @staticmethod
  def setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.shift = inputs[1]

  @staticmethod
  def backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return 2 * grad * (x + ctx.shift) ** 2, None  # deliberately not 3x: the formula must be used


def straight_through(x):
  return StraightThroughRound.apply(x * 2).sum()


def scaled_square(x, scale):
  out, zero = ScaledSquare.apply(x, scale, 3)
  return out.sum() + zero


def setup_cube(x):
  return SetupContextCube.apply(x, 0.5).sum()


@pytest.mark.parametrize("fn, arity", [(straight_through, 1), (scaled_square, 2),
                                       (setup_cube, 1)])
def test_the_function_backward_is_used_as_eager_uses_it(dev, fn, arity):
  inputs = [torch.linspace(-1.3, 1.7, 6), torch.tensor(0.7)][:arity]
  eager = [t.clone().requires_grad_() for t in inputs]
  fn(*eager).backward()
  bridged = [t.to(dev).requires_grad_() for t in inputs]
  value = jb.bridge(fn, fallback=False)(*bridged)
  value.backward()
  torch.testing.assert_close(value.cpu(), fn(*inputs))
  for got, want in zip(bridged, eager):
    torch.testing.assert_close(got.grad.cpu(), want.grad)


def test_a_function_in_a_train_step_under_remat(dev):
  torch.manual_seed(0)
  eager = torch.nn.Linear(6, 6)
  model = torch.nn.Linear(6, 6)
  model.load_state_dict(eager.state_dict())
  batch = torch.randn(4, 6)
  loss_of = lambda m, b: StraightThroughRound.apply(m(b)).pow(2).mean()  # noqa: E731
  eager_loss = loss_of(eager, batch)
  eager_loss.backward()
  torch.optim.SGD(eager.parameters(), lr=0.1).step()
  model = model.to(dev)
  step = jb.train_step(lambda b: loss_of(model, b), jb.optim.SGD(model.parameters(), lr=0.1),
                       remat="full", fallback=False)
  torch.testing.assert_close(step(batch.to(dev)).cpu(), eager_loss.detach())
  for got, want in zip(model.parameters(), eager.parameters()):
    torch.testing.assert_close(got.detach().cpu(), want.detach())


class InPlace(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x):
    ctx.mark_dirty(x)
    return x.mul_(2)

  @staticmethod
  def backward(ctx, grad):
    return grad * 2


def test_an_in_place_function_falls_back_and_strict_mode_names_it(dev):
  fn = lambda x: InPlace.apply(x.clone()).sum()  # noqa: E731
  with pytest.raises(jb.errors.NoLoweringError, match="ctx.mark_dirty"):
    jb.bridge(fn, fallback=False)(torch.ones(3, device=dev))
  x = torch.ones(3, device=dev, requires_grad=True)
  with pytest.warns(jb.errors.FallbackWarning, match="ctx.mark_dirty"):
    jb.bridge(fn)(x).backward()
  assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]


def test_outside_bridged_code_the_function_is_torch_own(dev):
  x = torch.ones(3, device=dev, requires_grad=True)
  straight_through(x).backward()
  assert x.grad.cpu().tolist() == [6.0, 6.0, 6.0]
  assert "apply" not in vars(torch.autograd.Function) or isinstance(
      vars(torch.autograd.Function)["apply"], classmethod)
