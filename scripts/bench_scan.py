"""Compile time and step time of a decoder stack: unrolled LazyTensor, upstream scan_layers, ours.

Pre-norm Llama-style decoder layers (D=256, 4 heads, seq 64, batch 4, f32); a step is forward,
backward and SGD on the XLA CPU device. Compile time is torch_xla's CompileTime metric summed over
the first two steps (plus, for ours, the JAX trace and lowering: see first_step_s); step time is
the median of the timed steps. Prints a table and writes JSON (default out/bench_scan.json).

  python scripts/bench_scan.py [--layers 2 8 32] [--steps 5] [--json PATH]
"""
import argparse
import json
import os
import statistics
import time

import torch_xla_jaxbridge as jb
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch_xla.experimental.scan_layers import scan_layers as upstream_scan_layers

from torch_xla_jaxbridge.recipes.llama import DecoderLayer

D, HEADS, SEQ, BATCH = 256, 4, 64, 4


class PositionsBound(torch.nn.Module):
  """A decoder layer taking only the hidden state (upstream scan_layers passes one argument)."""

  def __init__(self):
    super().__init__()
    self.layer = DecoderLayer(D, HEADS, HEADS, 4 * D)
    self.register_buffer("positions", torch.arange(SEQ), persistent=False)

  def forward(self, h):
    return self.layer(h, self.positions)


def run(mode, layers, steps):
  torch.manual_seed(0)
  dev = torch_xla.device()
  stack = [PositionsBound().to(dev) for _ in range(layers)]
  optimizer = torch.optim.SGD([p for l in stack for p in l.parameters()], lr=1e-3)
  x = torch.randn(BATCH, SEQ, D).to(dev)  # CPU generator: the same input for every mode
  compile_before = (met.metric_data("CompileTime") or (0, 0))[1]
  times, losses = [], []
  for step in range(steps + 2):
    start = time.perf_counter()
    if mode == "unrolled LazyTensor":
      h = x
      for layer in stack:
        h = layer(h)
    elif mode == "upstream scan_layers":
      h = upstream_scan_layers(stack, x)
    else:
      h = jb.scan_layers(stack, x)
    loss = h.pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync(wait=True)
    losses.append(loss.item())
    elapsed = time.perf_counter() - start
    if step == 0:
      first = elapsed
    if step == 1:
      compile_s = ((met.metric_data("CompileTime") or (0, 0))[1] - compile_before) / 1e9
    if step >= 2:
      times.append(elapsed * 1e3)
  return {"mode": mode, "layers": layers, "compile_s": round(compile_s, 2),
          "first_step_s": round(first, 2), "step_ms": round(statistics.median(times), 1),
          "loss": round(losses[-1], 6)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--modes", nargs="+", default=["unrolled LazyTensor", "upstream scan_layers",
                                                     "ours scan_layers"])
  parser.add_argument("--json", default="out/bench_scan.json")
  opts = parser.parse_args()
  rows = []
  for layers in opts.layers:
    for mode in opts.modes:
      rows.append(run(mode, layers, opts.steps))
      print(rows[-1], flush=True)
  print(f"\n{'mode':<24}{'layers':>7}{'compile s':>11}{'first step s':>14}{'step ms':>10}"
        f"{'loss':>12}")
  for r in rows:
    print(f"{r['mode']:<24}{r['layers']:>7}{r['compile_s']:>11}{r['first_step_s']:>14}"
          f"{r['step_ms']:>10}{r['loss']:>12}")
  ours = {r["layers"]: r for r in rows if r["mode"] == "ours scan_layers"}
  upstream = {r["layers"]: r for r in rows if r["mode"] == "upstream scan_layers"}
  summary = {}
  if ours and min(ours) != max(ours):
    summary["ours_compile_deepest_over_shallowest"] = round(
        ours[max(ours)]["compile_s"] / max(ours[min(ours)]["compile_s"], 1e-9), 2)
  if max(ours, default=None) in upstream:
    summary["ours_over_upstream_compile_deepest"] = round(
        ours[max(ours)]["compile_s"] / max(upstream[max(ours)]["compile_s"], 1e-9), 2)
  print("targets: ours compile at deepest <= 1.5x shallowest; below upstream at deepest:", summary)
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"config": {"D": D, "heads": HEADS, "seq": SEQ, "batch": BATCH}, "rows": rows,
               "summary": summary}, f, indent=2)


if __name__ == "__main__":
  main()
