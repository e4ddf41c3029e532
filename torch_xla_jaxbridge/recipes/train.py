"""The recipe's `train` entry point: `python -m torch_xla_jaxbridge.recipes.train [key=value ...]`.

Builds the configured model on `torch_xla.device()` (with `mesh.fsdp * mesh.tensor > 1`: SPMD,
parameters and batches sharded over the mesh), bridges or scans its decoder layers with the
configured remat policy, trains with AdamW, one `torch_xla.sync()` per step; prints a progress
line per step, writes per-step metrics and a summary, saves checkpoints and resumes from them.
"""
import json
import pathlib
import sys
import time

import torch_xla_jaxbridge as jb
import torch
import torch_xla
import torch_xla.debug.metrics as met

from torch_xla_jaxbridge import _compat
from torch_xla_jaxbridge.recipes import config, data, llama, precision, sharding


def prepare(cfg, device):
  """The model from `cfg`, on `device`, with its layers bridged or scanned as configured.

  Start-up never holds the whole model on the host: it is built on the meta device and each
  parameter is made on the CPU (one module at a time), then placed on `device`, under SPMD
  directly as its shards (`sharding.place`), in `model.dtype`.

  Example:
    >>> model = prepare(config.load(), torch_xla.device())
  """
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))
  model = llama.build(cfg["model"], seed=cfg["train"]["seed"],
                      place=sharding.placer(mesh, device))
  remat = config.remat_setting(cfg)
  if cfg["remat"]["stack_layers"]:
    model.layers = jb.StackedLayers(model.layers, remat=remat)
    if mesh is not None:  # the stacks are new parameters; the others keep their sharding
      sharding.shard_model(model, mesh)
  if cfg["remat"]["scan_layers"]:
    model.use_scan, model.scan_remat = True, remat
  elif cfg["remat"]["bridge"] == "layers" and not cfg["remat"]["stack_layers"]:
    model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat) for l in model.layers)
  return model


def _latest_checkpoint(out):
  found = sorted((out / "checkpoints").glob("step_*.pt"))
  return found[-1] if found else None


def _save(path, model, optimizer, step):
  path.parent.mkdir(parents=True, exist_ok=True)
  to_cpu = lambda tree: torch.utils._pytree.tree_map_only(  # noqa: E731
      torch.Tensor, lambda t: t.detach().cpu(), tree)
  torch.save({"step": step, "model": to_cpu(model.state_dict()),
              "optimizer": to_cpu(optimizer.state_dict())}, path)


def _resume(path, model, optimizer, device):
  saved = torch.load(path, weights_only=True)
  model.load_state_dict(saved["model"])
  optimizer.load_state_dict(saved["optimizer"])
  for state in optimizer.state.values():  # moments to the device; AdamW keeps `step` on the CPU
    for key, value in state.items():
      if key != "step" and isinstance(value, torch.Tensor):
        state[key] = value.to(device)
  return saved["step"]


def train(cfg, *, log=print):
  """Runs the configured training; returns the list of per-step losses of this run.

  Example:
    >>> losses = train(config.load(["train.steps=2"]), log=lambda line: None)
  """
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))  # SPMD before any tensor is placed
  device = torch_xla.device()
  out = pathlib.Path(cfg["out"])
  out.mkdir(parents=True, exist_ok=True)
  model = prepare(cfg, device)
  t = cfg["train"]

  def make(params):
    return torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"])

  optimizer = (precision.master_weights(model.parameters(), make) if t["master_weights"]
               else make(model.parameters()))
  start = 0
  checkpoint = _latest_checkpoint(out) if cfg["resume"] else None
  if checkpoint is not None:
    start = _resume(checkpoint, model, optimizer, device)
    log(f"resumed from {checkpoint} at step {start}")
  compiles_before = (met.metric_data("CompileTime") or (0,))[0]
  losses = []
  with open(out / "metrics.jsonl", "a" if checkpoint else "w") as metrics:
    for step in range(start, t["steps"]):
      began = time.perf_counter()
      inputs, targets = data.batch(step, batch=t["batch"], seq=t["seq"], seed=t["seed"],
                                   source=t["data"], vocab=cfg["model"]["vocab"])
      inputs, targets = inputs.to(device), targets.to(device)
      if mesh is not None:
        inputs, targets = sharding.shard_batch(inputs, mesh), sharding.shard_batch(targets, mesh)
      logits = model(inputs)
      loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
      loss.backward()
      optimizer.step()
      optimizer.zero_grad()
      traced = time.perf_counter()
      torch_xla.sync()
      value = loss.item()
      done = time.perf_counter()
      losses.append(value)
      row = {"step": step + 1, "loss": value, "step_ms": (done - began) * 1e3,
             "trace_ms": (traced - began) * 1e3,
             "tokens_per_s": t["batch"] * t["seq"] / (done - began)}
      metrics.write(json.dumps(row) + "\n")
      log(_progress(row, t["steps"]))
      every = t["checkpoint_every"]
      if every and (step + 1) % every == 0:
        _save(out / "checkpoints" / f"step_{step + 1:06d}.pt", model, optimizer, step + 1)
  _summary(cfg, out, losses, compiles_before, log, model if mesh is not None else None)
  return losses


def _progress(row, steps):
  filled = int(20 * row["step"] / steps)
  bar = "#" * filled + "." * (20 - filled)
  return (f"[{bar}] step {row['step']:>4}/{steps}  loss {row['loss']:.4f}  "
          f"{row['tokens_per_s']:>8.0f} tok/s  step {row['step_ms']:7.1f} ms  "
          f"trace {row['trace_ms']:6.1f} ms")


def _summary(cfg, out, losses, compiles_before, log, sharded_model=None):
  m = cfg["model"]
  layer = llama.DecoderLayer(m["dim"], m["heads"], m["kv_heads"], m["hidden"], m["experts"],
                             m["experts_per_token"])
  example = torch.zeros(cfg["train"]["batch"], cfg["train"]["seq"], m["dim"], requires_grad=True)
  residuals = jb.saved_residuals(layer, example, torch.arange(cfg["train"]["seq"]),
                                 remat=config.remat_setting(cfg))
  summary = {
      "config": cfg, "steps_run": len(losses),
      "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
      "compiles": (met.metric_data("CompileTime") or (0,))[0] - compiles_before,
      "traces": jb.cache_info().misses,
      "residual_bytes_per_layer": residuals.total_bytes,
      "residual_host_bytes_per_layer": residuals.host_bytes,
  }
  if sharded_model is not None:  # each parameter's sharding as it left the last step
    spec = _compat.xlac()._get_xla_sharding_spec
    summary["param_shardings"] = {n: spec(p) for n, p in sharded_model.named_parameters()}
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  log(f"done: {summary['steps_run']} steps, loss {summary['first_loss']} -> "
      f"{summary['last_loss']}, {summary['compiles']} compiles, {summary['traces']} traces, "
      f"{residuals.total_bytes} residual bytes per layer; summary in {out / 'summary.json'}")


def main(argv=None):
  """Parses `key=value` overrides, then trains. Config errors exit with the message, code 2."""
  try:
    cfg = config.load(sys.argv[1:] if argv is None else argv)
  except config.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  train(cfg)
  return 0


if __name__ == "__main__":
  sys.exit(main())
