"""Residuals, compiled temp memory and step time per remat policy.

For the Llama-style decoder layer and a small whole model (embedding, 4 layers, head), prints the
residual bytes per layer and in total for every policy, the compiled temp memory of one
forward+backward (XLA's compiled step, `jb.memory_report`), and the median step time of the
bridged model on the XLA CPU device; writes JSON (default out/remat_report.json).

  python scripts/remat_report.py [--steps 5] [--json PATH] [--tables]
"""
import argparse
import copy
import statistics
import time
import warnings

import torch_xla_jaxbridge as jb
import torch
import torch_xla

from torch_xla_jaxbridge.recipes.llama import DecoderLayer, Llama

import harness

POLICIES = [None, *jb.remat.presets()]
BATCH, SEQ, DIM, LAYERS = 4, 64, 128, 4


def temp_bytes(module, args, remat):
  """Compiled temp memory of one forward+backward of the bridged module (XLA's buffer
  assignment of the step's program, `jb.memory_report`), on XLA:CPU."""
  dev = torch_xla.device()
  layer = jb.BridgeModule(copy.deepcopy(module).to(dev), remat=remat)
  inputs = [a.detach().to(dev).requires_grad_(a.requires_grad) for a in args]
  torch_xla.sync()
  return jb.memory_report(lambda: layer(*inputs).sum().backward()).temp_bytes


def step_ms(remat, steps):
  torch.manual_seed(0)
  dev = torch_xla.device()
  model = Llama(vocab=256, dim=DIM, layers=LAYERS, heads=4, kv_heads=2, hidden=4 * DIM).to(dev)
  model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat) for l in model.layers)
  optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
  tokens = torch.randint(0, 256, (BATCH, SEQ), device=dev)
  times = []
  for step in range(steps + 2):
    start = time.perf_counter()
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync(wait=True)
    if step >= 2:  # after compiling
      times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--json", default="out/remat_report.json")
  parser.add_argument("--tables", action="store_true", help="print every residual table")
  opts = parser.parse_args()
  warnings.simplefilter("ignore")  # CPU drops offload annotations; said once in the header
  layer = DecoderLayer(DIM, 4, 2, 4 * DIM)
  x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
  positions = torch.arange(SEQ)
  model = Llama(vocab=256, dim=DIM, layers=LAYERS, heads=4, kv_heads=2, hidden=4 * DIM)
  tokens = torch.randint(0, 256, (BATCH, SEQ))
  rows = []
  for remat in POLICIES:
    per_layer = jb.saved_residuals(layer, x, positions, remat=remat)
    whole = jb.saved_residuals(model, tokens, remat=remat)
    if opts.tables:
      print(f"--- decoder layer, remat={remat}\n{per_layer}\n")
    rows.append({
        "policy": str(remat), "layer_residual_bytes": per_layer.total_bytes,
        "layer_device_bytes": per_layer.device_bytes, "layer_host_bytes": per_layer.host_bytes,
        "model_residual_bytes": whole.total_bytes,
        "layer_temp_bytes": temp_bytes(layer, (x, positions), remat),
        "step_ms": round(step_ms(remat, opts.steps), 2)})
  print(f"decoder layer D={DIM} batch={BATCH} seq={SEQ}; model: {LAYERS} layers, per-layer "
        f"bridging; step = fwd+bwd+SGD on XLA:CPU (offload is a no-op on CPU)")
  header = ("policy", "layer_residual_bytes", "layer_host_bytes", "model_residual_bytes",
            "layer_temp_bytes", "step_ms")
  print(harness.table(rows, [(h, h, str) for h in header]))
  harness.write_json(opts.json, {"batch": BATCH, "seq": SEQ, "dim": DIM, "layers": LAYERS,
                                 "rows": rows})


if __name__ == "__main__":
  harness.main(main)
