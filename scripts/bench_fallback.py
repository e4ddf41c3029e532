"""What a fallback costs: a model whose whole step cannot be one node (BART: a LayerDrop coin in
its encoder and decoder), trained as plain torch_xla trains it and through `jb.train_step`, which
falls back to LazyTensor glue around bridged layers.

Modes, each run in its own process, alternated over `--rounds` rounds:
- `lazytensor`: plain torch_xla, `torch.optim.AdamW` with `clip_grad_norm_`;
- `train_step (fallback)`: `jb.train_step(lambda b: model(**b).loss, jb.optim.AdamW(...,
  max_grad_norm=...))`, which falls back at the coin and bridges each layer.

Per step after warm-up (no compiles): host CPU time (process CPU of the step body and its
`torch_xla.sync()`, the device idle before each step) and wall time until the device is done.
Prints medians [min-max] over rounds and writes JSON.

  python scripts/bench_fallback.py [--rounds 3] [--steps 10] [--model bart]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import warnings

TEST = pathlib.Path(__file__).resolve().parents[1] / "test"
MODES = ("lazytensor", "train_step (fallback)")


def child(model_name, mode, steps):
  sys.path.insert(0, str(TEST))
  import heldout
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm

  import torch_xla_jaxbridge as jb

  _, model = heldout.build(model_name)
  batch = {k: v.to("xla") for k, v in heldout.batch(model_name).items()}
  if mode == "lazytensor":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
      opt.zero_grad()
      loss = model(**batch).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
      opt.step()
      return loss
  else:
    step = jb.train_step(lambda b: model(**b).loss,
                         jb.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=0.5))
    step = (lambda inner: lambda: inner(batch))(step)
  times = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    for i in range(steps + 3):  # 3 warm-up steps compile
      xm.wait_device_ops()
      cpu, wall = time.process_time(), time.perf_counter()
      loss = step()
      torch_xla.sync()
      host = (time.process_time() - cpu) * 1e3
      loss.item()
      if i >= 3:
        times.append((host, (time.perf_counter() - wall) * 1e3))
  return {"model": model_name, "mode": mode, "host_ms": statistics.median(t[0] for t in times),
          "step_ms": statistics.median(t[1] for t in times), "loss": loss.item(),
          "fallbacks": len(jb.bridge_report().fallbacks())}


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--model", default="bart")
  parser.add_argument("--json", default="scripts/out/bench_fallback.json")
  opts = parser.parse_args()
  runs = []
  for round_ in range(opts.rounds):
    for mode in MODES:
      proc = subprocess.run([sys.executable, __file__, "--child", opts.model, mode,
                             str(opts.steps)], capture_output=True, text=True,
                            env=dict(os.environ, PJRT_DEVICE="CPU"))
      if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
      runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      print(f"round {round_}: {mode}: host {runs[-1]['host_ms']:.1f} ms, step "
            f"{runs[-1]['step_ms']:.1f} ms", flush=True)
  rows = []
  print(f"{'mode':<24}{'host CPU ms':>26}{'step wall ms':>26}{'fallbacks':>11}")
  for mode in MODES:
    mine = [r for r in runs if r["mode"] == mode]
    row = {"mode": mode, "fallbacks": mine[0]["fallbacks"]}
    for key in ("host_ms", "step_ms"):
      values = [r[key] for r in mine]
      row[key] = [statistics.median(values), min(values), max(values)]
    rows.append(row)
    span = lambda k: f"{row[k][0]:.1f} [{row[k][1]:.1f}-{row[k][2]:.1f}]"  # noqa: E731
    print(f"{mode:<24}{span('host_ms'):>26}{span('step_ms'):>26}{row['fallbacks']:>11}")
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"runs": runs, "rows": rows, "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
  main()
