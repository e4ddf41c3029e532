"""Compile time and step time of a decoder stack: unrolled LazyTensor, upstream scan_layers, ours
(scan_layers over the layers' own parameters; StackedLayers, parameters stored stacked).

Pre-norm Llama-style decoder layers (D=256, 4 heads, seq 64, batch 4, f32); a step is forward,
backward and SGD on the XLA CPU device. Compile time is torch_xla's CompileTime metric summed over
the two warm-up steps (the JAX trace and lowering of ours is in first_step_s); step time is the
median of the timed steps. Each (mode, depth) runs in its own process; `--rounds N` alternates
them over N rounds (default 1; a row per run, the targets on the medians). Prints a table and
writes JSON (default out/bench_scan.json).

  python scripts/bench_scan.py [--layers 2 8 32] [--steps 5] [--rounds 1] [--json PATH]
"""
import argparse

import harness
import stack_bench


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--modes", nargs="+",
                      default=["LazyTensor", "upstream scan_layers", "ours scan_layers",
                               "ours scan_layers remat=full", "ours StackedLayers",
                               "ours StackedLayers remat=full"])
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--json", default="out/bench_scan.json")
  opts = parser.parse_args()
  results = harness.rounds(
      [(layers, mode) for layers in opts.layers for mode in opts.modes], opts.rounds,
      lambda layers, mode: stack_bench.run_isolated(mode, layers, opts.steps))
  rows = harness.in_order(results)
  print("\n" + harness.table(rows, [("mode", "mode"), *[
      (title, key, str) for title, key in (("layers", "layers"), ("compile s", "compile_s"),
                                           ("first step s", "first_step_s"),
                                           ("step ms", "step_ms"), ("loss", "loss"))]]))
  compile_s = {case: harness.spread(r["compile_s"] for r in runs)[0]
               for case, runs in results.items()}
  upstream = {layers: c for (layers, mode), c in compile_s.items()
              if mode == "upstream scan_layers"}
  summary = {}
  for mode in [m for m in opts.modes if m.startswith("ours")]:
    ours = {layers: c for (layers, m), c in compile_s.items() if m == mode}
    if len(ours) > 1:
      summary[f"{mode}: compile deepest / shallowest"] = round(
          ours[max(ours)] / max(ours[min(ours)], 1e-9), 2)
    if ours and max(ours) in upstream:
      summary[f"{mode}: compile / upstream's at deepest"] = round(
          ours[max(ours)] / max(upstream[max(ours)], 1e-9), 2)
  print("targets: ours compile at deepest <= 1.5x shallowest; below upstream at deepest:")
  for key, value in summary.items():
    print(f"  {key}: {value}")
  harness.write_json(opts.json, {"config": stack_bench.CONFIG, "rows": rows, "summary": summary})


if __name__ == "__main__":
  harness.main(main)
