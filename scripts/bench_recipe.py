"""Training speed of the recipe, every mode, against plain LazyTensor (`remat.bridge=none`).

Each (model, mode) run is its own `python -m torch_xla_jaxbridge.recipes.train` process; the
modes are alternated over `--rounds` rounds (these machines move +-30% between runs). From each
run's `metrics.jsonl` (steps after `--warmup`): median step ms, median trace (host) ms, tokens/s,
MFU when the recipe logs it; from the process: peak resident memory (`ru_maxrss`, host memory is
device memory on XLA:CPU). Prints a table of medians with [min-max] over rounds and ratios against
LazyTensor's tokens/s of the same round (with the recipe's optimizer, and with torch's AdamW: plain
torch_xla); writes JSON.

  python scripts/bench_recipe.py [--models llama-tiny llama-mid] [--rounds 3] [--steps 30]
                                 [--modes NAME ...] [--json scripts/out/bench_recipe.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

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


def run_once(model, mode, steps, warmup):
  """One training process; its medians and peak memory as a dict."""
  with tempfile.TemporaryDirectory() as out:
    args = [f"model={model}", f"train.steps={steps}", "train.checkpoint_every=0", f"out={out}",
            *MODES[mode]]
    if SEQ.get(model):
      args.append(f"train.seq={SEQ[model]}")
    proc = subprocess.Popen([sys.executable, "-m", "torch_xla_jaxbridge.recipes.train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
      raise RuntimeError(f"{model} {mode} failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  timed = [r for r in rows if r["step"] > warmup] or rows
  median = lambda key: statistics.median(r[key] for r in timed if r.get(key) is not None)  # noqa: E731
  step_ms = median("step_ms")
  result = {"model": model, "mode": mode, "step_ms": step_ms, "trace_ms": median("trace_ms"),
            "tokens_per_s": median("tokens_per_s"), "last_loss": rows[-1].get("loss"),
            "peak_rss_mb": usage.ru_maxrss / 1024}
  if any(r.get("mfu") is not None for r in timed):
    result["mfu"] = median("mfu")
  return result


def spread(values):
  return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(SEQ))
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--json", default="scripts/out/bench_recipe.json")
  opts = parser.parse_args()
  runs = []
  for round_ in range(opts.rounds):
    for model in opts.models:
      for mode in opts.modes:
        row = {"round": round_, **run_once(model, mode, opts.steps, opts.warmup)}
        runs.append(row)
        print(json.dumps(row), flush=True)
  for row in runs:  # ratios against the baselines of the same round and model
    for key, baseline in RATIOS.items():
      base = [r for r in runs if (r["round"], r["model"], r["mode"]) ==
              (row["round"], row["model"], baseline)]
      if base:
        row[key] = row["tokens_per_s"] / base[0]["tokens_per_s"]
    row["trace_share"] = row["trace_ms"] / row["step_ms"]
  keys = ["step_ms", "trace_ms", "trace_share", "tokens_per_s", *RATIOS, "mfu", "peak_rss_mb",
          "last_loss"]
  table = []
  print(f"\n{'model':>11} {'mode':>28} " + " ".join(f"{k:>24}" for k in keys))
  for model in opts.models:
    for mode in opts.modes:
      mine = [r for r in runs if (r["model"], r["mode"]) == (model, mode)]
      cells = {k: spread([r[k] for r in mine]) for k in keys if all(k in r for r in mine)}
      table.append({"model": model, "mode": mode, **cells})
      print(f"{model:>11} {mode:>28} " + " ".join(f"{cells.get(k, '-'):>24}" for k in keys))
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"rounds": opts.rounds, "steps": opts.steps, "warmup": opts.warmup, "modes": MODES,
               "runs": runs, "table": table}, f, indent=2)


if __name__ == "__main__":
  main()
