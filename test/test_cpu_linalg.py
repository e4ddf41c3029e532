"""Linear algebra in bridged code and `call_jax` on torch_xla's CPU runtime: what has a portable
lowering runs (no jaxlib LAPACK call) with eager torch's values and gradients; what has none is
refused when the node is lowered, before anything runs, and a bridged region falls back."""
import warnings

import jax
import pytest
import torch

import torch_xla_jaxbridge as jb

SPD = torch.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
B = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]])

FUNCTIONS = {  # torch code a model may call; each lowers to a LAPACK call by default on CPU
    "cholesky": lambda a, b: torch.linalg.cholesky(a),
    "cholesky_solve": lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
    "solve_triangular": lambda a, b: torch.linalg.solve_triangular(a.tril(), b, upper=False),
    "solve": lambda a, b: torch.linalg.solve(a, b),
    "inv": lambda a, b: torch.linalg.inv(a),
    "qr": lambda a, b: torch.linalg.qr(a @ a.T + a)[1],
    "lu_factor": lambda a, b: torch.linalg.lu_factor(a)[0],
    "slogdet": lambda a, b: torch.linalg.slogdet(a)[1],
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_linear_algebra_runs_bridged_with_eagers_values_and_gradients(name, dev):
  fn = FUNCTIONS[name]
  a, b = SPD.clone().requires_grad_(), B.clone().requires_grad_()
  expected = fn(a, b)
  expected.sum().backward()
  xa, xb = (t.detach().to(dev).requires_grad_() for t in (SPD, B))
  before = jb.bridge_report()
  got = jb.bridge(fn, name=name, fallback=False)(xa, xb)
  got.sum().backward()
  torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
  torch.testing.assert_close(xa.grad.cpu(), a.grad, rtol=1e-3, atol=1e-4)
  assert [r.status for r in jb.bridge_report(since=before).rows] == ["bridged"]
  forward, backward = jb.lower_bridged(fn, SPD.to(dev), B.to(dev), platform="cpu")
  assert "lapack" not in forward + backward


def test_call_jax_refuses_a_lapack_call_before_anything_runs(dev):
  x = SPD.to(dev)
  with pytest.raises(jb.errors.NoLoweringError, match=r"lapack_\w*geev_ffi.*torch_xla's runtime"):
    jb.call_jax(lambda a: jax.numpy.linalg.eigvals(a).real, (x,))


def test_a_bridged_region_without_a_portable_lowering_falls_back_with_the_reason(dev):
  fn = lambda a: torch.linalg.eigvals(a).real  # noqa: E731  (LAPACK's geev only)
  before = jb.bridge_report()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    got = jb.bridge(fn, name="eigenvalues")(SPD.to(dev))
  torch.testing.assert_close(got.cpu().sort().values, fn(SPD).sort().values)
  (row,) = jb.bridge_report(since=before).rows
  assert row.status == "fallback" and "lapack_sgeev_ffi" in row.reason


def test_jax_code_outside_the_package_keeps_its_lapack_lowering(dev):
  jb.call_jax(lambda a: jax.numpy.linalg.cholesky(a), (SPD.to(dev),))
  spd = jax.ShapeDtypeStruct((3, 3), "float32")
  assert "lapack_spotrf_ffi" in jax.jit(jax.numpy.linalg.cholesky).lower(spd).as_text()
  assert jax.numpy.allclose(jax.numpy.linalg.cholesky(SPD.numpy()),
                            torch.linalg.cholesky(SPD).numpy())


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_reads_torchs_triangle_and_gives_torchs_symmetric_gradient(upper, dev):
  unread = torch.tensor([[0.0, 5.0, -2.0], [0.0, 0.0, 7.0], [0.0, 0.0, 0.0]])  # strictly upper
  a = (SPD + (unread.T if upper else unread)).requires_grad_()  # torch reads the other triangle
  expected = torch.linalg.cholesky(a, upper=upper)
  (expected * B[:, :1].T).sum().backward()
  x = a.detach().to(dev).requires_grad_()
  got = jb.bridge(lambda t: torch.linalg.cholesky(t, upper=upper), fallback=False)(x)
  (got * B[:, :1].T.to(dev)).sum().backward()
  torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
  torch.testing.assert_close(x.grad.cpu(), a.grad, rtol=1e-3, atol=1e-4)


def test_cholesky_ex_says_which_minor_is_not_positive_definite(dev):
  batch = torch.stack([SPD, torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])])
  got = jb.bridge(torch.linalg.cholesky_ex, fallback=False)(batch.to(dev))
  expected = torch.linalg.cholesky_ex(batch)
  assert got.info.dtype == torch.int32
  assert got.info.cpu().tolist() == expected.info.tolist() == [0, 2]
  torch.testing.assert_close(got.L[0].cpu(), expected.L[0])
  with pytest.raises(jb.errors.DataDependentError, match="check_errors=True"):
    jb.bridge(lambda t: torch.linalg.cholesky_ex(t, check_errors=True), fallback=False)(
        batch.to(dev))


def test_a_primitive_without_a_generic_lowering_keeps_its_own(monkeypatch):
  """JAX without a platform-independent rule for a primitive: its CPU rule is left as it is (the
  LAPACK call is then refused at lowering and the region falls back), not wrapped over None."""
  from torch_xla_jaxbridge._compat import jax_lowering_private
  from torch_xla_jaxbridge._core import cpu_linalg

  wrapped = []
  monkeypatch.setattr(jax_lowering_private, "generic_lowering_rule", lambda primitive: None)
  monkeypatch.setattr(jax_lowering_private, "wrap_cpu_lowering",
                      lambda primitive, wrap: wrapped.append(primitive))
  cpu_linalg._install.__wrapped__()  # the set-up itself, not its run-once wrapper
  assert wrapped == []
