"""Device selection: PJRT_DEVICE=CPU by default, the user's choice otherwise, and JAX import order."""
import os
import subprocess
import sys

PROBE = ("import torch_xla_jaxbridge, os, torch_xla, torch_xla.runtime as xr, jax\n"
         "print(os.environ.get('PJRT_DEVICE'), xr.device_type(), jax.config.jax_enable_x64)\n")


def run(env):
  clean = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "TPU_NUM_DEVICES",
                                                            "GPU_NUM_DEVICES")}
  out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True,
                       text=True, check=True)
  return out.stdout.split(), out.stderr


def test_cpu_is_the_default_without_a_warning():
  (chosen, device, x64), stderr = run({})
  assert (chosen, device, x64) == ("CPU", "CPU", "False")
  assert "Defaulting to PJRT_DEVICE" not in stderr


def test_user_choice_is_kept(monkeypatch):
  from torch_xla_jaxbridge import runtime
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


def test_jax_imported_first_still_works():
  code = ("import jax, jax.numpy as jnp, torch\n"
          "import torch_xla_jaxbridge as jb\n"
          "x = torch.ones(2, device='xla')\n"
          "print(jb.call_jax(lambda a: a + jnp.float32(1), (x,)).cpu().tolist())\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[2.0, 2.0]"
