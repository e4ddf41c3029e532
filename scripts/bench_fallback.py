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
import os
import pathlib
import statistics
import sys
import time
import warnings

import harness

TEST = pathlib.Path(__file__).resolve().parents[1] / "test"
MODES = ("lazytensor", "train_step (fallback)")


def child(model_name: str, mode: str, steps: int) -> dict:
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--model", default="bart")
  parser.add_argument("--json", default="scripts/out/bench_fallback.json")
  opts = parser.parse_args()
  results = harness.rounds(
      [(mode,) for mode in MODES], opts.rounds,
      lambda mode: harness.run_child(__file__, [opts.model, mode, opts.steps],
                                     {"PJRT_DEVICE": "CPU"}),
      describe=lambda run: f"host {run['host_ms']:.1f} ms, step {run['step_ms']:.1f} ms")
  rows = [{"mode": mode, "fallbacks": runs[0]["fallbacks"],
           **harness.spreads(runs, ["host_ms", "step_ms"])} for (mode,), runs in results.items()]
  print(harness.table(rows, [("mode", "mode"), ("host CPU ms", "host_ms", ".1f"),
                             ("step wall ms", "step_ms", ".1f"), ("fallbacks", "fallbacks")]))
  harness.write_json(opts.json, {"runs": harness.in_order(results), "rows": rows,
                                 "load": os.getloadavg()})


if __name__ == "__main__":
  harness.main(main, child)
