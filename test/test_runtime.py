"""Device selection: PJRT_DEVICE=CPU by default, the user's choice otherwise, JAX import order, and
the process left as plain torch_xla leaves it."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[1]  # the working directory: this checkout's package
PROBE = ("import torch_xla_jaxbridge, os, torch_xla, torch_xla.runtime as xr, jax\n"
         "print(os.environ.get('PJRT_DEVICE'), xr.device_type(), jax.config.jax_enable_x64)\n")
JAX_FIRST = ("import jax, jax.numpy as jnp, torch\n"
             "import torch_xla_jaxbridge as jb\n"
             "x = torch.ones(2, device='xla')\n"
             "print(jb.call_jax(lambda a: a + jnp.float32(1), (x,)).cpu().tolist())\n")


def start(code, env):
  return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def fresh_interpreters():
  """(exit code, stdout, stderr) of each fresh interpreter, started together (each spends seconds
  importing the stack)."""
  clean = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "TPU_NUM_DEVICES",
                                                            "GPU_NUM_DEVICES")}
  running = {"probe": start(PROBE, clean), "jax_first": start(JAX_FIRST, dict(os.environ))}
  outputs = {name: process.communicate(timeout=300) for name, process in running.items()}
  return {name: (running[name].returncode, *outputs[name]) for name in running}


def test_cpu_is_the_default_without_a_warning(fresh_interpreters):
  code, stdout, stderr = fresh_interpreters["probe"]
  assert code == 0, stderr[-4000:]
  chosen, device, x64 = stdout.split()
  assert (chosen, device, x64) == ("CPU", "CPU", "False")
  assert "Defaulting to PJRT_DEVICE" not in stderr


def test_user_choice_is_kept(monkeypatch):
  from torch_xla_jaxbridge._core import runtime
  monkeypatch.setenv("PJRT_DEVICE", "TPU")
  runtime.default_to_cpu()
  assert os.environ["PJRT_DEVICE"] == "TPU"
  monkeypatch.delenv("PJRT_DEVICE")
  monkeypatch.setenv("GPU_NUM_DEVICES", "1")
  runtime.default_to_cpu()
  assert "PJRT_DEVICE" not in os.environ
  monkeypatch.delenv("GPU_NUM_DEVICES")
  runtime.default_to_cpu()
  assert os.environ["PJRT_DEVICE"] == "CPU"


def test_jax_imported_first_still_works(fresh_interpreters):
  code, stdout, stderr = fresh_interpreters["jax_first"]
  assert code == 0, stderr[-4000:]
  assert stdout.strip() == "[2.0, 2.0]"


def test_bridged_training_leaves_the_process_as_plain_torch_xla_does():
  """torch's accelerator and device registry, `DataLoader(pin_memory=True)` (here and in another
  thread), default dtype and device, mode stacks, autocast, environment variables, threads,
  loggers, warning filters, the garbage collector, the torch/NumPy/Python/XLA random streams
  and JAX's options: after four steps trained through `bridge_modules`, `bridge` and
  `train_step`, as after the same steps in plain torch_xla (each in a fresh process)."""
  script = str(ROOT / "test" / "process_state_check.py")
  running = {mode: subprocess.Popen([sys.executable, script, mode], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for mode in ("plain", "bridged")}
  seen = {}
  for mode, process in running.items():
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-4000:]
    seen[mode] = json.loads(stdout)
  plain, bridged = seen["plain"], seen["bridged"]
  assert plain["pinned batches"]["other thread"] == [[0, 1], [2, 3]]
  assert plain["accelerator"] != "jax"
  assert {k: v for k, v in bridged.items() if plain[k] != v} == {}


def test_traces_run_with_the_garbage_collector_paused():
  """A trace runs without cyclic collections (they took a fifth of a deep step's trace), and
  the collector is after it as it was before: on, or off where the user turned it off, also
  when the trace raises."""
  import gc
  import jax.numpy as jnp
  import torch_xla_jaxbridge as jb
  seen = []

  def traced(a):
    seen.append(gc.isenabled())
    return a + jnp.float32(1)

  try:
    assert jb.call_jax(traced, (torch.ones(3, device="xla"),)).cpu().tolist() == [2.0] * 3
    assert seen == [False] and gc.isenabled()
    gc.disable()
    jb.call_jax(traced, (torch.ones(4, device="xla"),))
    assert seen == [False, False] and not gc.isenabled()
    gc.enable()
    with pytest.raises(jb.errors.JaxTracingError, match="broken"):
      jb.call_jax(lambda a: (seen.append(gc.isenabled()), 1 / 0), (torch.ones(5, device="xla"),),
                  name="broken")
    assert seen == [False, False, False] and gc.isenabled()
  finally:
    gc.enable()
