"""What the optimizer's update costs the step's compile as depth grows, and whether stacking the
identical layers' parameters makes it cheaper (issue: time to first step and depth).

`jb.train_step` loops identical layers (one layer body in the program), but AdamW updates each
parameter with its own kernel: 9 parameters a layer for a Hugging Face Llama layer. This times
XLA:CPU's compile (lower + compile, `jax.jit`) of that update alone, for the parameter shapes of
bench_depth's Llama (hidden 128, intermediate 256, 4 heads / 2 key-value heads), in three forms:
- `per parameter`: one AdamW update per parameter (what the step does);
- `stacked`: per parameter kind, the layers' parameters, gradients and moments stacked, one
  update, the results sliced back out per layer;
- `stacked, traced unstack`: the same, the update behind an optimization barrier and the slices
  taken at traced indices (`dynamic_index_in_dim`), so every layer's slice is the same kernel.
Each (form, depth) in its own process, alternated over rounds; ratios per round against
`per parameter` at the same depth, and each form's compile at the deepest depth over the first.

  python scripts/bench_optimizer_compile.py [--layers 4 32] [--rounds 3]
      [--json scripts/out/bench_optimizer_compile.json]
"""
import argparse
import time

import harness

FORMS = ["per parameter", "stacked", "stacked, traced unstack"]
SHAPES = [(128,), (128, 128), (64, 128), (64, 128), (128, 128), (128,), (256, 128), (256, 128),
          (128, 256)]  # a Llama layer's: norms, q, k, v, o, MLP gate, up, down


def child(form: str, layers: int) -> dict:
  import jax
  import jax.numpy as jnp

  def adamw(p, g, m, v):
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return p - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * p), m, v

  def per_parameter(ps, gs, ms, vs, indices):
    return [adamw(*values) for values in zip(ps, gs, ms, vs)]

  def stacked(ps, gs, ms, vs, indices):
    out = []
    for kind in range(len(SHAPES)):
      picked = [jnp.stack(x[kind::len(SHAPES)]) for x in (ps, gs, ms, vs)]
      new = adamw(*picked)
      if form == "stacked":
        out += [tuple(n[layer] for n in new) for layer in range(layers)]
      else:
        new = jax.lax.optimization_barrier(new)
        out += [tuple(jax.lax.dynamic_index_in_dim(n, indices[layer], keepdims=False)
                      for n in new) for layer in range(layers)]
    return out

  arrays = [[jnp.ones(s) for _ in range(layers) for s in SHAPES] for _ in range(4)]
  indices = [jnp.int32(layer) for layer in range(layers)]
  update = jax.jit(per_parameter if form == "per parameter" else stacked)
  began = time.perf_counter()
  update.lower(*arrays, indices).compile()
  return {"compile_s": time.perf_counter() - began}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", default="scripts/out/bench_optimizer_compile.json")
  args = parser.parse_args()
  cases = [(form, layers) for layers in args.layers for form in FORMS]
  results = harness.rounds(cases, args.rounds,
                           lambda form, layers: harness.run_child(__file__, [form, layers]))
  first, last = args.layers[0], args.layers[-1]
  rows = []
  for form, layers in cases:
    runs = results[(form, layers)]
    rows.append({"form": form, "layers": layers, "runs": runs,
                 **harness.spreads(runs, ["compile_s"]),
                 "x_per_parameter": harness.ratio(runs, results[("per parameter", layers)],
                                                  "compile_s"),
                 "x_shallowest": harness.ratio(runs, results[(form, first)], "compile_s")
                 if layers == last else None})
  print(harness.table(rows, [("form", "form"), ("layers", "layers"), ("compile s", "compile_s"),
                             ("x per parameter", "x_per_parameter"),
                             (f"x {first} layers", "x_shallowest")]))
  harness.write_json(args.json, {"args": vars(args), "rows": rows,
                                 "runs": harness.in_order(results)})


if __name__ == "__main__":
  harness.main(main, child)
