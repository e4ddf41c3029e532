"""Training speed of the recipe, every mode, against plain LazyTensor (`remat.bridge=none`).

Each (model, mode) run trains the recipe (`torch_xla_jaxbridge.recipes.train`) in its own
process; the modes are alternated over `--rounds` rounds (these machines move +-30% between
runs). From each run's `metrics.jsonl`: when the first step after `--warmup` began (every
compile done), and over the later steps median step ms, median trace (host) ms, tokens/s, MFU
when the recipe logs it; from the process: peak resident memory
(`ru_maxrss`, host memory is device memory on XLA:CPU). Prints a table of medians with [min-max]
over rounds and ratios against LazyTensor's tokens/s of the same round (with the recipe's
optimizer, and with torch's AdamW: plain torch_xla); writes JSON.

`--models llama-mid:32` runs a config with another number of layers.

  python scripts/bench_recipe.py [--models llama-tiny llama-mid] [--rounds 3] [--steps 30]
                                 [--modes NAME ...] [--json scripts/out/bench_recipe.json]
"""
import argparse
import resource
import statistics

import harness

MODES = {
    "LazyTensor": ["remat.bridge=none", "remat.stack_layers=false"],
    "LazyTensor + torch AdamW": ["remat.bridge=none", "remat.stack_layers=false",
                                 "train.optimizer=torch-adamw"],
    "BridgeModule per layer": ["remat.bridge=layers", "remat.stack_layers=false"],
    "scan_layers": ["remat.bridge=layers", "remat.scan_layers=true", "remat.stack_layers=false"],
    "StackedLayers": ["remat.bridge=layers", "remat.stack_layers=true", "remat.policy=null"],
    "StackedLayers remat=full": ["remat.bridge=layers", "remat.stack_layers=true",
                                 "remat.policy=full"],
    "step bridged, layers": ["remat.bridge=step", "remat.stack_layers=false"],
    "step bridged, StackedLayers": ["remat.bridge=step", "remat.stack_layers=true"],
    "default config": [],
}
# tokens/s ratios: against LazyTensor with the same optimizer, and against plain torch_xla
RATIOS = {"tokens_vs_lazytensor": "LazyTensor", "tokens_vs_torch_xla": "LazyTensor + torch AdamW"}
SEQ = {"llama-tiny": None, "llama-mid": 256}  # None: the config's own


def child(model: str, mode: str, steps: int, warmup: int) -> dict:
  """One training run (in a fresh process); its medians and peak memory as a dict."""
  name, _, layers = model.partition(":")  # llama-mid:32: the config with 32 layers
  rows, _ = harness.train_recipe([f"model={name}", f"train.steps={steps}",
                                  "train.checkpoint_every=0", *MODES[mode],
                                  *([f"train.seq={SEQ[name]}"] if SEQ.get(name) else []),
                                  *([f"model.layers={layers}"] if layers else [])])
  timed = [r for r in rows if r["step"] > warmup] or rows
  def median(key):
    return statistics.median(r[key] for r in timed if r.get(key) is not None)

  result = {"model": model, "mode": mode, "step_ms": median("step_ms"),
            "trace_ms": median("trace_ms"), "tokens_per_s": median("tokens_per_s"),
            "last_loss": rows[-1].get("loss"),
            # when the first timed step began: every compile and the first steps' traces done
            "warmup_s": timed[0]["began_s"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  if any(r.get("mfu") is not None for r in timed):
    result["mfu"] = median("mfu")
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(SEQ))
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--json", default="scripts/out/bench_recipe.json")
  opts = parser.parse_args()
  results = harness.rounds(
      [(model, mode) for model in opts.models for mode in opts.modes], opts.rounds,
      lambda model, mode: harness.run_child(__file__, [model, mode, opts.steps, opts.warmup]))
  for (model, _), runs in results.items():  # ratios against the same round's baselines
    for key, baseline in RATIOS.items():
      for run, base in zip(runs, results.get((model, baseline), [])):
        run[key] = run["tokens_per_s"] / base["tokens_per_s"]
    for run in runs:
      run["trace_share"] = run["trace_ms"] / run["step_ms"]
  keys = ["warmup_s", "step_ms", "trace_ms", "trace_share", "tokens_per_s", *RATIOS, "mfu",
          "peak_rss_mb", "last_loss"]
  table = [{"model": model, "mode": mode,
            **harness.spreads(runs, [k for k in keys if all(k in r for r in runs)])}
           for (model, mode), runs in results.items()]
  print(harness.table(table, [("model", "model"), ("mode", "mode"), *[(k, k) for k in keys]]))
  harness.write_json(opts.json, {"rounds": opts.rounds, "steps": opts.steps,
                                 "warmup": opts.warmup, "modes": MODES,
                                 "runs": harness.in_order(results, "round"), "table": table})


if __name__ == "__main__":
  harness.main(main, child)
