"""The recipe's training loop with a host-device wait every step (`train.sync_each_step=true`)
against the asynchronous loop (losses read by step closures every `train.log_every` steps), on
the same config: step time, host trace time, device time, and how long the host traced step N + 1
while step N was still running.

Each (config, mode) runs `python -m torch_xla_jaxbridge.recipes.train` in its own process; the
modes alternate over `--rounds` rounds. From each run's metrics.jsonl, after `--warmup` steps:
  step ms    wall time per step: (last step's finish - warm-up step's finish) / steps
  trace ms   median host time tracing a step (forward, backward, optimizer; before the sync)
  device ms  median time from a step's start on the device (its sync, or the previous step's
             finish if later) to its loss reaching the host (log_every=1 modes only)
  overlap ms median time the host spent tracing step N + 1 before step N finished
The table shows each mode's median over rounds and [min, max]. JSON: scripts/out/bench_loop.json.

  python scripts/bench_loop.py [--rounds 3] [--steps 40] [--warmup 5]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = {
    "sync": ["train.sync_each_step=true", "train.log_every=1"],
    "async": ["train.log_every=1"],
    "async log_every=10": ["train.log_every=10"],
}
CONFIGS = {
    "default": [],
    "stack_layers remat=full": ["remat.stack_layers=true", "remat.policy=full"],
}


def run(config, mode, steps):
  """One training run in a fresh process; its metrics rows and summary."""
  with tempfile.TemporaryDirectory() as out:
    args = [sys.executable, "-m", "torch_xla_jaxbridge.recipes.train", f"train.steps={steps}",
            "train.checkpoint_every=0", f"out={out}", *CONFIGS[config], *MODES[mode]]
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
               PYTHONPATH=str(ROOT))
    subprocess.run(args, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
  return rows, summary


def measure(rows, warmup):
  """The per-run numbers above, from metrics rows (steps after `warmup`)."""
  done = {r["step"]: r["done_s"] for r in rows if "done_s" in r}
  first = min(s for s in done if s >= warmup)
  last = max(done)
  steady = [r for r in rows if r["step"] > first]
  by_step = {r["step"]: r for r in rows}
  device = [done[s] - max(by_step[s]["traced_s"], done[s - 1]) for s in done
            if s > first and s - 1 in done]
  overlap = [max(0.0, min(by_step[s + 1]["traced_s"], done[s]) - by_step[s + 1]["began_s"])
             for s in done if s >= first and s + 1 in by_step]
  return {
      "step_ms": (done[last] - done[first]) / (last - first) * 1e3,
      "trace_ms": statistics.median(r["trace_ms"] for r in steady),
      "device_ms": statistics.median(device) * 1e3 if device else None,
      "overlap_ms": statistics.median(overlap) * 1e3 if overlap else None,
      "last_loss": rows[-1]["loss"],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "bench_loop.json"))
  opts = parser.parse_args()
  runs = []
  for round_ in range(opts.rounds):
    for config in opts.configs:
      for mode in MODES:
        rows, summary = run(config, mode, opts.steps)
        runs.append({"round": round_, "config": config, "mode": mode,
                     "compiles": summary["compiles"], **measure(rows, opts.warmup)})
        print(json.dumps(runs[-1]), flush=True)
  keys = ("step_ms", "trace_ms", "device_ms", "overlap_ms")
  table = []
  for config in opts.configs:
    base = statistics.median(r["step_ms"] for r in runs
                             if r["config"] == config and r["mode"] == "sync")
    for mode in MODES:
      mine = [r for r in runs if r["config"] == config and r["mode"] == mode]
      entry = {"config": config, "mode": mode, "rounds": len(mine)}
      for key in keys:
        values = [r[key] for r in mine if r[key] is not None]
        entry[key] = ([statistics.median(values), min(values), max(values)] if values else None)
      entry["step_vs_sync"] = entry["step_ms"][0] / base
      entry["losses_equal"] = len({r["last_loss"] for r in mine} |
                                  {r["last_loss"] for r in runs
                                   if r["config"] == config and r["mode"] == "sync"}) == 1
      table.append(entry)
  show = lambda v: f"{v[0]:7.1f} [{v[1]:.0f}, {v[2]:.0f}]" if v else f"{'-':>7}"  # noqa: E731
  print(f"\n{'config':<24}{'mode':<20}" + "".join(f"{k:>20}" for k in keys) +
        f"{'step / sync':>13}{'same loss':>11}")
  for e in table:
    print(f"{e['config']:<24}{e['mode']:<20}" + "".join(f"{show(e[k]):>20}" for k in keys) +
          f"{e['step_vs_sync']:>13.2f}{str(e['losses_equal']):>11}")
  os.makedirs(os.path.dirname(opts.json), exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"steps": opts.steps, "warmup": opts.warmup, "table": table, "runs": runs}, f,
              indent=2)


if __name__ == "__main__":
  main()
