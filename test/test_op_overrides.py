"""`jb.override_ops`: a JAX implementation of a torch op inside bridged code, scoped, keyed."""
import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import torch_xla_jaxbridge as jb


def doubled_gelu(x, approximate="none"):
  return 2 * jax.nn.gelu(x, approximate=False)


def tripled_gelu(x, approximate="none"):
  return 3 * jax.nn.gelu(x, approximate=False)


@pytest.fixture
def x(dev):
  return torch.linspace(-2, 2, 6, device=dev)


def test_applies_inside_the_scope_only(x):
  f = jb.bridge(lambda t: F.gelu(t) + 1)
  expected = F.gelu(x.cpu()) + 1
  with jb.override_ops({F.gelu: doubled_gelu}):
    inside = f(x).cpu()
    lazy = F.gelu(x).cpu()  # LazyTensor code is not bridged: torch's op, whatever the scope
  torch.testing.assert_close(inside, 2 * F.gelu(x.cpu()) + 1)
  torch.testing.assert_close(lazy, F.gelu(x.cpu()))
  torch.testing.assert_close(f(x).cpu(), expected)


def test_the_active_overrides_key_the_trace_cache(x):
  f = jb.bridge(lambda t: F.gelu(t))
  reference = F.gelu(x.cpu())
  torch.testing.assert_close(f(x).cpu(), reference)
  assert jb.cache_info().misses == 1
  with jb.override_ops({F.gelu: doubled_gelu}):
    torch.testing.assert_close(f(x).cpu(), 2 * reference)  # not the cached reference trace
    torch.testing.assert_close(f(x).cpu(), 2 * reference)
  with jb.override_ops({F.gelu: tripled_gelu}):
    torch.testing.assert_close(f(x).cpu(), 3 * reference)
  torch.testing.assert_close(f(x).cpu(), reference)  # not the cached override trace
  info = jb.cache_info()
  assert info.misses == 3 and info.hits == 2
  assert info.retrace_reasons[0] == "_lambda__fwd: op overrides none -> {gelu: doubled_gelu}"


def test_scopes_nest_and_restore(x):
  f = jb.bridge(lambda t: F.gelu(t) + torch.sin(t))
  gelu, sin = F.gelu(x.cpu()), torch.sin(x.cpu())
  cos = lambda t: jnp.cos(t)  # noqa: E731
  with jb.override_ops({F.gelu: doubled_gelu}):
    with jb.override_ops({F.gelu: tripled_gelu, torch.sin: cos}):
      torch.testing.assert_close(f(x).cpu(), 3 * gelu + torch.cos(x.cpu()))
    torch.testing.assert_close(f(x).cpu(), 2 * gelu + sin)
  torch.testing.assert_close(f(x).cpu(), gelu + sin)


def test_an_aten_op_and_a_tensor_method(x):
  f = jb.bridge(lambda t: torch.ops.aten.sin.default(t) + t.exp())
  with jb.override_ops({torch.ops.aten.sin: jnp.cos, torch.Tensor.exp: lambda t: 2 * t}):
    torch.testing.assert_close(f(x).cpu(), torch.cos(x.cpu()) + 2 * x.cpu())


def test_the_gradient_is_jaxs_custom_vjp(dev):
  @jax.custom_vjp
  def scaled(t):
    return t * 1.0

  scaled.defvjp(lambda t: (t, None), lambda _, g: (5 * g,))  # a gradient torch would never give
  w = torch.ones(3, device=dev, requires_grad=True)
  layer = jb.bridge(lambda w: torch.sin(w).sum())
  with jb.override_ops({torch.sin: scaled}):
    layer(w).backward()
  assert w.grad.cpu().tolist() == [5.0, 5.0, 5.0]


def test_the_gradient_of_a_plain_override_is_jax_vjp(dev):
  w = torch.linspace(-1, 1, 4, device=dev, requires_grad=True)
  with jb.override_ops({F.gelu: doubled_gelu}):
    jb.bridge(lambda w: F.gelu(w).sum())(w).backward()
  expected = jax.grad(lambda a: doubled_gelu(a).sum())(jnp.linspace(-1, 1, 4))
  torch.testing.assert_close(w.grad.cpu(), torch.tensor(expected.tolist()))


def test_bridge_module_and_kwargs_reach_the_override(dev):
  seen = {}

  def softmax(t, dim=None, _stacklevel=3, dtype=None):
    seen["dim"] = dim
    return jax.nn.softmax(t, axis=dim)

  layer = jb.BridgeModule(torch.nn.Softmax(dim=0).to(dev))
  with jb.override_ops({F.softmax: softmax}):
    layer(torch.ones(2, 2, device=dev)).cpu()
  assert seen == {"dim": 0}


@pytest.mark.parametrize("overrides, message", [
    ([(F.gelu, doubled_gelu)], "expected a dict from torch op or function to JAX function, got "
                               "list"),
    ({doubled_gelu: doubled_gelu}, "doubled_gelu is neither a torch function that dispatches on "
                                   "tensors"),
    ({F.gelu: "gelu"}, "the override of gelu is a str; expected a function of JAX arrays"),
])
def test_bad_overrides_are_refused(overrides, message):
  with pytest.raises(jb.errors.BadArgumentError, match=message):
    with jb.override_ops(overrides):
      pass


def test_an_override_returning_a_torch_tensor_is_an_error(x):
  with pytest.raises(jb.errors.BridgeError, match="returned a Tensor; a lowering returns JAX "
                                                  "arrays"):
    with jb.override_ops({F.gelu: lambda t, approximate="none": torch.ones(6)}):
      jb.bridge(F.gelu)(x)


NORMS = {"all": lambda x: x.norm(), "dim": lambda x: x.norm(dim=1),
         "p=3 keepdim": lambda x: torch.linalg.vector_norm(x, 3, dim=(0,), keepdim=True),
         "inf": lambda x: torch.linalg.vector_norm(x, float("inf")),
         "-inf": lambda x: torch.linalg.vector_norm(x, -float("inf"), 1),
         "count": lambda x: torch.linalg.vector_norm(x, 0, dim=1),
         "dtype": lambda x: torch.linalg.vector_norm(x.bfloat16(), 1, dtype=torch.float32),
         "zero": lambda x: (x * 0).norm()}


@pytest.mark.parametrize("name", NORMS)
def test_vector_norms_equal_eager_with_gradients(name, dev):
  """`torch.norm(x)` on XLA tensors passes no dims (all of them) to `linalg_vector_norm`; the
  zero vector's 2-norm has gradient zero, as torch's."""
  norm = NORMS[name]
  x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
  expected = norm(x)
  bridged_x = x.detach().to(dev).requires_grad_()
  out = jb.bridge(norm)(bridged_x)
  assert out.dtype == expected.dtype and out.shape == expected.shape
  torch.testing.assert_close(out.cpu(), expected)
  expected.sum().backward()
  out.sum().backward()
  if x.grad is None:  # count: none, in eager as bridged
    assert bridged_x.grad is None
  else:
    torch.testing.assert_close(bridged_x.grad.cpu(), x.grad)


def test_norm_inside_a_while_loop_body_equals_eager(dev):
  """There `torch.norm` reaches the bridge as `frobenius_norm` itself, not decomposed."""
  from torch._higher_order_ops.while_loop import while_loop

  def halve_until_small(x):
    return while_loop(lambda v: v.norm() > 1.0, lambda v: (v / 2,), (x,))[0]

  x = torch.full((4,), 8.0)
  out = jb.bridge(halve_until_small, fallback=False)(x.to(dev))
  torch.testing.assert_close(out.cpu(), halve_until_small(x))
