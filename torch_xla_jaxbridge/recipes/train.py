"""The recipe's `train` entry point: `python -m torch_xla_jaxbridge.recipes.train [key=value ...]`.

Builds the configured model on `torch_xla.device()` (with `mesh.fsdp * mesh.tensor > 1`: SPMD,
parameters and batches sharded over the mesh), bridges or scans its decoder layers with the
configured remat policy, trains with the configured optimizer (`jb.optim.AdamW` by default, with
gradient clipping and a learning-rate schedule), one `torch_xla.sync()` per step; prints a progress
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
from torch_xla_jaxbridge.recipes import config, data, llama, sharding


def prepare(cfg, device):
  """The model from `cfg`, on `device`, with its layers bridged or scanned as configured.

  Example:
    >>> model = prepare(config.load(), torch_xla.device())
  """
  torch.manual_seed(cfg["train"]["seed"])
  model = llama.build(cfg["model"]).to(device)
  remat = config.remat_setting(cfg)
  if cfg["remat"]["stack_layers"]:  # before sharding: the stacks are the parameters to shard
    model.layers = jb.StackedLayers(model.layers, remat=remat)
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))
  if mesh is not None:
    sharding.shard_model(model, mesh)
  if cfg["remat"]["scan_layers"]:
    model.use_scan, model.scan_remat = True, remat
  elif cfg["remat"]["bridge"] == "layers" and not cfg["remat"]["stack_layers"]:
    model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat) for l in model.layers)
  return model


def make_optimizer(model, t):
  """The optimizer `train.optimizer` names, with the `train` section's lr, weight decay and (for
  jb.optim.AdamW, which clips inside its step) max_grad_norm.

  Example:
    >>> type(make_optimizer(torch.nn.Linear(2, 2), config.load()["train"])).__name__
    'AdamW'
  """
  lr, weight_decay = t["lr"], t["weight_decay"]
  if t["optimizer"] == "adamw":
    return jb.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                          max_grad_norm=t["max_grad_norm"] or None)
  if t["optimizer"] == "torch-adamw":
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
  return jb.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)


def make_schedule(optimizer, t, start=0):
  """`LambdaLR` for `train.warmup_steps` then `train.schedule`, at step `start` (a resumed run
  goes on with the learning rate of its step; the base rate is `train.lr`).

  Example:
    >>> t = config.load(["train.steps=10", "train.warmup_steps=4"])["train"]
    >>> optimizer = make_optimizer(torch.nn.Linear(2, 2), t)
    >>> round(make_schedule(optimizer, t, start=2).get_last_lr()[0] / t["lr"], 2)
    0.6
  """
  factor = {"constant": lambda warmup, steps: jb.optim.warmup_constant(warmup),
            "cosine": jb.optim.warmup_cosine,
            "linear": jb.optim.warmup_linear}[t["schedule"]](t["warmup_steps"], t["steps"])
  for group in optimizer.param_groups:
    group["initial_lr"] = t["lr"]
  return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start - 1)


def optimizer_step(optimizer, schedule, model, t):
  """One step of `optimizer` (torch's optimizers after `clip_grad_norm_` when
  `train.max_grad_norm` is set), then of `schedule`; returns (the gradients' norm before
  clipping as an XLA tensor, None where nothing computed it; the learning rate of this step)."""
  lr = optimizer.param_groups[0]["lr"]
  norm = None
  if not isinstance(optimizer, jb.optim.AdamW) and t["max_grad_norm"]:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
  optimizer.step()
  schedule.step()
  return (optimizer.grad_norm if isinstance(optimizer, jb.optim.AdamW) else norm), lr


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
  optimizer = make_optimizer(model, t)
  start = 0
  checkpoint = _latest_checkpoint(out) if cfg["resume"] else None
  if checkpoint is not None:
    start = _resume(checkpoint, model, optimizer, device)
    log(f"resumed from {checkpoint} at step {start}")
  schedule = make_schedule(optimizer, t, start)
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
      grad_norm, lr = optimizer_step(optimizer, schedule, model, t)
      optimizer.zero_grad()
      traced = time.perf_counter()
      torch_xla.sync()
      value = loss.item()
      done = time.perf_counter()
      losses.append(value)
      row = {"step": step + 1, "loss": value, "step_ms": (done - began) * 1e3,
             "trace_ms": (traced - began) * 1e3,
             "tokens_per_s": t["batch"] * t["seq"] / (done - began),
             "grad_norm": None if grad_norm is None else grad_norm.item(), "lr": lr}
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
