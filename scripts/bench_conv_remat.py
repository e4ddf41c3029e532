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
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("lazytensor", "lazytensor checkpoint", "jb.checkpoint")


def child(mode, steps, kernel, channels):
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


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    print(json.dumps(child(sys.argv[2], *map(int, sys.argv[3:6]))))
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--kernel", type=int, default=1)
  parser.add_argument("--channels", type=int, default=256)
  parser.add_argument("--json", default="scripts/out/bench_conv_remat.json")
  opts = parser.parse_args()
  runs = []
  for round_ in range(opts.rounds):
    for mode in MODES:
      proc = subprocess.run([sys.executable, __file__, "--child", mode, str(opts.steps),
                             str(opts.kernel), str(opts.channels)], capture_output=True,
                            text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
      if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
      runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      print(f"round {round_}: {mode}: {runs[-1]['step_ms']:.1f} ms", flush=True)
  base = statistics.median(r["step_ms"] for r in runs if r["mode"] == "lazytensor")
  rows = []
  print(f"\n{opts.kernel}x{opts.kernel} convolutions, {opts.channels} channels, batch 16, 14x14")
  print(f"{'mode':<32}{'step ms':>24}{'x lazytensor':>14}{'temp MB':>10}{'loss':>12}")
  for mode in MODES:
    mine = [r for r in runs if r["mode"] == mode]
    values = [r["step_ms"] for r in mine]
    row = {"mode": mode, "step_ms": [statistics.median(values), min(values), max(values)],
           "ratio": statistics.median(values) / base, "temp_bytes": mine[0]["temp_bytes"],
           "loss": mine[0]["loss"]}
    rows.append(row)
    span = f"{row['step_ms'][0]:.1f} [{row['step_ms'][1]:.1f}-{row['step_ms'][2]:.1f}]"
    print(f"{mode:<32}{span:>24}{row['ratio']:>14.2f}{row['temp_bytes'] / 1e6:>10.1f}"
          f"{row['loss']:>12.6f}")
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"config": vars(opts), "runs": runs, "rows": rows, "load": os.getloadavg()}, f,
              indent=1)


if __name__ == "__main__":
  main()
