"""jb.scan against an eager CPU torch loop: outputs, gradients of init, xs and closed-over
tensors, pytrees, randomness, remat, errors."""
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from parity import rel_err

_leaves = torch.utils._pytree.tree_leaves
_map = torch.utils._pytree.tree_map


def loop(fn, init, xs):
  """The reference: `fn` over dim 0 of `xs` in a Python loop, the ys stacked."""
  carry, ys = init, []
  for i in range(_leaves(xs)[0].shape[0]):
    carry, y = fn(carry, _map(lambda x: x[i], xs))
    ys.append(y)
  return carry, _map(lambda *y: torch.stack(y), *ys) if ys[0] is not None else None


def scanned_vs_loop(fn, init, xs, dev, **options):
  """Scans on XLA and loops on CPU; compares outputs and the gradients of init and xs."""
  leaf = lambda t: t.clone().requires_grad_(t.is_floating_point())  # noqa: E731
  ref_init, ref_xs = _map(leaf, init), _map(leaf, xs)
  ref = loop(fn, ref_init, ref_xs)
  sum(x.float().pow(2).sum() for x in _leaves(ref)).backward()
  on_dev = lambda t: t.detach().to(dev).requires_grad_(t.is_floating_point())  # noqa: E731
  xla_init, xla_xs = _map(on_dev, init), _map(on_dev, xs)
  out = jb.scan(fn, xla_init, xla_xs, **options)
  sum(x.float().pow(2).sum() for x in _leaves(out)).backward()
  torch_xla.sync()
  for a, b in zip(_leaves(out), _leaves(ref)):
    assert rel_err(a, b) < 1e-5
  for a, b in zip(_leaves((xla_init, xla_xs)), _leaves((ref_init, ref_xs))):
    assert rel_err(a.grad, b.grad) < 1e-5
  return out


def test_cumulative_sum(dev):
  carry, ys = scanned_vs_loop(lambda c, x: (c + x, c + x), torch.zeros(3),
                              torch.randn(5, 3), dev)
  assert ys.shape == (5, 3)


def test_pytrees_of_carry_xs_and_ys(dev):
  def fn(carry, x):
    a = torch.tanh(carry["a"] @ x[0] + carry["b"])
    return {"a": a, "b": carry["b"] * x[1].mean()}, (a.sum(-1), [x[1] * 2])

  scanned_vs_loop(fn, {"a": torch.randn(2, 4), "b": torch.randn(4)},
                  (torch.randn(6, 4, 4), torch.randn(6, 3)), dev)


def test_gradients_reach_a_closed_over_parameter(dev):
  layer = torch.nn.Linear(4, 4)
  xla_layer = torch.nn.Linear(4, 4).to(dev)
  xla_layer.load_state_dict(layer.state_dict())
  w = torch.randn(4)
  xla_w = w.to(dev).requires_grad_()
  w.requires_grad_()
  init, xs = torch.randn(2, 4), torch.randn(3, 2, 4)

  def step(module, scale):
    return lambda c, x: (torch.sin(module(c) * scale + x), None)

  ref, _ = loop(step(layer, w), init, xs)
  ref.pow(2).sum().backward()
  out, ys = jb.scan(step(xla_layer, xla_w), init.to(dev), xs.to(dev))
  out.pow(2).sum().backward()
  torch_xla.sync()
  assert ys is None
  assert rel_err(out, ref) < 1e-5
  assert rel_err(xla_w.grad, w.grad) < 1e-5
  assert rel_err(xla_layer.weight.grad, layer.weight.grad) < 1e-5


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_rematerialization_partition"])
def test_partition_fn_gives_the_same_gradients(dev, partition):
  from functorch import compile as functorch_compile
  scanned_vs_loop(lambda c, x: (torch.sin(c) * x, torch.cos(c)), torch.randn(3),
                  torch.randn(4, 3), dev, partition_fn=getattr(functorch_compile, partition),
                  is_fn_pure=False)


def test_one_bridged_call_whatever_the_length(dev):
  fn = lambda c, x: (c * x, c)  # noqa: E731
  for length in (2, 2, 7):
    jb.scan(fn, torch.ones(2, device=dev), torch.ones(length, 2, device=dev))
  # the same function over two lengths: two traces, the second length-2 call reuses the first
  assert (jb.cache_info().misses, jb.cache_info().hits) == (2, 1)


def test_randomness_differs_per_step(dev):
  _, ys = jb.scan(lambda c, x: (c, x + torch.rand(1000, device=x.device)),
                  torch.zeros(1, device=dev), torch.zeros(3, 1000, device=dev))
  ys = ys.cpu()
  assert not torch.equal(ys[0], ys[1]) and not torch.equal(ys[1], ys[2])


def test_errors(dev):
  xs = torch.ones(3, 2, device=dev)
  with pytest.raises(ValueError, match="scan: fn is a int"):
    jb.scan(1000, torch.ones(2, device=dev), xs)
  with pytest.raises(ValueError, match=r"same length along dim 0.*xs\[1\]: \(2, 2\)"):
    jb.scan(lambda c, x: (c, x), torch.ones(2, device=dev), (xs, torch.ones(2, 2, device=dev)))

  def in_place(carry, x):
    carry.add_(x)
    return carry, x

  with pytest.raises(RuntimeError, match="scan: fn changed its carry or x .* in-place"):
    jb.scan(in_place, torch.ones(2, device=dev), xs)
  outside = torch.zeros(2, device=dev)

  def bumps_outside(carry, x):
    outside.add_(1.0)
    return carry + outside, x

  with pytest.raises(RuntimeError, match="changed a tensor it reads from outside"):
    jb.scan(bumps_outside, torch.ones(2, device=dev), xs)
  with pytest.raises(jb.errors.BridgeError, match="the new carry must have the carry's"):
    jb.scan(lambda c, x: (c.sum(), x), torch.ones(2, device=dev), xs)
