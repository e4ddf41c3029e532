"""Training-step speed of a decoder stack, every way this package (and upstream) can run it.

Modes: plain LazyTensor, upstream PureModule per layer, our BridgeModule per layer or around the
whole stack (one bridged call), our scan_layers, our StackedLayers (parameters stored stacked, one
scan), and the same model converted by torchax and run
as native `jax.jit(grad)` (the ceiling for this design). Columns: compile time (warm-up), first
step, host time per step (trace and dispatch, before `torch_xla.sync()`), step time (median),
page faults per step (first touches of freshly mapped memory: on these VMs they are a large
part of the step), compiles after warm-up (must be 0), loss after the run; host time is also split
into forward, backward and optimizer. `--hugepage-malloc` runs every mode with glibc's large
blocks on transparent huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), which takes most
of the page faults away. Pre-norm decoder, D=256, 4 heads, seq 64, batch 4, f32, SGD (torch's,
foreach; our modes also with jb.optim.SGD, one node per step). `--rounds N` alternates the
modes over N rounds (default 1): a row per run, ratios against LazyTensor of the same round
(median over rounds). Prints a table and writes JSON (default out/bench_step.json).

  python scripts/bench_step.py [--layers 8 32] [--steps 5] [--modes ...] [--hugepage-malloc]
                               [--rounds 1] [--json PATH]
"""
import argparse

import harness
import stack_bench

MODES = ["LazyTensor", "upstream PureModule", "ours BridgeModule", "ours scan_layers",
         "ours BridgeModule" + stack_bench.FUSED_SGD, "ours scan_layers" + stack_bench.FUSED_SGD,
         "ours scan_layers remat=full" + stack_bench.FUSED_SGD,
         "ours BridgeModule(whole stack) remat=dots_no_batch" + stack_bench.FUSED_SGD,
         "ours StackedLayers" + stack_bench.FUSED_SGD,
         "ours StackedLayers remat=full" + stack_bench.FUSED_SGD,
         "ours StackedLayers remat=dots_no_batch" + stack_bench.FUSED_SGD,
         "native jax.jit"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--modes", nargs="+", default=MODES)
  parser.add_argument("--hugepage-malloc", action="store_true")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--json", default="out/bench_step.json")
  opts = parser.parse_args()
  env = stack_bench.HUGEPAGE_MALLOC if opts.hugepage_malloc else None
  results = harness.rounds(
      [(layers, mode) for layers in opts.layers for mode in opts.modes], opts.rounds,
      lambda layers, mode: stack_bench.run_isolated(mode, layers, opts.steps, env))
  rows = harness.in_order(results)
  head = ("layers", "compile_s", "host_ms", "host_forward_ms", "host_backward_ms",
          "host_optimizer_ms", "step_ms", "page_faults", "compiles_after_warmup", "loss")
  print("\n" + harness.table(rows, [("mode", "mode"), *[(h[:18], h, str) for h in head]]))
  summary = {}
  for (layers, mode), runs in results.items():
    base = results.get((layers, "LazyTensor"))
    if base is None or mode == "LazyTensor":
      continue
    summary[f"L{layers} {mode} step/LazyTensor"] = round(
        harness.ratio(runs, base, "step_ms")[0], 2)
    host = harness.ratio(runs, base, "host_ms")
    if host is not None:
      summary[f"L{layers} {mode} host/LazyTensor"] = round(host[0], 3)
  print("ratios (targets at L=32: best step <= 1.0, host <= 0.1):")
  for k, v in summary.items():
    print(f"  {k}: {v}")
  harness.write_json(opts.json, {"config": {**stack_bench.CONFIG, "environment": env or {}},
                                 "rows": rows, "ratios": summary})


if __name__ == "__main__":
  harness.main(main)
