"""A process trains model after model: 50 distinct small models, each dropped after three steps,
through the package and through plain torch_xla, each in a fresh process (test/long_lived_check.py).
What the package keeps goes with each model; what the process grows by is torch_xla's cache of
compiled programs, as in plain torch_xla, and bounding that cache keeps the process flat."""
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
def test_fifty_models_in_one_process_grow_only_as_plain_torch_xla_does():
  plain = _run("plain")
  bridged = _run("bridged")
  assert all(row["freed"] for row in bridged)
  assert {row["traces"] for row in bridged[1:]} == {bridged[1]["traces"]}  # back where it was
  assert {row["report_rows"] for row in bridged} == {0}  # each model's rows went with it
  # what grows is torch_xla's program cache, by as much as for plain torch_xla's programs
  assert _growth(bridged, "xla_programs") <= 1.25 * _growth(plain, "xla_programs")
  assert _growth(bridged, "maps") <= 1.25 * _growth(plain, "maps") + 200
  assert _growth(bridged, "rss_mb") <= 1.25 * _growth(plain, "rss_mb") + 20
  # bounded, the cache keeps the process flat: the second half of the models adds nothing
  bounded = _run("bridged", XLA_COMPILATION_CACHE_SIZE="16")
  assert all(row["freed"] for row in bounded)
  assert max(row["xla_programs"] for row in bounded) <= 16
  assert _growth(bounded, "maps", first=MODELS // 2) <= 100
  assert _growth(bounded, "rss_mb", first=MODELS // 2) <= 20
