"""Inside bridged code every op's result has torch's dtype: int64 indices and counts, float32 from
Python floats, float64 when asked; library checks on dtypes pass. Against eager CPU torch."""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_xla_jaxbridge as jb

X = torch.tensor([[0.3, -1.2, 2.5, 0.7, -0.1, 1.9], [1.1, 0.4, -2.0, 3.3, 0.2, -0.6],
                  [2.2, 2.1, -0.3, 0.0, 1.4, 0.9], [-1.5, 0.8, 0.6, -0.9, 2.7, 0.5]])

OPS = {  # name -> torch code on one float32 tensor, as a model writes it
    "topk": lambda x: torch.topk(x, 2, dim=-1),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(),
    "sort": lambda x: torch.sort(x, -1, descending=True),
    "argsort": lambda x: torch.argsort(x, -1),
    "max_dim": lambda x: x.max(-1),
    "min_dim": lambda x: torch.min(x, 0),
    "kthvalue": lambda x: torch.kthvalue(x, 2, -1),
    "median_dim": lambda x: x.median(-1),
    "cummax": lambda x: torch.cummax(x, 1),
    "cummin": lambda x: torch.cummin(x, 1),
    "searchsorted": lambda x: torch.searchsorted(torch.sort(x[0]).values, x[1]),
    "searchsorted_rows": lambda x: torch.searchsorted(torch.sort(x).values, x[:, :2], right=True),
    "searchsorted_sorter": lambda x: torch.searchsorted(x[0], x[1], sorter=torch.argsort(x[0]),
                                                        out_int32=True),
    "bucketize": lambda x: torch.bucketize(x[1], torch.sort(x[0]).values),
    "arange_n": lambda x: torch.arange(x.shape[-1], device=x.device),
    "arange_float": lambda x: torch.arange(0.0, 3.0, 0.5, device=x.device),
    "full_float": lambda x: torch.full((2, 3), 1.5, device=x.device),
    "full_int": lambda x: torch.full((2,), 7, device=x.device),
    "tensor_int": lambda x: torch.tensor([1, 2], device=x.device),
    "shape_as_tensor": lambda x: torch.tensor(x.shape, device=x.device),
    "count": lambda x: (x > 0).sum(-1),
    "cumsum_mask": lambda x: (x > 0).cumsum(-1),
    "positions": lambda x: (x > 0).long().cumsum(-1) - 1,
    "floor_div": lambda x: torch.arange(6, device=x.device) // 4,
    "one_hot_topk": lambda x: F.one_hot(torch.topk(x, 2).indices, 6),
    "softmax_float64": lambda x: torch.softmax(x, -1, dtype=torch.float64),
    "double": lambda x: x.double() * 2,
    "randint": lambda x: torch.randint(0, 5, (3,), device=x.device).dtype == torch.int64,
    "tril_indices": lambda x: torch.tril_indices(3, 3, device=x.device),
    "gather_topk": lambda x: x.gather(-1, torch.topk(x, 3).indices),
}


def _dtypes(tree):
  return [t.dtype if isinstance(t, torch.Tensor) else t for t in _leaves(tree)]


def _leaves(tree):
  return list(tree) if isinstance(tree, tuple) else [tree]


@pytest.mark.parametrize("name", OPS)
def test_an_op_inside_bridged_code_gives_torchs_dtype_and_value(name, dev):
  op = OPS[name]
  expected = op(X)
  got = jb.bridge(op, name=name)(X.to(dev))
  assert _dtypes(got) == _dtypes(expected)
  for g, e in zip(_leaves(got), _leaves(expected)):
    if isinstance(e, torch.Tensor):
      torch.testing.assert_close(g.cpu(), e)
    else:
      assert g == e


class Router(torch.nn.Module):
  """A mixture-of-experts router as DeepSeek-V3's and Qwen2-MoE's: top-k experts one-hot encoded
  (`one_hot` takes int64 only), weights gathered by the indices."""

  def __init__(self):
    super().__init__()
    self.gate = torch.nn.Linear(6, 4)

  def forward(self, x):
    scores = self.gate(x).softmax(-1)
    weights, experts = torch.topk(scores, 2, dim=-1)
    mask = F.one_hot(experts, num_classes=4).permute(2, 1, 0)
    return (weights.unsqueeze(-1) * mask.permute(2, 1, 0)).sum(1) @ self.gate.weight


def test_a_router_module_bridged_by_class_runs_bridged_with_eagers_values(dev):
  """The module's inputs are float32 only: it is traced in 64-bit mode all the same, so
  `one_hot` gets the int64 indices torch gives, and the region is not one that falls back."""
  torch.manual_seed(0)
  eager = Router()
  moved = Router().to(dev)
  moved.load_state_dict(eager.state_dict())
  before = jb.bridge_report()
  jb.bridge_modules(moved, [Router])
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    out = moved(X.to(dev))
  out.sum().backward()
  expected = eager(X)
  expected.sum().backward()
  torch.testing.assert_close(out.cpu(), expected)
  torch.testing.assert_close(moved.gate.weight.grad.cpu(), eager.gate.weight.grad)
  assert [r.status for r in jb.bridge_report(since=before).rows] == ["bridged"]


def test_jaxify_in_jaxs_32_bit_mode_keeps_32_bit_indices():
  """In the user's own JAX code (32-bit mode) an int64 result stays JAX's int32, as JAX has it,
  instead of warning or failing."""
  import jax.numpy as jnp

  fn, params = jb.jaxify(lambda x: x.argmax(-1))
  out = fn(params, jnp.asarray(X.numpy()))
  assert out.dtype == jnp.int32
  assert out.tolist() == X.argmax(-1).tolist()


def test_jax_code_written_for_32_bit_mode_inside_bridged_code_still_runs(dev):
  """JAX code the torch code calls may mix int32 with JAX's default integers (int64 in 64-bit
  mode): the function is traced again in 32-bit mode, as it ran before bridged code was traced
  in 64-bit mode, and keeps running bridged (its indices are int32 then)."""
  import jax
  import jax.numpy as jnp

  def shifted(x):
    index = jb.call_jax(lambda i: jax.lax.sub(i, jnp.arange(4)), (x.argmax(-1).int(),))
    return x * index.unsqueeze(-1), x.argmax(-1)

  bridged = jb.bridge(shifted, fallback=False)
  out, index = bridged(X.to(dev))
  torch.testing.assert_close(out.cpu(), X * (X.argmax(-1).int() - torch.arange(4)).unsqueeze(-1))
  assert index.dtype == torch.int32 and not bridged.x64


def test_allclose_gives_a_python_bool_as_torch_does(dev):
  """A bool depends on the values: the region falls back (as for `.item()`), and the code that
  branches on it runs as in plain torch_xla."""
  def pick(a, b):
    return a * 2 if torch.allclose(a, b) else a - b

  bridged = jb.bridge(pick)
  with pytest.warns(jb.errors.FallbackWarning, match="DataDependentError"):
    same = bridged(X.to(dev), X.to(dev))
  torch.testing.assert_close(same.cpu(), X * 2)
  torch.testing.assert_close(bridged(X.to(dev), (X + 1).to(dev)).cpu(), X - (X + 1))
  assert jb.bridge(lambda a: torch.allclose(a, a))(X.to(dev)) is True


PRODUCTS = {  # a matrix product of two float dtypes, as a float32 module given bfloat16 input
    "linear": lambda x, w, b: F.linear(x, w, b),
    "linear_no_bias": lambda x, w, b: F.linear(x, w),
    "matmul": lambda x, w, b: x @ w.t(),
    "batched_matmul": lambda x, w, b: x[None].expand(3, -1, -1) @ w.t(),
    "einsum": lambda x, w, b: torch.einsum("ij,kj->ik", x, w),
    "addmm": lambda x, w, b: torch.addmm(b, x, w.t()),
    "weight_first": lambda x, w, b: w @ x.t(),
}


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16])
def test_a_product_of_two_float_dtypes_has_plain_torch_xlas_dtype_and_value(name, input_dtype,
                                                                           dev):
  """Eager torch refuses these; plain torch_xla gives the first matrix operand's dtype."""
  torch.manual_seed(0)
  x = torch.randn(5, 16).to(input_dtype).requires_grad_()
  w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
  fn = PRODUCTS[name]
  leaves = [t.detach().to(dev).requires_grad_() for t in (x, w, b)]
  plain = fn(*leaves)
  (plain.float().square().sum()).backward()
  plain_grads = [t.grad.cpu() if t.grad is not None else None for t in leaves]
  leaves = [t.detach().to(dev).requires_grad_() for t in (x, w, b)]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    bridged = jb.bridge(fn, fallback=False)(*leaves)
  assert bridged.dtype == plain.dtype
  torch.testing.assert_close(bridged.cpu(), plain.cpu())
  (bridged.float().square().sum()).backward()
  for got, expected in zip(leaves, plain_grads):
    if expected is None:  # not used (a product without the bias)
      assert got.grad is None
    else:
      assert got.grad.dtype == expected.dtype
      torch.testing.assert_close(got.grad.cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target", ["tensor", "view"])
def test_an_in_place_result_torch_refuses_to_cast_raises_torchs_error(target):
  """`int_tensor.sqrt_()`: torch refuses a float result in an integer tensor; torchax wrote it,
  truncated. Now the region falls back and plain torch_xla raises, the tensor unchanged."""
  def region(buf):
    (buf if target == "tensor" else buf[1]).sqrt_()
    return buf.sum()

  with pytest.raises(RuntimeError, match="can't be cast"):
    region(torch.arange(6).reshape(2, 3).to("xla"))
  buf = torch.arange(6).reshape(2, 3).to("xla")
  with pytest.warns(jb.errors.FallbackWarning, match="can't be cast"), \
       pytest.raises(RuntimeError, match="can't be cast"):
    jb.bridge(region)(buf)
  assert buf.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("op", ["mul_", "add_", "div_", "sub_"])
def test_an_in_place_float_result_into_integers_is_plain_torch_xlas_or_its_error(op):
  """`int_tensor.mul_(float_tensor)`: eager refuses; torchax wrote the product truncated. The
  region now falls back, so the result is plain torch_xla's (its value, or its error where it
  raises: `add_`, `sub_`), and strict bridging raises torch's refusal."""
  def region(a, b):
    out = a.clone()
    getattr(out, op)(b)
    return out

  a, b = torch.arange(4).to("xla"), torch.full((4,), 1.5).to("xla")
  with pytest.raises(RuntimeError) as eager:
    region(a.cpu(), b.cpu())
  try:
    plain = region(a, b).cpu()
  except RuntimeError as e:
    plain = e
  with pytest.warns(jb.errors.FallbackWarning):
    if isinstance(plain, RuntimeError):
      with pytest.raises(RuntimeError, match=re.escape(str(plain)[:40])):
        jb.bridge(region)(a, b)
    else:
      assert jb.bridge(region)(a, b).cpu().tolist() == plain.tolist()
  with pytest.raises(jb.errors.JaxTracingError, match="can't be cast|not possible"):
    jb.bridge(region, fallback=False)(a, b)
  assert "can't be cast" in str(eager.value)
