"""Shared fixtures: the XLA device, a clean `call_jax` cache per test, recipe runs shared by the
tests that read them, and the 4-device SPMD checks started in the background at session start.
"""
import json
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
# torch_xla keeps up to 2048 compiled programs, and XLA:CPU maps each one's code: a process running
# hundreds of tests ran past the kernel's memory-map limit (vm.max_map_count 65530) and crashed.
# The tests reuse only the programs of their own test: 256 kept programs bound the maps.
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "256")

import pytest  # noqa: E402
import torch_xla_jaxbridge as jb  # noqa: E402
import torch_xla  # noqa: E402

HERE = pathlib.Path(__file__).parent


@pytest.fixture
def dev():
  return torch_xla.device()


@pytest.fixture(autouse=True)
def fresh_cache():
  jb.clear_cache()
  yield
  torch_xla.sync()


@pytest.fixture(scope="session")
def recipe_run(tmp_path_factory):
  """`run(*overrides)`: (losses, out dir) of a 3-step recipe run, trained once per session."""
  from torch_xla_jaxbridge.recipes import config, train

  runs = {}

  def run(*overrides):
    if overrides not in runs:
      out = tmp_path_factory.mktemp("recipe")
      cfg = config.load(["train.steps=3", "train.checkpoint_every=0", f"out={out}", *overrides])
      runs[overrides] = train.train(cfg, log=lambda line: None), out
    losses, out = runs[overrides]
    return list(losses), out

  return run


class SpmdRun:
  """A 4-device check script (test/spmd_check.py, test/shard_map_check.py) in its own process
  (SPMD is process-global): 4 virtual CPU devices."""

  def __init__(self, out, script="spmd_check.py"):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=4").strip())
    self.stdout, self.stderr = out / "stdout.txt", out / "stderr.txt"
    with open(self.stdout, "w") as stdout, open(self.stderr, "w") as stderr:  # files: no pipe fills
      self.process = subprocess.Popen([sys.executable, str(HERE / script), str(out)],
                                      env=env, stdout=stdout, stderr=stderr, cwd=HERE.parent)

  def wait(self, timeout=600):
    """The exit code, stdout and the end of stderr."""
    code = self.process.wait(timeout)
    return code, self.stdout.read_text(), self.stderr.read_text()[-4000:]


def _facts(run):
  """The JSON facts a check script printed last, after it exited cleanly."""
  code, stdout, stderr = run.wait()
  assert code == 0, stderr
  return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def facts(spmd_run):
  """The facts of test/spmd_check.py (test_spmd.py, test_checkpoint.py)."""
  return _facts(spmd_run)


@pytest.fixture(scope="session")
def shard_map_facts(shard_map_run):
  """The facts of test/shard_map_check.py (test_shard_map.py)."""
  return _facts(shard_map_run)


def _started(request, tmp_path_factory, fixture, script):
  """The check script's run, started before the first test when a test needs `fixture` (so the
  4-device process runs on the second core while the other tests run); None otherwise."""
  if not any(fixture in item.fixturenames for item in request.session.items):
    yield None
    return
  run = SpmdRun(tmp_path_factory.mktemp(fixture), script)
  yield run
  if run.process.poll() is None:
    run.process.kill()
    run.process.wait()


@pytest.fixture(scope="session", autouse=True)
def spmd_run(request, tmp_path_factory):
  """test/spmd_check.py, for test_spmd.py's `facts`."""
  yield from _started(request, tmp_path_factory, "facts", "spmd_check.py")


@pytest.fixture(scope="session", autouse=True)
def shard_map_run(request, tmp_path_factory):
  """test/shard_map_check.py, for test_shard_map.py's `shard_map_facts`."""
  yield from _started(request, tmp_path_factory, "shard_map_facts", "shard_map_check.py")
