"""Custom ops made with `torch.library` inside bridged code, and `jb.register_lowering`."""
import jax
import jax.ad_checkpoint
import pytest
import torch

import torch_xla_jaxbridge as jb

_LIB = torch.library.Library("jbtest", "DEF")
_LIB.define("implicit_cube(Tensor x) -> Tensor")
_LIB.impl("implicit_cube", lambda x: x * x * x, "CompositeImplicitAutograd")
_LIB.define("explicit_shift(Tensor x, float by) -> Tensor")
_LIB.impl("explicit_shift", lambda x, by: torch.sin(x) + by, "CompositeExplicitAutograd")
_LIB.define("xla_kernel_square(Tensor x) -> Tensor")
_LIB.impl("xla_kernel_square", lambda x: x * x, "XLA")
_LIB.impl("xla_kernel_square", lambda x: x * x, "CPU")
_LIB.define("no_kernel(Tensor x) -> Tensor")
_LIB.define("lowered_only(Tensor x) -> Tensor")
_LIB.define("opaque_autograd(Tensor x) -> Tensor")
_LIB.impl("opaque_autograd", lambda x: x * 2, "CompositeExplicitAutograd")
_LIB.impl("opaque_autograd", lambda x: x * 2, "Autograd")


@torch.library.custom_op("jbtest::rounded", mutates_args=())
def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
  """round(x * scale) with a straight-through gradient: the formula, not round's zero."""
  return torch.round(x * scale)


rounded.register_fake(lambda x, scale: torch.empty_like(x))
rounded.register_autograd(lambda ctx, grad: (grad * ctx.scale, None),
                          setup_context=lambda ctx, inputs, output: setattr(ctx, "scale",
                                                                            inputs[1]))


@torch.library.custom_op("jbtest::tanh_plain", mutates_args=())
def tanh_plain(x: torch.Tensor) -> torch.Tensor:
  return torch.tanh(x)


@torch.library.custom_op("jbtest::offload_name", mutates_args=())
def offload_name(t: torch.Tensor, name: str) -> torch.Tensor:
  """torchprime's pattern: an identity that names a tensor for offloading."""
  return t.clone()


offload_name.register_fake(lambda t, name: torch.empty_like(t))
offload_name.register_autograd(lambda ctx, grad: (grad, None))

CASES = {
    "CompositeImplicitAutograd": lambda x: torch.ops.jbtest.implicit_cube(x).sum(),
    "CompositeExplicitAutograd": lambda x: torch.ops.jbtest.explicit_shift(x, 0.5).pow(2).sum(),
    "XLA kernel": lambda x: torch.ops.jbtest.xla_kernel_square(x).sum(),
    "custom_op with register_autograd": lambda x: rounded(x, 3.0).pow(2).sum(),
    "custom_op without autograd": lambda x: tanh_plain(x).pow(2).sum(),
}
# the gradient eager torch computes for each: CompositeExplicitAutograd and kernel-only ops have no
# autograd in torch (it warns and gives none); bridged code differentiates their implementation
GRADS = {
    "CompositeImplicitAutograd": lambda x: 3 * x * x,
    "CompositeExplicitAutograd": lambda x: 2 * (torch.sin(x) + 0.5) * torch.cos(x),
    "XLA kernel": lambda x: 2 * x,
    "custom_op with register_autograd": lambda x: 2 * torch.round(3 * x) * 3,
    "custom_op without autograd": lambda x: 2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_custom_op_runs_through_its_implementation(dev, case):
  fn = CASES[case]
  x = torch.linspace(-1.1, 1.3, 7)
  bridged = x.to(dev).requires_grad_()
  value = jb.bridge(fn, fallback=False)(bridged)
  value.backward()
  torch.testing.assert_close(value.cpu(), fn(x))
  torch.testing.assert_close(bridged.grad.cpu(), GRADS[case](x))


def test_a_registered_autograd_formula_matches_eager_torch(dev):
  x = torch.linspace(-1.1, 1.3, 7)
  eager = x.clone().requires_grad_()
  CASES["custom_op with register_autograd"](eager).backward()
  bridged = x.to(dev).requires_grad_()
  jb.bridge(CASES["custom_op with register_autograd"], fallback=False)(bridged).backward()
  torch.testing.assert_close(bridged.grad.cpu(), eager.grad)


class _Block(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

  def forward(self, x):
    h = torch.ops.jbtest.implicit_cube(torch.tanh(self.inner(x)))
    return self.outer(rounded(h, 4.0) + offload_name(h, "h"))


@pytest.mark.parametrize("remat", [None, "full", "dots"])
def test_custom_ops_in_a_train_step_under_remat(dev, remat):
  torch.manual_seed(0)
  eager, model = _Block(), _Block()
  model.load_state_dict(eager.state_dict())
  batch = torch.randn(4, 8)
  eager_loss = eager(batch).pow(2).mean()
  eager_loss.backward()
  torch.optim.SGD(eager.parameters(), lr=0.1).step()
  model = model.to(dev)
  step = jb.train_step(lambda b: model(b).pow(2).mean(),
                       jb.optim.SGD(model.parameters(), lr=0.1), remat=remat, fallback=False)
  torch.testing.assert_close(step(batch.to(dev)).cpu(), eager_loss.detach())
  for got, want in zip(model.parameters(), eager.parameters()):
    torch.testing.assert_close(got.detach().cpu(), want.detach())


def test_an_op_without_an_implementation_names_the_registration_api(dev):
  fn = lambda x: torch.ops.jbtest.no_kernel(x)  # noqa: E731
  with pytest.raises(jb.errors.NoLoweringError,
                     match=r"jbtest::no_kernel cannot be converted to JAX: it has no implementation "
                           r"written in torch ops\. .*jb\.register_lowering\("
                           r"torch\.ops\.jbtest\.no_kernel, jax_fn\)"):
    jb.bridge(fn, fallback=False)(torch.ones(2, device=dev))


def test_an_op_whose_autograd_kernel_cannot_be_read_falls_back(dev):
  fn = lambda x: torch.ops.jbtest.opaque_autograd(x).sum()  # noqa: E731
  with pytest.raises(jb.errors.NoLoweringError, match="kernel registered for Autograd"):
    jb.bridge(fn, fallback=False)(torch.ones(2, device=dev))
  with pytest.warns(jb.errors.FallbackWarning, match="jbtest::opaque_autograd"):
    assert jb.bridge(fn)(torch.ones(2, device=dev)).item() == 4.0


def test_register_lowering_gives_an_op_its_jax_function_and_keys_the_cache(dev):
  fn = jb.bridge(lambda x: torch.ops.jbtest.lowered_only(x) + 1, fallback=False)
  x = torch.tensor([0.5, 2.0], device=dev)
  with pytest.raises(jb.errors.NoLoweringError):
    fn(x)
  jb.register_lowering(torch.ops.jbtest.lowered_only.default, jax.numpy.exp)
  torch.testing.assert_close(fn(x).cpu(), torch.exp(x.cpu()) + 1)
  jb.register_lowering(torch.ops.jbtest.lowered_only.default, jax.numpy.log)  # replaces
  torch.testing.assert_close(fn(x).cpu(), torch.log(x.cpu()) + 1)
  assert any("registered lowerings" in r for r in jb.cache_info().retrace_reasons)


def test_register_lowering_refuses_what_bridged_code_never_reaches():
  with pytest.raises(jb.errors.BadArgumentError, match="register_lowering: .* is neither"):
    jb.register_lowering(lambda x: x, jax.numpy.exp)


def _layer(name_it):
  lin = torch.nn.Linear(16, 16)

  def layer(x):
    h = name_it(torch.tanh(lin(x)), "hidden")
    return torch.sin(h) * h

  return layer


def test_an_offload_name_style_op_gives_the_same_residuals_as_checkpoint_name(dev):
  jb.register_lowering(torch.ops.jbtest.offload_name,
                       lambda t, name: jax.ad_checkpoint.checkpoint_name(t, name))
  policy = jb.Remat(offload=("hidden",), policy="full")
  x = torch.ones(4, 16, requires_grad=True)
  by_op = jb.saved_residuals(_layer(offload_name), x, remat=policy)
  by_name = jb.saved_residuals(_layer(jb.checkpoint_name), x, remat=policy)
  assert [(r.shape, r.where) for r in by_op.rows] == [(r.shape, r.where) for r in by_name.rows]
  assert by_op.host_bytes == by_name.host_bytes == 4 * 16 * 4


def test_torchprime_offload_name_is_checkpoint_name_without_registration(dev):
  if not hasattr(torch.ops.xla, "offload_name"):  # torchprime's definition, as it registers it
    @torch.library.custom_op("xla::offload_name", mutates_args=())
    def torchprime_offload_name(t: torch.Tensor, name: str) -> torch.Tensor:
      return t.clone()

    torchprime_offload_name.register_fake(lambda t, name: torch.empty_like(t))
    torchprime_offload_name.register_autograd(lambda ctx, grad: (grad, None))
  policy = jb.Remat(offload=("hidden",), policy="full")
  x = torch.ones(4, 16, requires_grad=True)
  by_op = jb.saved_residuals(_layer(torch.ops.xla.offload_name), x, remat=policy)
  by_name = jb.saved_residuals(_layer(jb.checkpoint_name), x, remat=policy)
  assert [(r.shape, r.where) for r in by_op.rows] == [(r.shape, r.where) for r in by_name.rows]
  assert by_op.host_bytes == 4 * 16 * 4
