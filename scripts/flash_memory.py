"""XLA's compiled memory of one training step of the recipe's Llama, reference attention against
the flash kernel (`model.attention`), as the sequence grows.

A small Llama (2 layers, D=64, 4 heads of 16, batch 1, f32), each decoder layer a BridgeModule,
forward, backward; `jb.memory_report` reads the temp bytes (activations, residuals, scratch) of
the program its sync compiles. On CPU the kernel runs in Pallas's interpret mode: the numbers
are XLA:CPU's buffer assignment, not a TPU's. Prints a table, writes JSON.

  python scripts/flash_memory.py [--seq 256 512 1024] [--json out/flash_memory.json]
"""
import argparse

import torch
import torch.nn.functional as F
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge.recipes import llama

import harness


def temp_bytes(attention, seq):
  torch.manual_seed(0)
  device = torch_xla.device()
  model = llama.Llama(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=192,
                      attention=attention).to(device)
  model.layers = torch.nn.ModuleList(jb.BridgeModule(layer) for layer in model.layers)
  tokens = torch.randint(0, 256, (1, seq + 1)).to(device)

  def step():
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

  return jb.memory_report(step).temp_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
  parser.add_argument("--json", default="out/flash_memory.json")
  opts = parser.parse_args()
  rows = [{"seq": seq, "reference_temp_bytes": temp_bytes("reference", seq),
           "flash_temp_bytes": temp_bytes("flash", seq)} for seq in opts.seq]
  for r in rows:
    r["ratio"] = round(r["reference_temp_bytes"] / r["flash_temp_bytes"], 2)
  mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  print(harness.table(rows, [("seq", "seq"), ("reference temp MB", "reference_temp_bytes", mb),
                             ("flash temp MB", "flash_temp_bytes", mb), ("ratio", "ratio", str)]))
  harness.write_json(opts.json, rows)


if __name__ == "__main__":
  harness.main(main)
