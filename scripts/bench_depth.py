"""Time to first step against depth: an unmodified Hugging Face Llama trained by plain torch_xla
and by the package's adoptions, at several depths (issue: time to first step and depth).

Model: `LlamaForCausalLM` (hidden 128, intermediate 256, 4 heads / 2 key-value heads, eager
attention, vocabulary 1000, the config's defaults otherwise), batch 4 x 128 tokens, seed 0.
Modes, each (mode, depth) in its own process, alternated over rounds:
- `plain`: LazyTensor, `loss.backward()`, `torch.optim.AdamW`;
- `by class`: `jb.bridge_modules(model, ["LlamaDecoderLayer"])`, then as `plain`;
- `by class + jb AdamW`: the same with `jb.optim.AdamW` (the optimizer step as one node);
- `train_step`: `jb.train_step(lambda m, ids: m(input_ids=ids, labels=ids).loss, jb.optim.AdamW)`
  (its layers run as one loop from `LOOP_FROM` = 8 layers on);
- `train_step looped`: the same with `layer_loop=2` (a loop at every depth);
- `train_step looped SGD`: the same with `jb.optim.SGD` (an update of one multiply-add per
  parameter: what the layers' loop costs at depth without AdamW's per-parameter kernels);
- `train_step unrolled`: the same with `layer_loop=False` (one copy of each layer in the program).
With `--other PATH` each mode but `plain` runs a second time, as `MODE (other)`, with the package
at PATH first on the path (a checkout of another version: a before-and-after in one run).

With `--no-cache` the config has `use_cache=False` (as training scripts and gradient
checkpointing set it): no `DynamicCache` is made and the layers never read their `layer_idx`.

Per run: `step 1` (wall time of the first step, trace and compile included, waiting for the
device), `warm-up` (wall time of the steps up to and including the last one that compiled:
the time to the first steady step), the number of programs torch_xla compiled then, the steady
step (median of the steps after warm-up) and every step's loss. Ratios are per round against
`plain` at the same depth (mode / plain: below 1 is faster), then median [min-max]; step 1 also
against the same mode at the first depth given (how it grows with depth).

  python scripts/bench_depth.py [--layers 4 16 32] [--rounds 3] [--steps 5] [--no-cache]
      [--modes ...] [--other PATH] [--json scripts/out/bench_depth.json]
"""
import argparse
import statistics
import sys
import time

import harness

MODES = ["plain", "by class", "by class + jb AdamW", "train_step", "train_step looped",
         "train_step looped SGD", "train_step unrolled"]


OTHER = " (other)"


def child(mode: str, layers: int, steps: int, use_cache: int, other: str) -> dict:
  if mode.endswith(OTHER):
    sys.path.insert(0, other)
    mode = mode[:-len(OTHER)]
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.debug.metrics as met
  import transformers

  import torch_xla_jaxbridge as jb

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
      use_cache=bool(use_cache))
  model = transformers.LlamaForCausalLM(config).to("xla")
  ids = torch.randint(0, 1000, (4, 128)).to("xla")
  if mode.startswith("by class"):
    jb.bridge_modules(model, ["LlamaDecoderLayer"])
  if mode.startswith("train_step"):
    step = jb.train_step(lambda m, i: m(input_ids=i, labels=i).loss,
                         (jb.optim.SGD if mode.endswith("SGD") else jb.optim.AdamW)(
                             model.parameters(), lr=1e-3),
                         layer_loop={"train_step": True, "train_step looped": 2,
                                     "train_step looped SGD": 2,
                                     "train_step unrolled": False}[mode])
    run = lambda: step(model, ids)  # noqa: E731
  else:
    optimizer = (jb.optim.AdamW if mode.endswith("jb AdamW") else torch.optim.AdamW)(
        model.parameters(), lr=1e-3)

    def run():
      loss = model(input_ids=ids, labels=ids).loss
      loss.backward()
      optimizer.step()
      optimizer.zero_grad()
      return loss

  def compiles():
    data = met.metric_data("CompileTime")
    return data[0] if data else 0

  torch_xla.sync()
  xm.wait_device_ops()
  walls, counts, losses = [], [], []
  for _ in range(steps):
    began = time.perf_counter()
    loss = run()
    torch_xla.sync()
    xm.wait_device_ops()
    walls.append(time.perf_counter() - began)
    counts.append(compiles())
    losses.append(loss.item())
  last = max(i for i in range(steps) if counts[i] > (counts[i - 1] if i else 0))
  return {"step1_s": walls[0], "warmup_s": sum(walls[:last + 1]), "compiles": counts[last],
          "steady_ms": 1e3 * statistics.median(walls[last + 1:]) if last + 1 < steps else None,
          "losses": losses, "package": jb.__file__}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--modes", nargs="+", default=MODES)
  parser.add_argument("--no-cache", action="store_true", help="the config's use_cache=False")
  parser.add_argument("--other", default="", help="a checkout of another version to compare")
  parser.add_argument("--json", default="scripts/out/bench_depth.json")
  args = parser.parse_args()
  modes = [m + suffix for m in args.modes
           for suffix in ([""] + ([OTHER] if args.other and m != "plain" else []))]
  cases = [(layers, mode) for layers in args.layers for mode in modes]
  results = harness.rounds(cases, args.rounds, lambda layers, mode: harness.run_child(
      __file__, [mode, layers, args.steps, int(not args.no_cache), args.other]))
  rows = []
  for layers, mode in cases:
    runs, plain = results[(layers, mode)], results.get((layers, "plain"), [])  # (not measured:
    # its ratios are empty)
    rows.append({"layers": layers, "mode": mode, "runs": runs,
                 **harness.spreads(runs, ["step1_s", "warmup_s", "compiles", "steady_ms"]),
                 "step1_x": harness.ratio(runs, plain, "step1_s"),
                 "warmup_x": harness.ratio(runs, plain, "warmup_s"),
                 "steady_x": harness.ratio(runs, plain, "steady_ms"),
                 "step1_x_first": harness.ratio(runs, results[(args.layers[0], mode)], "step1_s"),
                 "loss_diff": harness.max_difference(runs, plain, "losses") if plain else None})
  print(harness.table(rows, [
      ("layers", "layers"), ("mode", "mode"), ("step 1 s", "step1_s"), ("x plain", "step1_x"),
      (f"x {args.layers[0]} layers", "step1_x_first"),
      ("warm-up s", "warmup_s"), ("x plain", "warmup_x"), ("compiles", "compiles"),
      ("steady ms", "steady_ms"), ("x plain", "steady_x"), ("max loss diff", "loss_diff")]))
  harness.write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
  harness.main(main, child)
