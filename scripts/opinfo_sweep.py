"""PyTorch's operator database through bridged code: every op of `op_db` that supports float32 on
CPU, its first samples through plain LazyTensor code and through `jb.bridge`, forward and (where
the op supports autograd) backward, each against eager CPU torch (test/opinfo.py). Ops run in
child processes of `--chunk` ops each (XLA:CPU keeps every compiled program mapped); a child that
crashes costs only the op it was on. Prints the summary table and the ops where bridged code
does worse than LazyTensor, and writes JSON (default scripts/out/opinfo_sweep.json).

  python scripts/opinfo_sweep.py [--ops abs cummax ...] [--samples 2] [--jobs 2] [--json P]
"""
import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import harness

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST = ROOT / "test"
CHILD_TIMEOUT_S = 900


def child(names: list, samples: int, out: str) -> None:
  """Checks each op and appends its outcome to `out` as one JSON line, as soon as it is known."""
  sys.path.insert(0, str(TEST))
  import opinfo

  with open(out, "a") as f:
    for name in names:
      f.write(json.dumps(opinfo.timed_check(name, samples)) + "\n")
      f.flush()


def run_chunk(names: list, samples: int) -> list:
  """The outcomes of `names`, checked in child processes: where a child dies or hangs, the op it
  was on is recorded as failing in every mode and the rest go to a new child."""
  results, left = [], list(names)
  env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  while left:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
      try:
        proc = subprocess.run([sys.executable, __file__, "--child", "--samples", str(samples),
                               "--json", out.name, "--ops", *left], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        ended = f"the process ended with {proc.returncode}: {proc.stderr.strip()[-300:]}"
      except subprocess.TimeoutExpired:
        ended = f"the process ran past {CHILD_TIMEOUT_S} s"
      done = [json.loads(line) for line in out.read().splitlines() if line.strip()]
    results += done
    left = left[len(done):]
    if left:
      crashed = ["fail", ended]
      results.append({"op": left[0], "seconds": None,
                      "forward": {"lazy": crashed, "bridged": crashed},
                      "backward": {"lazy": crashed, "bridged": crashed}})
      left = left[1:]
  return results


def worse_than_lazy(row: dict, direction: str) -> bool:
  """Bridged code fails where plain LazyTensor code passes (a reported fallback is not worse)."""
  lazy, bridged = row[direction]["lazy"][0], row[direction]["bridged"][0]
  return lazy == "pass" and bridged == "fail"


# Why a bridged region fell back, from the reason the report gives: (class, pattern in it)
FALLBACK_CLASSES = [
    ("values needed on the host (data-dependent)", "DataDependentError"),
    ("a routine only jaxlib's runtime has (LAPACK)", "NoLoweringError"),
    ("no JAX conversion of the aten op", "has no lowering"),
    ("the op's JAX conversion fails on these arguments", "JaxTracingError"),
    ("JAX's leak check finds a traced value in JAX's own caches", "LeakedTensorError"),
    ("other", ""),
]


def fallback_classes(rows: list) -> dict:
  """{class: sorted op names} of the ops whose bridged forward or backward fell back where
  LazyTensor passed."""
  classes: dict = {name: set() for name, _ in FALLBACK_CLASSES}
  for row in rows:
    for direction in ("forward", "backward"):
      status, reason = row[direction]["bridged"]
      if status == "fallback" and row[direction]["lazy"][0] == "pass":
        name = next(name for name, pattern in FALLBACK_CLASSES if pattern in reason)
        classes[name].add(row["op"])
  return {name: sorted(ops) for name, ops in classes.items() if ops}


def summary(rows: list) -> dict:
  counts = {}
  for direction in ("forward", "backward"):
    for mode in ("lazy", "bridged"):
      counts[f"{direction} {mode}"] = dict(collections.Counter(
          row[direction][mode][0] for row in rows))
  return counts


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ops", nargs="*", help="op names (op_db name[.variant]); default all")
  parser.add_argument("--samples", type=int, default=2)
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--chunk", type=int, default=40)
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "opinfo_sweep.json"))
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args.ops, args.samples, args.json)
  sys.path.insert(0, str(TEST))
  names = args.ops
  if not names:
    import opinfo
    names = list(opinfo.OPS)
  chunks = [names[i:i + args.chunk] for i in range(0, len(names), args.chunk)]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    rows = [row for done in pool.map(lambda c: run_chunk(c, args.samples), chunks)
            for row in done]
  counts = summary(rows)
  print(f"{len(rows)} ops, {args.samples} samples each")
  print(f"{'mode':<18}" + "".join(f"{s:>10}" for s in ("pass", "fallback", "fail", "n/a")))
  for mode, count in counts.items():
    print(f"{mode:<18}" + "".join(f"{count.get(s, 0):>10}" for s in
                                  ("pass", "fallback", "fail", "n/a")))
  for direction in ("forward", "backward"):
    worse = [row for row in rows if worse_than_lazy(row, direction)]
    print(f"\n{direction}: bridged fails where LazyTensor passes: {len(worse)}")
    for row in worse:
      print(f"  {row['op']}: {row[direction]['bridged'][1]}")
  classes = fallback_classes(rows)
  print("\nbridged code falls back where LazyTensor passes, by cause:")
  for name, ops in classes.items():
    print(f"  {name}: {len(ops)}: {' '.join(ops)}")
  harness.write_json(args.json, {"samples": args.samples, "summary": counts,
                                 "fallback_classes": classes, "ops": rows})
  print(f"\nwrote {args.json}")


if __name__ == "__main__":
  main()
