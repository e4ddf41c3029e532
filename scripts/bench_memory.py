"""Compiled memory of the recipe model's training step, LazyTensor against every bridged mode.

The recipe's Llama (vocab 256, 4 heads, 2 KV heads, hidden 4*dim), one step = forward, cross
entropy, backward, SGD, read with `jb.memory_report` from the program the step's sync compiles:
argument, output, temp and total bytes, and total against LazyTensor's. The AdamW modes (the
recipe's default one-node step `jb.train_step`, LazyTensor with `jb.optim.AdamW`, its baseline,
and LazyTensor with `torch.optim.AdamW`) measure a step after the first, with the moments as
arguments. Each mode runs in its own process. The `offload` column is from lowering for TPU
(`jb.lower_bridged`): the residual bytes the mode's policy keeps in host memory per step (XLA:CPU
has one memory, so the step bytes here do not show it). Writes JSON (default
scripts/out/bench_memory.json).

  python scripts/bench_memory.py [--layers 8] [--dim 256] [--seq 256] [--batch 4] [--json PATH]
  python scripts/bench_memory.py --fit BYTES   # the largest batch each mode compiles within BYTES
  python scripts/bench_memory.py --fit BYTES --modes "LazyTensor torch AdamW" TrainStep:full \
      --json scripts/out/bench_memory_adamw.json  # the same for the recipe's default step
"""
import argparse
import json
import os

import harness

MODES = [("LazyTensor", None), ("BridgeModule", None), ("BridgeModule", "dots_no_batch"),
         ("BridgeModule", "minimal"), ("BridgeModule", "full"),
         ("BridgeModule", "minimal_offloaded"), ("StackedLayers", None),
         ("StackedLayers", "full"), ("StackedLayers", "minimal_offloaded"),
         ("LazyTensor torch AdamW", None), ("LazyTensor AdamW", None), ("TrainStep", None),
         ("TrainStep", "minimal"), ("TrainStep", "full")]
# modes with AdamW (its moments are arguments too), compared with "LazyTensor AdamW" (the plain
# step with jb.optim.AdamW); "LazyTensor torch AdamW" has torch.optim.AdamW instead.
# TrainStep: the recipe's default step (jb.train_step), a BridgeModule with `remat` per layer
ADAMW_MODES = ("LazyTensor AdamW", "TrainStep", "LazyTensor torch AdamW")
FIT_MODES = ["LazyTensor", "BridgeModule:full", "StackedLayers:full"]  # the first is the baseline


def build(mode, remat, layers, dim):
  """The recipe model on the XLA device, its decoder layers run as `mode` says."""
  import torch
  import torch_xla_jaxbridge as jb
  from torch_xla_jaxbridge.recipes.llama import Llama

  torch.manual_seed(0)
  model = Llama(vocab=256, dim=dim, layers=layers, heads=4, kv_heads=2, hidden=4 * dim)
  if mode in ("BridgeModule", "TrainStep"):
    model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat) for l in model.layers)
  elif mode == "StackedLayers":
    model.layers = jb.StackedLayers(model.layers, remat=remat)
  elif not mode.startswith("LazyTensor"):
    raise ValueError(mode)
  return model.to("xla")


def measure(mode, remat, layers, dim, seq, batch, run=True):
  """One row: the step's compiled memory, and the residual bytes the policy offloads; `run=False`
  compiles the step without running it (and without the offload column)."""
  import warnings

  import torch
  import torch_xla
  import torch_xla_jaxbridge as jb

  warnings.simplefilter("ignore")  # CPU drops offload annotations: the offload column says it
  model = build(mode, remat, layers, dim)
  adamw = mode in ADAMW_MODES
  optimizer = (torch.optim.AdamW if mode == "LazyTensor torch AdamW" else
               jb.optim.AdamW if adamw else torch.optim.SGD)(model.parameters(), lr=1e-3)
  tokens = torch.randint(0, 256, (batch, seq), device="xla")
  loss = lambda: torch.nn.functional.cross_entropy(  # noqa: E731
      model(tokens).flatten(0, 1), tokens.flatten())
  torch_xla.sync()

  def backward_step():
    loss().backward()
    optimizer.step()
    optimizer.zero_grad()

  step = jb.train_step(loss, optimizer) if mode == "TrainStep" else backward_step
  if adamw:  # the first step also makes the moments; the step measured is a later one
    step()
    torch_xla.sync()
  report = jb.memory_report(step, sync=run)
  row = {"mode": mode, "remat": str(remat), "layers": layers, "dim": dim, "seq": seq,
         "batch": batch, "argument_bytes": report.argument_bytes,
         "output_bytes": report.output_bytes, "alias_bytes": report.alias_bytes,
         "temp_bytes": report.temp_bytes, "total_bytes": report.total_bytes,
         "offload_bytes": offload_bytes(mode, remat, layers, dim, seq, batch) if run else 0}
  return row


def offload_bytes(mode, remat, layers, dim, seq, batch):
  """Residual bytes per step that the policy keeps in host memory on TPU: the host rows of
  `saved_residuals`, checked against the `pinned_host` annotations of `lower_bridged`."""
  import torch
  import torch_xla_jaxbridge as jb
  from torch_xla_jaxbridge.recipes.llama import DecoderLayer

  if mode.startswith("LazyTensor") or not jb.remat.offloads(remat):
    return 0
  torch.manual_seed(0)
  count = layers if mode in ("BridgeModule", "TrainStep") else 1
  layer = DecoderLayer(dim, 4, 2, 4 * dim)
  if mode == "StackedLayers":
    layer = jb.StackedLayers([DecoderLayer(dim, 4, 2, 4 * dim) for _ in range(layers)],
                             remat=remat)
    remat_arg = None  # the stack's own policy applies to its scan body
    fn = jb.bridge(lambda h, p: layer(h, p))
  else:
    remat_arg, fn = remat, layer
  h = torch.randn(batch, seq, dim, requires_grad=True)
  positions = torch.arange(seq)
  report = jb.saved_residuals(fn, h, positions, remat=remat_arg)
  forward, _ = jb.lower_bridged(fn, h, positions, platform="tpu", remat=remat_arg)
  hosted = [r for r in report.rows if r.where == "host"]
  annotated = forward.count('_xla_buffer_placement = "pinned_host"')
  if annotated < len(hosted):
    raise AssertionError(f"{mode} {remat}: {len(hosted)} host residuals but {annotated} "
                         f"pinned_host annotations in the TPU lowering")
  return count * report.host_bytes


def parse(spec):
  """`(mode, remat)` of a `mode[:remat]` entry (`StackedLayers:full`; no remat: None)."""
  mode, _, remat = spec.partition(":")
  return mode, remat or None


def child(spec: str, layers: int, dim: int, seq: int, batch: int, run: bool) -> dict:
  """`measure` of the mode `spec` (`mode[:remat]`), in a fresh process."""
  return measure(*parse(spec), layers, dim, seq, batch, run)


def run_isolated(mode, remat, layers, dim, seq, batch, run=True):
  """`measure(...)` in a fresh process (compiled programs and caches of one mode never reach
  another)."""
  return harness.run_child(__file__, [f"{mode}:{remat or ''}", layers, dim, seq, batch, run])


def fit(mode, remat, layers, dim, seq, budget):
  """`(batch, trials)`: the largest batch whose step compiles within `budget` bytes (0: none),
  each trial a compile in its own process. Bytes grow about linearly with the batch: batches 1
  and 2 give the first guess, then the answer is bracketed and bisected."""
  totals = {}

  def fits(batch):
    if batch not in totals:
      row = run_isolated(mode, remat, layers, dim, seq, batch, False)
      totals[batch] = row["total_bytes"]
      print(f"  {mode} {remat} batch {batch}: {totals[batch]:,d} B", flush=True)
    return totals[batch] <= budget

  if not fits(1):
    return 0, totals
  fits(2)
  guess = max(1, 1 + (budget - totals[1]) // max(totals[2] - totals[1], 1))
  low, high = (guess, None) if fits(guess) else (1, guess)
  while high is None:  # grow until a batch does not fit
    high = low * 2 if not fits(low * 2) else None
    low = low if high is not None else low * 2
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low, totals


def _baseline(mode):
  return "LazyTensor AdamW" if mode in ADAMW_MODES else "LazyTensor"


def mib(value):
  return f"{value / 2**20:.1f}"


def table(rows):
  base = {(r["mode"], r["layers"], r["dim"], r["seq"], r["batch"]): r["total_bytes"]
          for r in rows if r["mode"].startswith("LazyTensor")}
  for r in rows:
    ref = base.get((_baseline(r["mode"]), r["layers"], r["dim"], r["seq"], r["batch"]))
    r["vs_lazytensor"] = round(r["total_bytes"] / ref, 3) if ref else None
  return harness.table(rows, [
      ("mode", "mode"), ("remat", "remat"), ("layers", "layers"),
      ("args MiB", "argument_bytes", mib), ("out MiB", "output_bytes", mib),
      ("temp MiB", "temp_bytes", mib), ("total MiB", "total_bytes", mib),
      ("vs Lazy", "vs_lazytensor", "g"), ("offload MiB", "offload_bytes", mib)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[8])
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--modes", nargs="+", help="mode[:remat] entries, e.g. StackedLayers:full")
  parser.add_argument("--fit", type=int, help="a budget in bytes: the largest batch per mode")
  parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out",
                                                     "bench_memory.json"))
  opts = parser.parse_args()
  if opts.fit:
    return fit_all(opts)
  modes = [parse(m) for m in opts.modes] if opts.modes else MODES
  rows = []
  for layers in opts.layers:
    for mode, remat in modes:
      rows.append(run_isolated(mode, remat, layers, opts.dim, opts.seq, opts.batch))
      print(json.dumps(rows[-1]), flush=True)
  print(f"\nrecipe Llama dim {opts.dim}, seq {opts.seq}, batch {opts.batch}, SGD (AdamW modes: "
        f"AdamW, against LazyTensor AdamW); compiled XLA:CPU step (jb.memory_report); "
        f"offload: host bytes on TPU (lower_bridged)")
  print(table(rows))
  harness.write_json(opts.json, {"dim": opts.dim, "seq": opts.seq, "batch": opts.batch,
                                 "rows": rows})


def fit_all(opts):
  """`--fit`: the largest batch of each mode within the budget, a table and JSON."""
  rows = []
  for mode, remat in [parse(m) for m in opts.modes or FIT_MODES]:
    batch, totals = fit(mode, remat, opts.layers[0], opts.dim, opts.seq, opts.fit)
    rows.append({"mode": mode, "remat": str(remat), "batch": batch,
                 "total_bytes": totals.get(batch), "trials": len(totals)})
  base = rows[0]["batch"]
  for r in rows:
    r["vs_first"] = round(r["batch"] / base, 2) if base else None
  print(f"\nlargest batch within {opts.fit:,d} B: recipe Llama {opts.layers[0]} layers, dim "
        f"{opts.dim}, seq {opts.seq}, SGD, AdamW in the AdamW modes (compiled XLA:CPU step)")
  print(harness.table(rows, [("mode", "mode"), ("remat", "remat"), ("batch", "batch"),
                             ("total MiB", "total_bytes", mib),
                             (f"vs {rows[0]['mode']}", "vs_first", "g")]))
  harness.write_json(opts.json.replace(".json", "_fit.json"), {
      "budget_bytes": opts.fit, "layers": opts.layers[0], "dim": opts.dim, "seq": opts.seq,
      "rows": rows})


if __name__ == "__main__":
  harness.main(main, child)
