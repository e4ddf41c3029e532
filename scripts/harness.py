"""The benchmarks' shared harness: each mode in a fresh process, modes alternated over rounds,
medians with their spread, a printed table and JSON.

A benchmark script runs itself as the child (`python SCRIPT --child ARGS...`), which prints one
JSON object on its last line; the parent calls `rounds(...)` and `summary(...)`.

  from harness import rounds, spread, table, write_json
"""
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_child(script: str, args: Iterable[str], env: dict | None = None) -> dict:
  """Runs `python SCRIPT --child ARGS...` in a fresh process (the checkout's package first on
  the path) and returns the JSON object its last line prints; raises with its stderr if it fails.

  Example:
    >>> # run_child(__file__, ["plain", "8"])  -> {"step_ms": ..., ...}
  """
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, script, "--child", *map(str, args)], env=env, cwd=ROOT,
                        capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"{script} --child {' '.join(map(str, args))} failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def rounds(cases: list, count: int, measure: Callable[..., dict], log=print) -> dict:
  """`measure(*case)` for each case, alternated over `count` rounds (case order A B C, A B C, ...:
  machine drift falls on every case alike): {case: [result of each round]}."""
  results = {case: [] for case in cases}
  for i in range(count):
    for case in cases:
      results[case].append(measure(*case))
      log(f"round {i + 1}/{count} {' '.join(map(str, case))}: {results[case][-1]}")
  return results


def spread(values: Iterable[float]) -> list:
  """[median, min, max] of `values`."""
  values = list(values)
  return [statistics.median(values), min(values), max(values)]


def table(rows: list, columns: list) -> str:
  """`rows` (dicts) as a text table of `columns` ((title, key) pairs); a `[median, min, max]`
  cell prints as `median [min-max]`."""
  def number(value):
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"

  def cell(value):
    if isinstance(value, list) and len(value) == 3:
      return f"{number(value[0])} [{number(value[1])}-{number(value[2])}]"
    return number(value) if isinstance(value, float) else str(value)

  cells = [[title for title, _ in columns]] + [[cell(r.get(k, "")) for _, k in columns]
                                               for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def write_json(path: str, payload: dict) -> None:
  """Writes `payload` to `path` (folders made), indented."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1) + "\n")
