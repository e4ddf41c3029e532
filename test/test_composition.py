"""Bridged pieces inside bridged code: each inlines into the enclosing trace (one node for the outer
call), keeps its own remat policy, and gives eager CPU PyTorch's values and gradients."""
import copy

import jax.numpy as jnp
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


def user_nodes(tensor):
  """The user-computation nodes (`xla::<name>_fwd` / `_bwd` / call_jax names) in the IR."""
  text = torch_xla._XLAC._get_xla_tensors_text([tensor])
  return [line.split("xla::")[1].split("(")[0] for line in text.splitlines()
          if "xla::" in line and "xla::device_data" not in line]


def pair(*shapes, grad=True):
  """CPU tensors and their XLA copies (leaves requiring grad)."""
  cpu = [torch.randn(*s, requires_grad=grad) for s in shapes]
  xla = [t.detach().to("xla").requires_grad_(grad) for t in cpu]
  return cpu, xla


def close(a, b):
  torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-5)


@jb.bridge
def sin_matmul(x, w):
  return jb.call_jax(lambda a, b, k: jnp.sin(a @ b) * k, (x, w, 3.0)).relu()


def test_call_jax_inside_bridge_values_gradients_one_node(dev):
  (x, w), (xx, xw) = pair((3, 4), (4, 5))
  out = sin_matmul(xx, xw)
  assert user_nodes(out) == ["sin_matmul_fwd"]
  out.sum().backward()
  ref = (torch.sin(x @ w) * 3.0).relu()
  ref.sum().backward()
  close(out, ref)
  close(xx.grad, x.grad)
  close(xw.grad, w.grad)


def test_outside_tensors_inside_bridged_code_are_named(dev):
  outside = torch.ones(3, device="xla")
  stack = [Block().to("xla") for _ in range(2)]

  def held():  # a helper's own closure is not lifted: its values stay outside the trace
    return outside, stack

  @jb.bridge(fallback=False)
  def f(x):
    return jb.call_jax(jnp.add, (x, held()[0]))

  with pytest.raises(jb.errors.CapturedTensorError,
                     match=r"add: args\[1\] is a tensor on xla:0 from outside"):
    f(torch.ones(3, device="xla"))

  @jb.bridge(fallback=False)
  def g(h):
    return jb.scan_layers(held()[1], h)

  with pytest.raises(jb.errors.CapturedTensorError, match=r"scan_Block: args\[1\]\['lin.bias'\]"):
    g(torch.ones(2, 4, device="xla"))


def test_layers_in_a_list_the_bridged_code_closes_over_are_lifted(dev):
  torch.manual_seed(0)
  ref = [Block() for _ in range(2)]
  layers = [copy.deepcopy(block).to(dev) for block in ref]  # a Python list, not a ModuleList
  h = torch.randn(2, 4)
  out = jb.bridge(lambda x: jb.scan_layers(layers, x), name="g", fallback=False)(h.to(dev))
  out.sum().backward()
  expected = h
  for block in ref:
    expected = torch.tanh(block.lin(expected))
  expected.sum().backward()
  close(out, expected)
  for block, r in zip(layers, ref):
    close(block.lin.weight.grad, r.lin.weight.grad)


@jb.bridge(remat="full")
def tanh_full(x, w):
  return torch.tanh(x @ w)


@jb.bridge
def tanh_plain(x, w):
  return torch.tanh(x @ w)


def test_bridge_inside_bridge_keeps_the_inner_policy(dev):
  (x, w), (xx, xw) = pair((3, 4), (4, 5))

  @jb.bridge
  def outer_full(x, w):
    return tanh_full(x, w) * 2

  @jb.bridge
  def outer_plain(x, w):
    return tanh_plain(x, w) * 2

  out = outer_full(xx, xw)
  assert user_nodes(out) == ["outer_full_fwd"]
  out.sum().backward()
  ref = torch.tanh(x @ w) * 2
  ref.sum().backward()
  close(out, ref)
  close(xw.grad, w.grad)
  close(xx.grad, x.grad)
  # "full" recomputes: nothing of shape (3, 5) is kept; without a policy tanh's output is
  kept = lambda fn: [r.shape for r in jb.saved_residuals(fn, xx, xw).rows]  # noqa: E731
  assert (3, 5) not in kept(outer_full)
  assert (3, 5) in kept(outer_plain)


def test_rng_seed_inside_bridge_fixes_randomness(dev):
  noisy = jb.assume_pure(lambda a: a + torch.randn_like(a), add_rng_seed_argument=True,
                         remat="full")

  @jb.bridge
  def twice(a):
    return noisy(a, rng_seed=5) - noisy(a, rng_seed=5), noisy(a, rng_seed=6)

  same, other = twice(torch.zeros(4, device="xla"))
  assert same.abs().max().item() == 0
  assert other.abs().max().item() > 0
  torch.testing.assert_close(noisy(torch.zeros(4, device="xla"), rng_seed=6).cpu(), other.cpu())


def test_bridge_module_inside_bridge_module(dev):
  torch.manual_seed(0)
  ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
  model = torch.nn.Sequential(*[m for m in copy.deepcopy(ref)]).to("xla")
  model[0] = jb.BridgeModule(model[0], remat="full")
  bridged = jb.BridgeModule(model)
  x = torch.randn(3, 4)
  out = bridged(x.to("xla"))
  assert user_nodes(out) == ["Sequential_fwd"]
  out.pow(2).sum().backward()
  expect = ref(x)
  expect.pow(2).sum().backward()
  close(out, expect)
  for (name, p), q in zip(bridged.named_parameters(), ref.parameters()):
    close(p.grad, q.grad)


class Block(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)

  def forward(self, h):
    return jb.call_jax(jnp.tanh, (self.lin(h),))


def test_call_jax_inside_scan_layers_and_scan_inside_bridge(dev):
  torch.manual_seed(0)
  ref = [Block() for _ in range(3)]
  layers = torch.nn.ModuleList([copy.deepcopy(b) for b in ref]).to("xla")
  x = torch.randn(2, 4)

  @jb.bridge
  def model(h):
    return jb.scan_layers(layers, h) * 2

  out = model(x.to("xla"))
  assert user_nodes(out) == ["model_fwd"]
  out.sum().backward()
  h = x
  for b in ref:
    h = torch.tanh(b.lin(h))
  (h * 2).sum().backward()
  close(out, h * 2)
  for b, r in zip(layers, ref):
    close(b.lin.weight.grad, r.lin.weight.grad)


def test_call_jax_inside_fori_loop(dev):
  (x, w), (xx, xw) = pair((2, 3), (3, 3))

  @jb.bridge
  def loop(x, w):
    return jb.fori_loop(0, 3, lambda i, h: jb.call_jax(lambda a, b: jnp.sin(a @ b), (h, w)), x)

  out = loop(xx, xw)
  assert user_nodes(out) == ["loop_fwd"]
  out.sum().backward()
  h = x
  for _ in range(3):
    h = torch.sin(h @ w)
  h.sum().backward()
  close(out, h)
  close(xw.grad, w.grad)
  close(xx.grad, x.grad)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_call_jax_inside_cond_branch(dev, sign):
  (x,), (xx,) = pair((5,))

  @jb.bridge
  def branchy(x, s):
    return torch.cond(s.sum() > 0, lambda t: jb.call_jax(jnp.sin, (t,)),
                      lambda t: jb.call_jax(lambda a: a * a, (t,)), (x,))

  s = torch.full((1,), sign)
  out = branchy(xx, s.to("xla"))
  assert user_nodes(out) == ["branchy_fwd"]
  out.sum().backward()
  ref = torch.sin(x) if sign > 0 else x * x
  ref.sum().backward()
  close(out, ref)
  close(xx.grad, x.grad)


def test_jax_op_inside_bridge(dev):
  cube = jb.jax_op(lambda a: a ** 3, name="composition_cube")
  (x,), (xx,) = pair((4,))
  out = jb.bridge(lambda t: cube(t) + 1)(xx)
  assert len(user_nodes(out)) == 1
  out.sum().backward()
  (x ** 3 + 1).sum().backward()
  close(xx.grad, x.grad)


def test_missing_rng_seed_is_an_assertion_error(dev):
  noisy = jb.assume_pure(lambda a: a * 2, add_rng_seed_argument=True)
  with pytest.raises(AssertionError, match="rng_seed="):
    noisy(torch.ones(2, device="xla"))
  assert issubclass(jb.errors.MissingSeedError, jb.errors.BadArgumentError)


def test_stacked_layers_inside_bridge_module(dev):
  torch.manual_seed(0)
  ref = [Block() for _ in range(3)]

  class Net(torch.nn.Module):

    def __init__(self, blocks):
      super().__init__()
      self.stack = jb.StackedLayers(blocks)
      self.head = torch.nn.Linear(4, 1)

    def forward(self, h):
      return self.head(self.stack(h))

  net = Net([copy.deepcopy(b) for b in ref]).to("xla")
  bridged = jb.BridgeModule(net)
  x = torch.randn(2, 4)
  out = bridged(x.to("xla"))
  assert user_nodes(out) == ["Net_fwd"]
  out.sum().backward()
  h = x
  for b in ref:
    h = torch.tanh(b.lin(h))
  head = copy.deepcopy(net.head).cpu()
  head.weight.grad = None
  expect = head(h)
  close(out, expect)
  expect.sum().backward()
  close(net.stack.layer.lin.weight.grad, torch.stack([b.lin.weight.grad for b in ref]))
  close(net.stack.layer.lin.bias.grad, torch.stack([b.lin.bias.grad for b in ref]))
  close(net.head.weight.grad, head.weight.grad)


def test_inner_random_draws_with_a_policy_differ_from_the_outer_ones(dev):
  inner = jb.bridge(lambda a: torch.rand_like(a) + a, remat="full")

  @jb.bridge
  def outer(a):
    return inner(a), torch.rand_like(a)

  first, second = outer(torch.zeros(64, device="xla"))
  assert not torch.equal(first.cpu(), second.cpu())
  again, _ = outer(torch.zeros(64, device="xla"))
  assert not torch.equal(first.cpu(), again.cpu())  # fresh on every call


@pytest.mark.parametrize("remat", [None, "full"])
def test_inner_in_place_updates_reach_the_outer_arguments(dev, remat):
  @jb.bridge(remat=remat)
  def count(x, seen):
    seen.add_(1)
    return x * seen

  @jb.bridge
  def outer(x, seen):
    return count(x, seen) + count(x, seen)

  (x,), (xx,) = pair((3,))
  seen = torch.zeros(3, device="xla")
  out = outer(xx, seen)
  assert seen.cpu().tolist() == [2.0, 2.0, 2.0]
  out.sum().backward()
  (x * 1 + x * 2).sum().backward()
  close(out, x * 3)
  close(xx.grad, x.grad)
