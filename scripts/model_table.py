"""Whole-model `jb.train_step` on Hugging Face models with padded batches, against eager CPU.

For each model of the test zoo (`test/zoo.py`, as `zoo-<name>`) and of the held-out set
(`test/heldout.py`), in its own process: two clipped AdamW steps of the whole model called as
training scripts call it (`model(**batch).loss`, a padded batch with its attention mask), torch's
on CPU against `jb.train_step`; the largest relative difference of the losses and of the gradient
norms, whether the step ran as one node or fell back (and why), and the traces. docs/models.md
holds the table.

  python scripts/model_table.py [--models zoo-llama bart ...] [--json scripts/out/model_table.json]
"""
import argparse
import pathlib
import sys
import time

import harness

TEST = pathlib.Path(__file__).resolve().parents[1] / "test"
LEFT_PADDED = ("zoo-llama", "qwen3")  # decoders also run on left-padded batches


def child(name: str, padding: str) -> dict:
  sys.path.insert(0, str(TEST))
  import heldout
  import zoo

  import torch_xla_jaxbridge as jb

  for zoo_name, (config, model_class, _, _) in zoo.ARCHITECTURES.items():
    heldout.MODELS[f"zoo-{zoo_name}"] = (
        lambda layerdrop=0.0, config=config, model_class=model_class: model_class(config()), "lm")
  start = time.perf_counter()
  eager, losses, eager_norms, norms = heldout.train_steps(name, padding=padding)
  step = next(r for r in reversed(jb.bridge_report().rows) if r.kind == "step")
  return {"model": name, "padding": padding, "status": step.status, "reason": step.reason or "",
          "loss_rel": max(abs(a - b) / abs(a) for a, b in zip(eager, losses)),
          "grad_norm_rel": max(abs(a - b) / abs(a) for a, b in zip(eager_norms, norms)),
          "traces": jb.cache_info().misses, "seconds": time.perf_counter() - start}


def main() -> None:
  sys.path.insert(0, str(TEST))
  import heldout
  import zoo

  names = [f"zoo-{n}" for n in zoo.ARCHITECTURES] + list(heldout.MODELS)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=names)
  parser.add_argument("--json", default="scripts/out/model_table.json")
  opts = parser.parse_args()
  rows = []
  for name in opts.models:
    for padding in ("left", "right") if name in LEFT_PADDED else ("right",):
      rows.append(harness.run_child(__file__, [name, padding], {"PJRT_DEVICE": "CPU"}))
      print(f"{name} ({padding}): {rows[-1]['status']}", flush=True)
  print(harness.table(rows, [("model", "model"), ("padding", "padding"), ("status", "status"),
                             ("loss rel", "loss_rel", ".1e"), ("norm rel", "grad_norm_rel", ".1e"),
                             ("traces", "traces"), ("reason", lambda r: r["reason"][:90])]))
  harness.write_json(opts.json, rows)


if __name__ == "__main__":
  harness.main(main, child)
