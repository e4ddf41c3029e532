"""The recipe's training loop with a host-device wait every step (`train.sync_each_step=true`)
against the asynchronous loop (losses read by step closures every `train.log_every` steps), on
the same config: step time, host trace time, device time, and how long the host traced step N + 1
while step N was still running.

Each (config, mode) trains the recipe (`torch_xla_jaxbridge.recipes.train`) in its own process;
the modes alternate over `--rounds` rounds. From each run's metrics.jsonl, after `--warmup` steps:
  step ms    wall time per step: (last step's finish - warm-up step's finish) / steps
  trace ms   median host time tracing a step (forward, backward, optimizer; before the sync)
  device ms  median time from a step's start on the device (its sync, or the previous step's
             finish if later) to its loss reaching the host (log_every=1 modes only)
  overlap ms median time the host spent tracing step N + 1 before step N finished
The table shows each mode's median over rounds and [min, max]. JSON: scripts/out/bench_loop.json.

  python scripts/bench_loop.py [--rounds 3] [--steps 40] [--warmup 5]
"""
import argparse
import statistics

import harness

ROOT = harness.ROOT
MODES = {
    "sync": ["train.sync_each_step=true", "train.log_every=1"],
    "async": ["train.log_every=1"],
    "async log_every=10": ["train.log_every=10"],
}
CONFIGS = {
    "default": [],
    "stack_layers remat=full": ["remat.stack_layers=true", "remat.policy=full"],
}


def child(config: str, mode: str, steps: int, warmup: int) -> dict:
  """One training run (in a fresh process): the numbers above and its compiles."""
  rows, summary = harness.train_recipe([f"train.steps={steps}", "train.checkpoint_every=0",
                                        *CONFIGS[config], *MODES[mode]])
  return {"config": config, "mode": mode, "compiles": summary["compiles"],
          **measure(rows, warmup)}


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "bench_loop.json"))
  opts = parser.parse_args()
  results = harness.rounds(
      [(config, mode) for config in opts.configs for mode in MODES], opts.rounds,
      lambda config, mode: harness.run_child(__file__, [config, mode, opts.steps, opts.warmup]))
  keys = ("step_ms", "trace_ms", "device_ms", "overlap_ms")
  table = []
  for (config, mode), runs in results.items():
    sync = results[(config, "sync")]
    entry = {"config": config, "mode": mode, "rounds": len(runs), **harness.spreads(runs, keys)}
    entry["step_vs_sync"] = entry["step_ms"][0] / harness.spread(r["step_ms"] for r in sync)[0]
    entry["losses_equal"] = len({r["last_loss"] for r in runs + sync}) == 1
    table.append(entry)
  print(harness.table(table, [("config", "config"), ("mode", "mode"),
                              *[(key, key, ".1f") for key in keys],
                              ("step / sync", "step_vs_sync", ".2f"),
                              ("same loss", "losses_equal")]))
  harness.write_json(opts.json, {"steps": opts.steps, "warmup": opts.warmup, "table": table,
                                 "runs": harness.in_order(results, "round")})


if __name__ == "__main__":
  harness.main(main, child)
