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
import json
import os
import pathlib
import subprocess
import sys
import time

TEST = pathlib.Path(__file__).resolve().parents[1] / "test"
LEFT_PADDED = ("zoo-llama", "qwen3")  # decoders also run on left-padded batches


def child(name, padding):
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


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    print(json.dumps(child(sys.argv[2], sys.argv[3])))
    return
  sys.path.insert(0, str(TEST))
  import heldout
  import zoo

  names = [f"zoo-{n}" for n in zoo.ARCHITECTURES] + list(heldout.MODELS)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=names)
  parser.add_argument("--json", default="scripts/out/model_table.json")
  opts = parser.parse_args()
  rows = []
  print(f"{'model':<16}{'padding':<9}{'status':<10}{'loss rel':>10}{'norm rel':>10}{'traces':>8}"
        f"  reason")
  for name in opts.models:
    for padding in ("left", "right") if name in LEFT_PADDED else ("right",):
      proc = subprocess.run([sys.executable, __file__, "--child", name, padding],
                            capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
      if proc.returncode != 0:
        raise RuntimeError(f"{name} ({padding}) failed:\n{proc.stderr[-3000:]}")
      row = json.loads(proc.stdout.strip().splitlines()[-1])
      rows.append(row)
      print(f"{name:<16}{padding:<9}{row['status']:<10}{row['loss_rel']:>10.1e}"
            f"{row['grad_norm_rel']:>10.1e}{row['traces']:>8}  {row['reason'][:90]}", flush=True)
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
