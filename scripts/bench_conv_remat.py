"""Recomputed convolutions on XLA:CPU: a two-block convolution stack (each block two convolutions
and ReLUs, as pytorch/xla's test_grad_checkpoint has them), the second block checkpointed, one
SGD step a step.

Modes, each in its own process, alternated over `--rounds` rounds:
- `lazytensor`: plain torch_xla, no checkpoint;
- `lazytensor checkpoint`: torch_xla's own `torch_xla.utils.checkpoint.checkpoint`;
- `jb.checkpoint`: the package's (remat "full": the backward recomputes in a conditional).

Commit edb7406 had a fourth mode, `jb.checkpoint` with the package's channels-last convolutions
switched off (a private switch, so no longer here); its numbers are in docs/performance.md.

Per step after warm-up: wall time until the device is done, median of `--steps`. Temp bytes come
from the compiled step (`jb.memory_report`). Prints medians [min-max] over rounds, writes JSON.

  python scripts/bench_conv_remat.py [--rounds 3] [--steps 5] [--kernel 1] [--channels 256]
"""
import argparse
import os
import statistics
import time

import harness

MODES = ("lazytensor", "lazytensor checkpoint", "jb.checkpoint")


def child(mode: str, steps: int, kernel: int, channels: int) -> dict:
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.utils.checkpoint as xla_checkpoint

  import torch_xla_jaxbridge as jb

  torch.manual_seed(0)
  conv = lambda: torch.nn.Conv2d(channels, channels, kernel, padding=kernel // 2)  # noqa: E731
  blocks = torch.nn.ModuleList(torch.nn.Sequential(conv(), torch.nn.ReLU(), conv(),
                                                   torch.nn.ReLU()) for _ in range(2)).to("xla")
  optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
  data = torch.randn(16, channels, 14, 14).to("xla")
  checkpoint = {"lazytensor": lambda block, x: block(x),
                "lazytensor checkpoint": xla_checkpoint.checkpoint}.get(mode, jb.checkpoint)

  def step():
    optimizer.zero_grad()
    x = checkpoint(blocks[1], blocks[0](data))
    loss = x.square().mean()
    loss.backward()
    optimizer.step()
    return loss

  temp = jb.memory_report(step).temp_bytes
  times = []
  for i in range(steps + 2):  # 2 warm-up steps compile
    xm.wait_device_ops()
    wall = time.perf_counter()
    loss = step()
    torch_xla.sync()
    xm.wait_device_ops()
    if i >= 2:
      times.append((time.perf_counter() - wall) * 1e3)
  return {"mode": mode, "step_ms": statistics.median(times), "temp_bytes": temp,
          "loss": loss.item()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--kernel", type=int, default=1)
  parser.add_argument("--channels", type=int, default=256)
  parser.add_argument("--json", default="scripts/out/bench_conv_remat.json")
  opts = parser.parse_args()
  results = harness.rounds([(mode,) for mode in MODES], opts.rounds, lambda mode: harness.run_child(
      __file__, [mode, opts.steps, opts.kernel, opts.channels], {"PJRT_DEVICE": "CPU"}),
                           describe=lambda run: f"{run['step_ms']:.1f} ms")
  base = harness.spread(r["step_ms"] for r in results[("lazytensor",)])[0]
  rows = []
  for (mode,), runs in results.items():
    row = {"mode": mode, **harness.spreads(runs, ["step_ms"]),
           "temp_bytes": runs[0]["temp_bytes"], "loss": runs[0]["loss"]}
    row["ratio"] = row["step_ms"][0] / base
    rows.append(row)
  print(f"\n{opts.kernel}x{opts.kernel} convolutions, {opts.channels} channels, batch 16, 14x14")
  print(harness.table(rows, [("mode", "mode"), ("step ms", "step_ms", ".1f"),
                             ("x lazytensor", "ratio", ".2f"),
                             ("temp MB", "temp_bytes", lambda b: f"{b / 1e6:.1f}"),
                             ("loss", "loss", ".6f")]))
  harness.write_json(opts.json, {"config": vars(opts), "runs": harness.in_order(results),
                                 "rows": rows, "load": os.getloadavg()})


if __name__ == "__main__":
  harness.main(main, child)
