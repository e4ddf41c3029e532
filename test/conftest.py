"""Shared fixtures: the XLA device and a clean `call_jax` cache per test."""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

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
