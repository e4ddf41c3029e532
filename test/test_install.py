"""The installed stack: the pinned torchax is the one imported, and it does not need flax."""
import importlib.metadata
import pathlib
import re
import subprocess
import sys

SETUP = (pathlib.Path(__file__).parents[1] / "setup.py").read_text()


def pinned(name):
  return re.search(rf'"{name}==([^"]+)"', SETUP).group(1)


def test_pinned_versions_are_installed():
  for dist in ("torch", "torch_xla", "jax", "jaxlib", "torchax"):
    assert importlib.metadata.version(dist).split("+")[0] == pinned(dist), dist


def test_torchax_imports_cleanly_in_a_fresh_interpreter():
  code = ("import sys, torch, torchax, torchax.interop, jax.numpy as jnp\n"
          "states, fn = torchax.extract_jax(torch.nn.Linear(3, 2))\n"
          "assert fn(states, (jnp.ones((4, 3)),)).shape == (4, 2)\n"
          "assert 'flax' not in sys.modules, 'torchax pulled in flax'\n"
          "print(torchax.__version__, torchax.__file__)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  version, path = out.stdout.split()
  assert version == pinned("torchax")
  files = importlib.metadata.files("torchax")
  assert any(str(f).endswith("torchax/__init__.py") and f.locate().samefile(path) for f in files)
