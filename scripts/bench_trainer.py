"""The Hugging Face `Trainer` on the XLA CPU device: plain torch_xla against the package's adoption
lines (docs/models.md, "Hugging Face Trainer"), each mode in a fresh process, alternated rounds.

Modes: `plain` (the unmodified Trainer), `layers` (`jb.bridge_modules(model,
["LlamaDecoderLayer"])`, the Trainer's torch AdamW), `layers + jb AdamW` (the same with
`Trainer(optimizers=(jb.optim.AdamW(...), None))`). Model: a grouped-query Llama (hidden 256, 4
heads, 2 key/value heads, default `sdpa` attention), batch 4 x 128 tokens. First step: from
`train()` to the end of step 1 (trace and compile included); steady: median of the later steps.

  python scripts/bench_trainer.py [--layers 4] [--steps 10] [--rounds 3]
      [--json scripts/out/bench_trainer.json]
"""
import argparse
import tempfile
import time

import harness

MODES = ("plain", "layers", "layers + jb AdamW")


def child(mode: str, layers: int, steps: int) -> dict:
  import torch
  import transformers as tf

  if mode != "plain":
    import torch_xla_jaxbridge as jb
  config = tf.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128)
  torch.manual_seed(0)
  model = tf.LlamaForCausalLM(config)
  ids = torch.randint(0, 1024, (4 * steps, 128), generator=torch.Generator().manual_seed(1))
  data = [{"input_ids": row, "labels": row} for row in ids]
  optimizers = (None, None)
  if mode != "plain":
    model = model.to("xla")
    jb.bridge_modules(model, ["LlamaDecoderLayer"])
    if mode == "layers + jb AdamW":
      optimizers = (jb.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0), None)
  ends = []

  class Clock(tf.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
      ends.append(time.perf_counter())

  args = tf.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                              num_train_epochs=1, optim="adamw_torch", learning_rate=1e-4,
                              logging_steps=steps, report_to=[], save_strategy="no",
                              disable_tqdm=True, seed=0)
  trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()],
                       optimizers=optimizers)
  start = time.perf_counter()
  result = trainer.train()
  between = [b - a for a, b in zip(ends[1:], ends[2:])]
  fell_back = len(jb.bridge_report().fallbacks()) if mode != "plain" else 0
  return {"first_s": ends[0] - start, "steady_ms": 1e3 * sorted(between)[len(between) // 2],
          "loss": result.training_loss, "steps": trainer.state.global_step,
          "fallbacks": fell_back}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", default="scripts/out/bench_trainer.json")
  opts = parser.parse_args()
  runs = harness.rounds([(m,) for m in MODES], opts.rounds,
                        lambda mode: harness.run_child(__file__, [mode, opts.layers, opts.steps]))
  base = harness.spreads(runs[("plain",)], ["first_s", "steady_ms"])
  rows = []
  for (mode,), results in runs.items():
    row = {"mode": mode, **harness.spreads(results, ["first_s", "steady_ms"])}
    row["speedup"] = base["steady_ms"][0] / row["steady_ms"][0]
    row["first_ratio"] = row["first_s"][0] / base["first_s"][0]
    row["loss"] = results[0]["loss"]
    row["steps"], row["fallbacks"] = results[0]["steps"], results[0]["fallbacks"]
    rows.append(row)
  print(harness.table(rows, [("mode", "mode"), ("first step s", "first_s"),
                             ("first / plain", "first_ratio"), ("steady ms", "steady_ms"),
                             ("speedup", "speedup"), ("loss", "loss"), ("steps", "steps"),
                             ("fallbacks", "fallbacks")]))
  harness.write_json(opts.json, {"layers": opts.layers, "steps": opts.steps,
                                 "rounds": opts.rounds, "rows": rows, "runs": {
                                     m: r for (m,), r in runs.items()}})


if __name__ == "__main__":
  harness.main(main, child)
