"""Time to first step with dropout: a Hugging Face T5 trained by plain torch_xla and with its
blocks bridged by class, with and without dropout (issue: time to first step).

Model: `T5ForConditionalGeneration` (d_model 128, d_ff 256, 4 encoder and 4 decoder blocks, 4
heads, vocabulary 1000, random init), batch 4 x 32 tokens, `torch.optim.AdamW`, seed 0. Modes,
each (mode, dropout) in its own process, alternated over rounds:
- `plain`: LazyTensor, `loss.backward()`, `optimizer.step()`;
- `by class`: the same after `jb.bridge_modules(model, ["T5Block"])`;
- `by class (other)`: the same with the package at `--other` first on the path (a checkout of
  another version: a before-and-after in one run).

Per run: `step 1` (wall time of the first step, trace and compile included, waiting for the
device), its `compile` (torch_xla's CompileTime) and `host` (the rest: trace, lowering, graph
building). Ratios are per round against `plain` at the same dropout.

  python scripts/bench_dropout.py [--dropout 0.1 0.0] [--rounds 3] [--steps 3] [--other PATH]
      [--json scripts/out/bench_dropout.json]
"""
import argparse
import sys
import time

import harness

MODES = ["plain", "by class"]


def child(mode: str, dropout: float, steps: int, other: str) -> dict:
  if mode == "by class (other)":
    sys.path.insert(0, other)
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.debug.metrics as met
  import transformers

  torch.manual_seed(0)
  config = transformers.T5Config(d_model=128, d_ff=256, num_layers=4, num_decoder_layers=4,
                                 num_heads=4, d_kv=32, dropout_rate=dropout, vocab_size=1000,
                                 decoder_start_token_id=0, pad_token_id=0)
  model = transformers.T5ForConditionalGeneration(config).train().to("xla")
  if mode != "plain":
    import torch_xla_jaxbridge as jb

    jb.bridge_modules(model, ["T5Block"])
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
  torch_xla.manual_seed(0)
  ids = torch.randint(0, 1000, (4, 32)).to("xla")
  labels = torch.randint(0, 1000, (4, 32)).to("xla")
  torch_xla.sync()
  xm.wait_device_ops()
  met.clear_all()
  walls, losses = [], []
  for step in range(steps):
    began = time.perf_counter()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
    xm.wait_device_ops()
    walls.append(time.perf_counter() - began)
    if step == 0:
      compile_s = met.metric_data("CompileTime")[1] / 1e9
    losses.append(loss.item())
  return {"step1_s": walls[0], "compile_s": compile_s, "host_s": walls[0] - compile_s,
          "losses": losses}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--dropout", type=float, nargs="+", default=[0.1, 0.0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--other", default="", help="a checkout of another version to compare")
  parser.add_argument("--json", default="scripts/out/bench_dropout.json")
  args = parser.parse_args()
  modes = MODES + (["by class (other)"] if args.other else [])
  cases = [(dropout, mode) for dropout in args.dropout for mode in modes]
  results = harness.rounds(cases, args.rounds, lambda dropout, mode: harness.run_child(
      __file__, [mode, dropout, args.steps, args.other]))
  rows = []
  for dropout, mode in cases:
    runs, plain = results[(dropout, mode)], results[(dropout, "plain")]
    rows.append({"dropout": dropout, "mode": mode, "runs": runs,
                 **harness.spreads(runs, ["step1_s", "compile_s", "host_s"]),
                 "step1_x": harness.ratio(runs, plain, "step1_s"),
                 "compile_x": harness.ratio(runs, plain, "compile_s")})
  print(harness.table(rows, [
      ("dropout", "dropout"), ("mode", "mode"), ("step 1 s", "step1_s"), ("x plain", "step1_x"),
      ("compile s", "compile_s"), ("x plain", "compile_x"), ("host s", "host_s")]))
  harness.write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
  harness.main(main, child)
