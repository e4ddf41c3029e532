"""A process trains model after model: 50 distinct small models, each dropped after three steps,
through the package and through plain torch_xla, each in a fresh process (test/long_lived_check.py).
What the package keeps goes with each model; what the process grows by is torch_xla's cache of
compiled programs, and bounding that cache levels the process off."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
MODELS = 50


def _run(mode, **env):
  """The per-model rows test/long_lived_check.py prints for `mode` in a fresh process."""
  process = subprocess.run(
      [sys.executable, str(ROOT / "test" / "long_lived_check.py"), mode, str(MODELS)],
      cwd=ROOT, env={**os.environ, "PJRT_DEVICE": "CPU", **env}, capture_output=True,
      text=True, timeout=1800)
  assert process.returncode == 0, process.stderr[-4000:]
  return json.loads(process.stdout.strip().splitlines()[-1])


def _growth(rows, key, first=10):
  """How much `key` grew from model `first` to the last model."""
  return rows[-1][key] - rows[first][key]


@pytest.mark.slow  # 2 x 50 models with torch_xla's default cache, 50 with a bounded one
def test_fifty_models_in_one_process_keep_nothing_and_level_off_with_a_bounded_cache():
  plain = _run("plain")
  bridged = _run("bridged")
  assert all(row["freed"] for row in bridged)
  assert {row["traces"] for row in bridged[1:]} == {bridged[1]["traces"]}  # back where it was
  assert {row["report_rows"] for row in bridged} == {0}  # each model's rows went with it
  # what grows is torch_xla's cache of compiled programs: no more programs, no more maps than
  # plain torch_xla's (resident memory grows more: each bridged program is bigger, see
  # docs/performance.md "Model after model")
  assert _growth(bridged, "xla_programs") <= 1.25 * _growth(plain, "xla_programs")
  assert _growth(bridged, "maps") <= 1.25 * _growth(plain, "maps") + 200
  # bounded, the cache levels the process off: the last ten models add next to nothing
  bounded = _run("bridged", XLA_COMPILATION_CACHE_SIZE="16")
  assert all(row["freed"] for row in bounded)
  assert max(row["xla_programs"] for row in bounded) <= 16
  assert _growth(bounded, "maps", first=MODELS - 10) <= 100
  assert _growth(bounded, "rss_mb", first=MODELS - 10) <= 25
