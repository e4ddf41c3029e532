"""Compile time and step time of a decoder stack: unrolled LazyTensor, upstream scan_layers, ours
(scan_layers over the layers' own parameters; StackedLayers, parameters stored stacked).

Pre-norm Llama-style decoder layers (D=256, 4 heads, seq 64, batch 4, f32); a step is forward,
backward and SGD on the XLA CPU device. Compile time is torch_xla's CompileTime metric summed over
the two warm-up steps (the JAX trace and lowering of ours is in first_step_s); step time is the
median of the timed steps. Prints a table and writes JSON (default out/bench_scan.json).

  python scripts/bench_scan.py [--layers 2 8 32] [--steps 5] [--json PATH]
"""
import argparse
import json
import os

import stack_bench


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--modes", nargs="+",
                      default=["LazyTensor", "upstream scan_layers", "ours scan_layers",
                               "ours scan_layers remat=full", "ours StackedLayers",
                               "ours StackedLayers remat=full"])
  parser.add_argument("--json", default="out/bench_scan.json")
  opts = parser.parse_args()
  rows = []
  for layers in opts.layers:
    for mode in opts.modes:
      rows.append(stack_bench.run_isolated(mode, layers, opts.steps))
      print(rows[-1], flush=True)
  print(f"\n{'mode':<30}{'layers':>7}{'compile s':>11}{'first step s':>14}{'step ms':>10}"
        f"{'loss':>12}")
  for r in rows:
    print(f"{r['mode']:<30}{r['layers']:>7}{r['compile_s']:>11}{r['first_step_s']:>14}"
          f"{r['step_ms']:>10}{r['loss']:>12}")
  upstream = {r["layers"]: r for r in rows if r["mode"] == "upstream scan_layers"}
  summary = {}
  for mode in [m for m in opts.modes if m.startswith("ours")]:
    ours = {r["layers"]: r for r in rows if r["mode"] == mode}
    if len(ours) > 1:
      summary[f"{mode}: compile deepest / shallowest"] = round(
          ours[max(ours)]["compile_s"] / max(ours[min(ours)]["compile_s"], 1e-9), 2)
    if ours and max(ours) in upstream:
      summary[f"{mode}: compile / upstream's at deepest"] = round(
          ours[max(ours)]["compile_s"] / max(upstream[max(ours)]["compile_s"], 1e-9), 2)
  print("targets: ours compile at deepest <= 1.5x shallowest; below upstream at deepest:")
  for key, value in summary.items():
    print(f"  {key}: {value}")
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"config": stack_bench.CONFIG, "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
  main()
