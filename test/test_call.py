"""call_jax: numerics against NumPy, pytrees, the cache, dtypes and bad input."""
import copy
import gc
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge import errors


def xla(array, dev):
  return torch.from_numpy(np.asarray(array)).to(dev)


RNG = np.random.default_rng(0)
A = RNG.standard_normal((4, 5)).astype(np.float32)
B = RNG.standard_normal((5, 3)).astype(np.float32)


@pytest.mark.parametrize("fn, ref", [
    (lambda a: jnp.sin(a) * 2 + 1, lambda a: np.sin(a) * 2 + 1),
    (lambda a: jnp.exp(-a * a), lambda a: np.exp(-a * a)),
    (lambda a: jnp.sum(a, axis=1), lambda a: a.sum(axis=1)),
    (lambda a: jnp.max(a) - jnp.mean(a), lambda a: a.max() - a.mean()),
])
def test_elementwise_and_reductions_match_numpy(dev, fn, ref):
  out = jb.call_jax(fn, (xla(A, dev),))
  np.testing.assert_allclose(out.cpu().numpy(), ref(A), rtol=1e-5, atol=1e-6)


def test_matmul_matches_numpy(dev):
  out = jb.call_jax(jnp.matmul, (xla(A, dev), xla(B, dev)))
  np.testing.assert_allclose(out.cpu().numpy(), A @ B, rtol=1e-5, atol=1e-5)


def test_pytrees_in_and_out(dev):
  def fn(params, xs, scale, nothing=None, *, bias):
    assert nothing is None
    return {"y": params["w"] @ xs[0] * scale + bias, "pair": (xs[1], [xs[0].sum()])}

  params = {"w": xla(B.T, dev)}
  out = jb.call_jax(fn, (params, [xla(A[0], dev), xla(A[1], dev)], 3.0, None),
                    {"bias": xla(np.ones(3, np.float32), dev)})
  assert set(out) == {"y", "pair"} and isinstance(out["pair"], tuple)
  np.testing.assert_allclose(out["y"].cpu().numpy(), B.T @ A[0] * 3 + 1, rtol=1e-5)
  np.testing.assert_allclose(out["pair"][0].cpu().numpy(), A[1])
  np.testing.assert_allclose(out["pair"][1][0].cpu().numpy(), A[0].sum(), rtol=1e-5)


def test_torch_dtype_and_numpy_statics(dev):
  def fn(x, dtype, table):
    return (x * table).astype(dtype)

  out = jb.call_jax(fn, (xla(A[0], dev), torch.bfloat16, np.arange(5, dtype=np.float32)))
  assert out.dtype == torch.bfloat16
  np.testing.assert_allclose(out.float().cpu().numpy(), A[0] * np.arange(5), rtol=1e-2)
  jb.call_jax(fn, (xla(A[0], dev), torch.bfloat16, np.arange(5, dtype=np.float32)))
  assert jb.cache_info().hits == 1


def test_one_ir_node_named_after_the_function(dev):
  def my_kernel(a, b):
    return a @ b + 1

  out = jb.call_jax(my_kernel, (xla(A, dev), xla(B, dev)))
  ir = torch_xla._XLAC._get_xla_tensors_text([out])
  assert ir.count("xla::my_kernel(") == 1
  named = jb.call_jax(my_kernel, (xla(A, dev), xla(B, dev)), name="proj")
  assert "xla::proj(" in torch_xla._XLAC._get_xla_tensors_text([named])


def _node_operands(out, name):
  """The operand count of the node `xla::<name>` in `out`'s IR."""
  line = next(l for l in torch_xla._XLAC._get_xla_tensors_text([out]).splitlines()
              if f"xla::{name}(" in l)
  return line.split(f"xla::{name}(")[1].split(")")[0].count("%")


def test_an_input_the_function_never_reads_is_not_an_input_of_the_node(dev):
  def first_and_third(a, b, c):
    return a * 2 + c

  a, b, c = xla(A, dev), xla(A + 1, dev), xla(A + 2, dev)
  out = jb.call_jax(first_and_third, (a, b, c))
  assert _node_operands(out, "first_and_third") == 2
  np.testing.assert_allclose(out.cpu().numpy(), A * 2 + (A + 2), rtol=1e-6)
  out = jb.call_jax(first_and_third, (a, b, c))  # the cached program: the same two inputs
  assert _node_operands(out, "first_and_third") == 2 and jb.cache_info().hits == 1
  np.testing.assert_allclose(out.cpu().numpy(), A * 2 + (A + 2), rtol=1e-6)
  constant = jb.call_jax(lambda x, y: jnp.ones(2), (a, b), name="constant")  # reads none
  assert _node_operands(constant, "constant") == 2  # a node takes one input at least: all
  np.testing.assert_allclose(constant.cpu().numpy(), np.ones(2))


def test_no_outputs_and_passthrough(dev):
  x = xla(A, dev)
  assert jb.call_jax(lambda a: None, (x,)) is None
  same = jb.call_jax(lambda a, b: (b, a), (x, x + 1))
  np.testing.assert_allclose(same[1].cpu().numpy(), A)


# --- the cache ---------------------------------------------------------------------------------

def double(x):
  return x * 2


def test_hit_on_same_signature_and_reasons_on_changes(dev):
  x4 = xla(np.ones((4, 4), np.float32), dev)
  jb.call_jax(double, (x4,))
  jb.call_jax(double, (x4 + 1,))
  assert jb.cache_info()[:2] == (1, 1)
  jb.call_jax(double, (xla(np.ones((8, 4), np.float32), dev),))
  jb.call_jax(double, (xla(np.ones((8, 4), np.int32), dev),))
  jb.call_jax(double, ([x4],))
  info = jb.cache_info()
  assert (info.hits, info.misses, info.currsize) == (1, 4, 4)
  assert info.retrace_reasons[0] == "double: args[0] shape (4, 4) -> (8, 4)"
  assert info.retrace_reasons[1] == "double: args[0] dtype torch.float32 -> torch.int32"
  assert info.retrace_reasons[2].startswith("double: pytree structure")


def test_static_and_config_changes_retrace(dev, caplog):
  def scaled(x, k):
    return x * k

  x = xla(A, dev)
  with caplog.at_level(logging.DEBUG, logger="torch_xla_jaxbridge.lowering"):
    jb.call_jax(scaled, (x, 2))
    jb.call_jax(scaled, (x, 2.0))  # same value, other type: a different program
    with jax.default_matmul_precision("highest"):
      jb.call_jax(scaled, (x, 2.0))
  reasons = jb.cache_info().retrace_reasons
  assert reasons[0] == "scaled: args[1] static value 2 (int) -> 2.0 (float)"
  assert reasons[1].startswith("scaled: JAX config changed")
  assert "re-trace: scaled: args[1] static value" in caplog.text


def test_output_structure_is_stored_per_signature(dev):
  def maybe_pair(a, flag):
    return (a, a * 2) if flag else a

  x = xla(A, dev)
  for flag in (True, False, True, False):
    out = jb.call_jax(maybe_pair, (x, flag))
    assert isinstance(out, tuple) == flag
  assert jb.cache_info()[:2] == (2, 2)


def test_fresh_closures_over_plain_values_hit_and_stay_bounded(dev):
  x = xla(A, dev)
  refs = []
  for step in range(10_000):
    scale = 3.0
    fn = lambda a: a * scale  # noqa: E731  (redefined every step on purpose)
    refs.append(weakref.ref(fn))
    out = jb.call_jax(fn, (x,))
  np.testing.assert_allclose(out.cpu().numpy(), A * 3, rtol=1e-6)
  gc.collect()
  info = jb.cache_info()
  assert (info.misses, info.hits, info.currsize) == (1, 9_999, 1)
  assert sum(r() is not None for r in refs) <= 1  # the cache holds none of them


def test_closures_over_changing_values_stay_bounded(dev):
  x = xla(A, dev)
  for step in range(jb.cache_info().maxsize + 6):
    out = jb.call_jax(lambda a: a * step, (x,))
  np.testing.assert_allclose(out.cpu().numpy(), A * step, rtol=1e-6)
  info = jb.cache_info()
  assert info.currsize == info.maxsize
  assert info.retrace_reasons[-1] == "_lambda_: closed-over values or defaults changed"


def test_functions_held_weakly(dev):
  x = xla(A, dev)
  refs = []
  for _ in range(200):
    holder = {}
    fn = lambda a: a * len(holder)  # noqa: E731  (captures a dict: keyed by identity)
    refs.append(weakref.ref(fn))
    jb.call_jax(fn, (x,))
  gc.collect()
  assert jb.cache_info().currsize <= 1
  assert sum(r() is not None for r in refs) <= 1


def test_bound_methods_key_on_their_instance(dev):
  class Scaler:
    def __init__(self, k):
      self.k = k

    def apply(self, a):
      return a * self.k

  x = xla(A, dev)
  two, three = Scaler(2.0), Scaler(3.0)
  np.testing.assert_allclose(jb.call_jax(two.apply, (x,)).cpu().numpy(), A * 2, rtol=1e-6)
  np.testing.assert_allclose(jb.call_jax(three.apply, (x,)).cpu().numpy(), A * 3, rtol=1e-6)
  jb.call_jax(two.apply, (x,))
  assert jb.cache_info()[:2] == (1, 2)
  del two, three
  gc.collect()
  assert jb.cache_info().currsize == 0


def test_unhashable_static_is_named(dev):
  class Config:
    __hash__ = None

  with pytest.raises(errors.BadArgumentError, match=r"_lambda_: args\[1\]\['cfg'\] is a Config, "
                     r"which is not hashable"):
    jb.call_jax(lambda a, opts: a, (xla(A, dev), {"cfg": Config()}))


# --- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.int16, torch.int32, torch.bool, torch.int64,
                                   torch.float64, torch.uint8])
def test_dtype_matrix(dev, dtype):
  base = torch.arange(-6, 6).reshape(3, 4)
  x = (base > 0) if dtype == torch.bool else base.abs().to(dtype)
  out = jb.call_jax(lambda a: (a, a.max(axis=0)), (x.to(dev),))
  assert out[0].dtype == dtype and out[1].dtype == dtype
  torch.testing.assert_close(out[0].cpu(), x)
  torch.testing.assert_close(out[1].cpu(), x.max(dim=0).values)


def test_int64_values_beyond_int32_survive_without_global_x64(dev):
  big = torch.tensor([2**40 + 3, -(2**35)], dtype=torch.int64)
  out = jb.call_jax(lambda a: a + 1, (big.to(dev),))
  torch.testing.assert_close(out.cpu(), big + 1)
  assert not jax.config.jax_enable_x64  # traced with x64 locally, not globally


# --- bad input ---------------------------------------------------------------------------------

def test_cpu_tensor_is_named(dev):
  with pytest.raises(errors.BadArgumentError,
                     match=r"add_one: args\[0\]\['x'\] is a cpu tensor; call_jax takes XLA "
                     r"tensors. Move it with `.to\('xla'\)`"):
    jb.call_jax(lambda d: d["x"] + 1, ({"x": torch.ones(2)},), name="add_one")


def project(a, w):
  return jnp.einsum("ij,jk->ik", a, w)


def test_wrong_rank_call_of_cached_function(dev):
  jb.call_jax(project, (xla(A, dev), xla(B, dev)))
  with pytest.raises(errors.JaxTracingError,
                     match=r"project raised while being traced for \(args\[0\]: \(4, 5\) "
                     r"torch.float32, args\[1\]: \(5,\) torch.float32\): ValueError: .*"):
    jb.call_jax(project, (xla(A, dev), xla(B[:, 0], dev)))
  assert jb.cache_info().currsize == 1


def test_function_raising_while_tracing(dev):
  def broken(a):
    raise ValueError("no such layer")

  with pytest.raises(errors.JaxTracingError, match=r"broken raised while being traced for "
                     r"\(args\[0\]: \(4, 5\) torch.float32\): ValueError: no such layer"):
    jb.call_jax(broken, (xla(A, dev),))
  assert jb.cache_info().currsize == 0


def test_signatures_beyond_the_limit_evict_the_least_recently_used(dev, monkeypatch):
  from torch_xla_jaxbridge._core import lowering
  monkeypatch.setattr(lowering, "MAX_SIGNATURES_PER_FUNCTION", 2)

  def double(x):
    return x * 2

  calls = []
  for n in (1, 2, 1, 3, 1, 2):  # the hit on 1 makes 2 the least recently used: 3 evicts it
    before = jb.cache_info()
    jb.call_jax(double, (torch.ones(n, device=dev),))
    calls.append("hit" if jb.cache_info().hits > before.hits else "miss")
  assert calls == ["miss", "miss", "hit", "miss", "hit", "miss"]


class _SixOutputs(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)

  def forward(self, x):
    y = self.lin(x)
    return y, y * 2, y.sin(), y.cos(), y.exp(), y.tanh()


def test_under_torch_xlas_eager_mode_a_call_runs_as_one_program(dev):
  """Eager mode runs each new tensor's graph as it is made: a node with six outputs (and its
  vjp residuals) ran once per output, 14 programs a call. Now one, with plain eager mode's
  values, and the mode is the caller's after."""
  import torch_xla.core.xla_model as xm
  import torch_xla.debug.metrics as met
  from torch_xla.experimental import eager as eager_mode

  torch.manual_seed(0)
  model, x = _SixOutputs(), torch.randn(3, 4)
  plain, bridged = model.to(dev), jb.BridgeModule(copy.deepcopy(model).to(dev))
  runs = lambda: sum((met.metric_data(n) or [0])[0]  # noqa: E731
                     for n in ("ExecuteTime", "EagerOpExecuteTime"))
  with eager_mode.eager_mode_context(True):
    x = x.to(dev)
    expected = [t.cpu() for t in plain(x)]
    bridged(x)  # traced and compiled
    xm.wait_device_ops()  # the metrics count an execution when it ends
    before = runs()
    outputs = bridged(x)
    xm.wait_device_ops()
    ran = runs() - before
    sum(o.sum() for o in outputs).backward()
    assert eager_mode.is_eager_mode()
  assert ran == 1
  for got, want in zip(outputs, expected):
    torch.testing.assert_close(got.cpu(), want)
  assert bridged.lin.weight.grad is not None
