"""Shared fixtures: the XLA device and a clean `call_jax` cache per test.

XLA's CPU backend compiles at optimization level 0 here (most of the suite's time is XLA
compiling training steps; the tests check the bridge, not XLA's code generation). Set
`XLA_FLAGS=--xla_backend_optimization_level=2` to run the suite against optimized code.
"""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 " +
                             os.environ.get("XLA_FLAGS", "")).strip()

import pytest  # noqa: E402
import torch_xla_jaxbridge as jb  # noqa: E402
import torch_xla  # noqa: E402


@pytest.fixture
def dev():
  return torch_xla.device()


@pytest.fixture(autouse=True)
def fresh_cache():
  jb.clear_cache()
  yield
  torch_xla.sync()
