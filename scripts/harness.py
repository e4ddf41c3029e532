"""The benchmarks' shared harness: each mode in a fresh process, modes alternated over rounds,
medians with their spread, a printed table and JSON. Every benchmark in scripts/ uses it.

A script names its child function and its parent function once, at its end:

  def child(mode: str, layers: int) -> dict:   # runs in the fresh process
    ...
    return {"step_ms": ...}

  def main() -> None:                           # the parent
    results = harness.rounds([(m, 8) for m in MODES], 3,
                             lambda mode, layers: harness.run_child(__file__, [mode, layers]))
    rows = [{"mode": m, **harness.spreads(results[(m, 8)], ["step_ms"])} for m in MODES]
    print(harness.table(rows, [("mode", "mode"), ("step ms", "step_ms", ".1f")]))
    harness.write_json(path, {"rows": rows, "runs": harness.in_order(results)})

  if __name__ == "__main__":
    harness.main(main, child)

`python SCRIPT --child ARGS...` runs `child` alone and prints its result as JSON on the last line
(each argument typed by the child's annotation: `str` as it is, anything else as JSON).
"""
import inspect
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import typing
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

ROOT = pathlib.Path(__file__).resolve().parent.parent
Case = tuple
# a table column: (title, key) or (title, key, format); key: a row's key or a function of the
# row; format: a format spec (".2f") or a function of one number, applied to each number of a
# [median, min, max] cell too
Column = tuple


def encode(value: Any) -> str:
  """A child's command-line argument: a string as it is, anything else as JSON.

  Example:
    >>> [encode("plain"), encode(8), encode(True), encode({"a": 1})]
    ['plain', '8', 'true', '{"a": 1}']
  """
  return value if isinstance(value, str) else json.dumps(value)


def decode(child: Callable[..., Any], args: Sequence[str]) -> list:
  """`args` as `child`'s parameters: a `str` parameter as it is, any other parsed as JSON.

  Example:
    >>> def child(mode: str, layers: int, same: bool): ...
    >>> decode(child, ["plain", "8", "false"])
    ['plain', 8, False]
  """
  hints = typing.get_type_hints(child)
  names = list(inspect.signature(child).parameters)
  return [arg if hints.get(name) is str else json.loads(arg) for name, arg in zip(names, args)]


def main(parent: Callable[[], Any], child: Optional[Callable[..., Any]] = None) -> None:
  """A script's entry point: `SCRIPT --child ARGS...` prints `child(*ARGS)` as JSON on its last
  line (`run_child` reads it); otherwise `parent()` runs and its return value is the exit code.

  Example:
    >>> # if __name__ == "__main__": harness.main(main, child)
  """
  if sys.argv[1:2] == ["--child"] and child is not None:
    print(json.dumps(child(*decode(child, sys.argv[2:]))), flush=True)
  else:
    sys.exit(parent())


def run_child(script: str, args: Iterable[Any], env: Optional[Mapping[str, str]] = None,
              cwd: Optional[os.PathLike] = None) -> Any:
  """Runs `python SCRIPT --child ARGS...` (each argument `encode`d) in a fresh process and returns
  the JSON value its last line prints; raises with its output's end if it fails. The process gets
  this one's environment with `env` added, the checkout's package first on the path, and
  `PJRT_DEVICE=CPU` unless it is set; it runs in `cwd` (default: the checkout).

  Example:
    >>> # run_child(__file__, ["plain", 8])  -> {"step_ms": ..., ...}
  """
  args = [encode(a) for a in args]
  environment = {"PJRT_DEVICE": "CPU", **os.environ, **(env or {})}
  environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                            environment.get("PYTHONPATH")]))
  done = subprocess.run([sys.executable, script, "--child", *args], env=environment,
                        cwd=cwd or ROOT, capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"{script} --child {' '.join(args)} failed:\n{done.stdout[-2000:]}\n"
                       f"{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def train_recipe(overrides: Sequence[str]) -> tuple:
  """Trains the recipe (`torch_xla_jaxbridge.recipes.train`) in this process with `key=value`
  `overrides`, in a temporary run directory; returns its `metrics.jsonl` rows and its
  `summary.json`. Call it in a child: one recipe run a process.

  Example:
    >>> # rows, summary = train_recipe(["model=llama-tiny", "train.steps=10"])
  """
  from torch_xla_jaxbridge.recipes import config, train

  with tempfile.TemporaryDirectory() as out:
    train.train(config.load([*overrides, f"out={out}"]), log=lambda line: None)
    rows = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").open()]
    return rows, json.loads((pathlib.Path(out) / "summary.json").read_text())


def rounds(cases: Sequence[Case], count: int, measure: Callable[..., Any],
           describe: Callable[[Any], str] = str, log: Optional[Callable[[str], Any]] = print,
           after: Optional[Callable[[dict], Any]] = None) -> dict:
  """`measure(*case)` for each case, alternated over `count` rounds (case order A B C, A B C, ...:
  machine drift falls on every case alike): {case: [result of each round]}. Each result is logged
  as `describe(result)`; `after(results so far)` runs after each (e.g. to write what a run cut
  short has measured).

  Example:
    >>> order = []
    >>> rounds([("a",), ("b",)], 2, lambda c: order.append(c) or len(order), log=None)
    {('a',): [1, 3], ('b',): [2, 4]}
    >>> order
    ['a', 'b', 'a', 'b']
  """
  results: dict = {tuple(case): [] for case in cases}
  for i in range(count):
    for case in results:
      results[case].append(measure(*case))
      if log:
        log(f"round {i + 1}/{count} {' '.join(map(str, case))}: {describe(results[case][-1])}")
        sys.stdout.flush()
      if after:
        after(results)
  return results


def in_order(results: dict, round_key: Optional[str] = None) -> list:
  """The results of `rounds` as one list in the order they ran (round by round), each a dict
  with its round number under `round_key` when one is given.

  Example:
    >>> in_order({("a",): [{"x": 1}, {"x": 3}], ("b",): [{"x": 2}]}, "round")
    [{'round': 0, 'x': 1}, {'round': 0, 'x': 2}, {'round': 1, 'x': 3}]
  """
  count = max(map(len, results.values()), default=0)
  return [({round_key: i, **runs[i]} if round_key else runs[i])
          for i in range(count) for runs in results.values() if i < len(runs)]


def spread(values: Iterable[Optional[float]]) -> Optional[list]:
  """[median, min, max] of `values` (None values left out; None when none is left).

  Example:
    >>> spread([3, 1, None, 2])
    [2, 1, 3]
  """
  kept = [v for v in values if v is not None]
  return [statistics.median(kept), min(kept), max(kept)] if kept else None


def spreads(runs: Sequence[dict], keys: Iterable[str]) -> dict:
  """{key: spread of the runs' values of key}.

  Example:
    >>> spreads([{"ms": 1.0}, {"ms": 3.0}, {"ms": 2.0}], ["ms"])
    {'ms': [2.0, 1.0, 3.0]}
  """
  return {key: spread(run.get(key) for run in runs) for key in keys}


def ratio(runs: Sequence[dict], bases: Sequence[dict], key: str) -> Optional[list]:
  """The spread of `run[key] / base[key]` over runs and bases of the same round.

  Example:
    >>> ratio([{"ms": 2.0}, {"ms": 3.0}], [{"ms": 1.0}, {"ms": 2.0}], "ms")
    [1.75, 1.5, 2.0]
  """
  return spread(run[key] / base[key] for run, base in zip(runs, bases)
                if run[key] is not None and base[key] is not None)


def max_difference(runs: Sequence[dict], bases: Sequence[dict], key: str) -> float:
  """The largest `|a - b|` between the lists `run[key]` and `base[key]` (e.g. each step's loss)
  over runs and bases of the same round.

  Example:
    >>> max_difference([{"losses": [1.0, 0.5]}], [{"losses": [1.0, 0.25]}], "losses")
    0.25
  """
  return max((abs(a - b) for run, base in zip(runs, bases)
              for a, b in zip(run[key], base[key])), default=0.0)


def _number(value: float, form: Union[str, Callable[[float], str], None]) -> str:
  if callable(form):
    return form(value)
  if form:
    return format(value, form)
  return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def cell(value: Any, form: Union[str, Callable[[float], str], None] = None) -> str:
  """One table cell: a `[median, min, max]` list as `median [min-max]`, a number in `form`
  (default: 3 significant digits, none after the point from 100), None as `-`.

  Example:
    >>> [cell([2.0, 1.5, 3.25]), cell(1234.5), cell(0.5, ".2f"), cell(None), cell("x")]
    ['2 [1.5-3.25]', '1234', '0.50', '-', 'x']
  """
  if value is None:
    return "-"
  if isinstance(value, list) and len(value) == 3:
    low, high = _number(value[1], form), _number(value[2], form)
    return f"{_number(value[0], form)} [{low}-{high}]"
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return _number(value, form)
  return str(value)


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
  """`rows` (dicts) as a text table of `columns` (title, key[, format]: see `Column`); numbers
  right-aligned.

  Example:
    >>> print(table([{"mode": "a", "ms": [2.0, 1.0, 3.0]}], [("mode", "mode"), ("ms", "ms")]))
    mode       ms
    a     2 [1-3]
  """
  def read(row: dict, key: Union[str, Callable[[dict], Any]]) -> Any:
    return key(row) if callable(key) else row.get(key)

  values = [[read(row, column[1]) for column in columns] for row in rows]
  cells = [[title for title, *_ in columns]] + [
      [cell(v, column[2] if len(column) > 2 else None) for v, column in zip(line, columns)]
      for line in values]
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  right = [any(isinstance(line[i], (int, float, list)) and not isinstance(line[i], bool)
               for line in values) for i in range(len(columns))]
  return "\n".join("  ".join(c.rjust(w) if r else c.ljust(w)
                             for c, w, r in zip(line, widths, right)).rstrip() for line in cells)


def write_json(path: Union[str, os.PathLike], payload: Any) -> None:
  """Writes `payload` to `path` as indented JSON (folders made).

  Example:
    >>> import tempfile; path = pathlib.Path(tempfile.mkdtemp()) / "out" / "x.json"
    >>> write_json(path, {"rows": []}); path.read_text()
    '{\\n "rows": []\\n}\\n'
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1) + "\n")

