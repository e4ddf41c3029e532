"""PyTorch's operator database through bridged code (test/opinfo.py), a subset: every op that
once failed in bridged code where LazyTensor passed, and a spread of the rest. Bridged code
passes (types, dtypes, values, gradients against eager CPU torch) wherever plain LazyTensor code
does, or falls back, reported. The full sweep (scripts/opinfo_sweep.py, docs/operators.md) is
slow: `make slow`."""
import json
import pathlib
import subprocess
import sys

import pytest

import opinfo

ROOT = pathlib.Path(__file__).parents[1]

# Ops whose bridged forward or backward once failed (or, searchsorted, fell back) where
# LazyTensor's passed: they must pass now.
ONCE_FAILED = [
    "cummax", "cummin", "kthvalue", "max.reduction_with_dim", "min.reduction_with_dim", "median",
    "nanmedian", "softmax.with_dtype", "nn.functional.softmin.with_dtype", "cholesky", "lu",
    "lu_solve", "qr", "triangular_solve", "as_strided_scatter", "polygamma.polygamma_n_3",
    "digamma", "torch.ops.aten._safe_softmax.default", "native_layer_norm", "matrix_exp",
    "searchsorted",
]
# Ops that fall back (reported) where torch's result needs the values on the host.
FALLS_BACK = ["allclose", "item"]
SPREAD = [name for name in list(opinfo.OPS)[::40] if name not in ONCE_FAILED + FALLS_BACK]


@pytest.mark.parametrize("name", ONCE_FAILED)
def test_an_op_that_once_failed_runs_bridged_as_eager(name):
  outcome = opinfo.check(opinfo.OPS[name])
  for direction in ("forward", "backward"):
    status, detail = outcome[direction]["bridged"]
    assert status == "pass" or (status == "n/a" and outcome[direction]["lazy"][0] == "n/a"), (
        direction, detail)


def test_as_strided_scatters_gradient_is_the_numerical_one_where_torchs_is_not():
  outcome = opinfo.check(opinfo.OPS["as_strided_scatter"])
  assert outcome["backward"]["bridged"] == [
      "pass", "equal to the float64 numerical gradient, where eager's is not"]


@pytest.mark.parametrize("name", FALLS_BACK)
def test_an_op_with_a_python_result_falls_back_and_gives_torchs_type(name):
  outcome = opinfo.check(opinfo.OPS[name])
  assert outcome["forward"]["lazy"] == ["pass", ""]
  status, detail = outcome["forward"]["bridged"]
  assert status == "fallback" and "DataDependentError" in detail


@pytest.mark.parametrize("name", SPREAD)
def test_bridged_code_passes_or_falls_back_wherever_lazytensor_passes(name):
  outcome = opinfo.check(opinfo.OPS[name])
  for direction in ("forward", "backward"):
    if outcome[direction]["lazy"][0] == "pass":
      assert outcome[direction]["bridged"][0] in ("pass", "fallback"), (
          direction, outcome[direction]["bridged"])


@pytest.mark.slow
def test_the_full_sweep_finds_no_op_where_bridged_code_is_worse_than_lazytensor(tmp_path):
  out = tmp_path / "sweep.json"
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "opinfo_sweep.py"), "--json",
                         str(out)], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())["ops"]
  assert len(rows) == len(opinfo.OPS)
  worse = [(row["op"], direction, row[direction]["bridged"]) for row in rows
           for direction in ("forward", "backward")
           if row[direction]["lazy"][0] == "pass" and row[direction]["bridged"][0] == "fail"]
  assert not worse, worse
