"""The recipe's `train` entry point: `python -m torch_xla_jaxbridge.recipes.train [key=value ...]`.

Builds the configured model on `torch_xla.device()` (with `mesh.fsdp * mesh.tensor > 1`: SPMD,
parameters and batches sharded over the mesh), bridges or scans its decoder layers with the
configured remat policy, trains with the configured optimizer (`jb.optim.AdamW` by default,
with gradient clipping and a learning-rate schedule), one `torch_xla.sync()` per step (in the input loader,
torch_xla's `MpDeviceLoader`), without waiting for the device: losses are read by asynchronous
step closures every `train.log_every` steps, so the host traces a step while the previous one
runs. Writes per-step metrics (`recipes.metrics`), progress lines with an ETA and a summary;
saves checkpoints and resumes from them.
"""
import collections
import dataclasses
import json
import pathlib
import statistics
import sys
import threading
import time
from typing import Callable

import torch_xla_jaxbridge as jb
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr

from torch_xla_jaxbridge.recipes import (checkpoint, config, data, llama, metrics, precision,
                                         rundir, sharding)


def prepare(cfg, device):
  """The model from `cfg`, on `device`, with its layers bridged or scanned as configured.

  Start-up never holds the whole model on the host: it is built on the meta device and each
  parameter is made on the CPU (one module at a time), then placed on `device`, under SPMD
  directly as its shards (`sharding.place`), in `model.dtype`.

  Example:
    >>> model = prepare(config.load(), torch_xla.device())
  """
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))
  remat = config.remat_setting(cfg)
  stack = (lambda layers: jb.StackedLayers(layers, remat=remat)) if config.stacked(cfg) else None
  model = llama.build(cfg["model"], seed=cfg["train"]["seed"],
                      place=sharding.placer(mesh, device), stack=stack)
  if mesh is not None:
    model.overrides = sharding.attention_overrides(cfg["model"]["attention"], *mesh.mesh_shape,
                                                   cfg["model"]["kv_heads"])
  if cfg["remat"]["scan_layers"]:
    model.use_scan, model.scan_remat = True, remat
  elif cfg["remat"]["bridge"] != "none" and not config.stacked(cfg):
    fallback = cfg["remat"]["fallback"]
    model.layers = torch.nn.ModuleList(jb.BridgeModule(l, remat=remat, fallback=fallback)
                                       for l in model.layers)
  return model


def make_step(cfg, model, optimizer):
  """One training step on a batch: returns (loss, the gradients' norm before clipping or None,
  the learning rate of the step), all without waiting for the device. With `remat.bridge=step`
  the whole step is one graph node (`jb.train_step`) unless `train.master_weights`; otherwise
  forward, `loss.backward()` and the optimizer's step.

  Example:
    >>> cfg = config.load(["train.steps=1"])
    >>> model = prepare(cfg, torch_xla.device())
    >>> optimizer = make_optimizer(model.parameters(), cfg["train"])
    >>> step = make_step(cfg, model, optimizer)
  """
  t = cfg["train"]
  loss_of = lambda inputs, targets: torch.nn.functional.cross_entropy(  # noqa: E731
      model(inputs).flatten(0, 1), targets.flatten())
  # master weights: the optimizer trains float32 copies the loss does not read, so the step is
  # forward, backward and the optimizer's step (its hooks move the gradients and values)
  if cfg["remat"]["bridge"] == "step" and not t["master_weights"]:
    fused = jb.train_step(loss_of, optimizer, fallback=cfg["remat"]["fallback"],
                          layer_loop=cfg["remat"]["layer_loop"])

    def fused_step(inputs, targets, schedule):
      lr = optimizer.param_groups[0]["lr"]
      loss = fused(inputs, targets)
      schedule.step()
      return loss, optimizer.grad_norm, lr
    return fused_step

  def step(inputs, targets, schedule):
    loss = loss_of(inputs, targets)
    loss.backward()
    grad_norm, lr = optimizer_step(optimizer, schedule, model, t)
    optimizer.zero_grad()
    return loss, grad_norm, lr
  return step


def make_optimizer(params, t):
  """The optimizer `train.optimizer` names, with the `train` section's lr and weight decay,
  `train.optimizer_args` (over the recipe's defaults for it) and, for a `jb.optim` optimizer,
  which clips inside its step, max_grad_norm.

  Example:
    >>> type(make_optimizer(torch.nn.Linear(2, 2).parameters(), config.load()["train"])).__name__
    'AdamW'
  """
  kwargs = {"lr": t["lr"], "weight_decay": t["weight_decay"],
            **config.OPTIMIZER_ARGS.get(t["optimizer"], {}), **t["optimizer_args"]}
  if t["optimizer"] == config.TORCH_ADAMW:
    return torch.optim.AdamW(params, **kwargs)
  return jb.optim.optimizers()[t["optimizer"]](params, max_grad_norm=t["max_grad_norm"] or None,
                                               **kwargs)


def make_schedule(optimizer, t, start=0):
  """`LambdaLR` for `train.warmup_steps` then `train.schedule`, at step `start` (a resumed run
  goes on with the learning rate of its step; the base rate is `train.lr`).

  Example:
    >>> t = config.load(["train.steps=10", "train.warmup_steps=4"])["train"]
    >>> optimizer = make_optimizer(torch.nn.Linear(2, 2).parameters(), t)
    >>> round(make_schedule(optimizer, t, start=2).get_last_lr()[0] / t["lr"], 2)
    0.6
  """
  schedules: dict[str, Callable] = {
      "constant": lambda warmup, steps: jb.optim.warmup_constant(warmup),
      "cosine": jb.optim.warmup_cosine, "linear": jb.optim.warmup_linear}
  factor = schedules[t["schedule"]](t["warmup_steps"], t["steps"])
  for group in optimizer.param_groups:
    group["initial_lr"] = t["lr"]
  return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start - 1)


def optimizer_step(optimizer, schedule, model, t):
  """One step of `optimizer` (torch's optimizers after `clip_grad_norm_` when
  `train.max_grad_norm` is set), then of `schedule`; returns (the gradients' norm before
  clipping as an XLA tensor, None where nothing computed it; the learning rate of this step)."""
  lr = optimizer.param_groups[0]["lr"]
  norm = None
  clips_itself = isinstance(optimizer, jb.optim.RuleOptimizer)
  if not clips_itself and t["max_grad_norm"]:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
  optimizer.step()
  schedule.step()
  return (optimizer.grad_norm if clips_itself else norm), lr


def train(cfg, *, log=print):
  """Runs the configured training in `out`, holding its lock (`rundir.claim`: a second run there
  stops with a ConfigError); returns the list of per-step losses of this run (empty when
  `resume=true` finds the run complete). Resuming checks the checkpoint's saved config first.

  Example:
    >>> losses = train(config.load(["train.steps=2"]), log=lambda line: None)
  """
  out = pathlib.Path(cfg["out"])
  with rundir.claim(out, log):
    found = checkpoint.latest(out / "checkpoints") if cfg["resume"] else None
    cfg = config.resolved(cfg, (checkpoint.run_config(found) or {}) if found is not None else None)
    if found is not None:
      rundir.check_resume(found, cfg)
      if rundir.complete(found, cfg, log):
        return []
    return _train(cfg, out, found, log)


def _train(cfg, out, found, log):
  """`train` in run directory `out` (held), from checkpoint `found` (None: from the start)."""
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))  # SPMD before any tensor is placed
  device = torch_xla.device()
  model = prepare(cfg, device)
  t = cfg["train"]
  make = lambda params: make_optimizer(params, t)  # noqa: E731
  optimizer = (precision.master_weights(model.parameters(), make) if t["master_weights"]
               else make(model.parameters()))
  start = 0
  if found is not None:
    start = checkpoint.load(found, model, optimizer)
    rundir.keep_metrics_until(out / "metrics.jsonl", start)
    log(f"resumed from {found} at step {start}")
  schedule = make_schedule(optimizer, t, start)
  peak, said = metrics.peak_flops(metrics.device_kind(), cfg["model"].get("dtype", "float32"),
                                  xr.global_runtime_device_count())
  log(said)
  before = (met.metric_data("CompileTime") or (0,))[0], _graphs()
  batches = data.Batches(start, t["steps"], batch=t["batch"], seq=t["seq"], seed=t["seed"],
                         source=t["data"], vocab=cfg["model"]["vocab"])
  step_fn = make_step(cfg, model, optimizer)
  loader = pl.MpDeviceLoader(batches, device, input_sharding=sharding.batch_sharding(mesh))
  with metrics.MetricsLog(out, append=found is not None) as sink:
    reads = _Readback(cfg, sink, peak, log)
    # The loader's next() calls torch_xla.sync(): a step runs while the next one is traced.
    # Host time of a step: this thread's CPU time from the end of the previous step's body
    # (the loader's sync that dispatches a graph, then tracing the step), checkpoints left out.
    host = time.thread_time()
    for step, (inputs, targets) in enumerate(loader, start + 1):
      began = time.perf_counter()
      loss, grad_norm, lr = step_fn(inputs, targets, schedule)
      reads.add(step, began, loss, grad_norm, lr, (time.thread_time() - host) * 1e3)
      if t["sync_each_step"]:
        torch_xla.sync()
        loss.item()  # the host waits for the device
      if t["checkpoint_every"] and step % t["checkpoint_every"] == 0:
        reads.drain()  # the rows up to a checkpoint are on disk before it
        checkpoint.save(out / "checkpoints", step, model, optimizer, run_config=cfg)
        if t["keep_checkpoints"]:  # older ones go only once this one is committed
          checkpoint.prune(out / "checkpoints", t["keep_checkpoints"], step)
      host = time.thread_time()
    reads.finish()
  _summary(cfg, out, reads, before, log, model if mesh is not None else None)
  return [row["loss"] for row in reads.rows]


_RATE_READS = 4  # read windows a step rate spans (its steps: up to 4 * train.log_every)


class _Readback:
  """Each step's loss (and the optimizer's `grad_norm` and lr, when it has them) read without
  making the host wait: the tensors of `train.log_every` steps are kept, then read together by one
  asynchronous step closure (it runs on torch_xla's closure thread once they are computed), which
  writes their metrics rows and a progress line."""

  def __init__(self, cfg, sink, peak, log):
    t = cfg["train"]
    self.every, self.steps, self.sink, self.peak, self.log = (t["log_every"], t["steps"], sink,
                                                              peak, log)
    self.tokens, self.flops = t["batch"] * t["seq"], metrics.flops_per_token(cfg["model"], t["seq"])
    self.window, self.rows, self.queued, self.error = [], [], 0, None
    self.idle = threading.Condition()
    self.origin = time.perf_counter()
    # (time, when the host began the window's last step, steps) of the reads after the first,
    # which holds the compiles: a rate spans up to _RATE_READS of them, since one read that ran
    # late on a busy host is followed at once by the next (a window alone then showed 0.1 ms
    # steps next to 40 ms ones)
    self.recent: collections.deque = collections.deque(maxlen=_RATE_READS + 1)

  def add(self, step, began, loss, grad_norm, lr, host_ms):
    """Keeps step `step`'s values (a copy in this step's graph of those an optimizer may update in
    place) and, every `log_every` steps and at the last, queues the closure that reads them."""
    snapshot = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    self.window.append({"step": step, "began": began, "traced": time.perf_counter(),
                        "host_ms": host_ms,
                        "values": {"loss": loss.detach(), "grad_norm": snapshot(grad_norm),
                                   "lr": snapshot(lr)}})
    if step % self.every == 0 or step == self.steps:
      self._queue()

  def _queue(self):
    with self.idle:
      self.queued += 1
    xm.add_step_closure(self._read, (self.window,), run_async=True)
    self.window = []

  def drain(self):
    """Reads the steps kept so far now, and waits until their rows are written."""
    if self.window:
      self._queue()
    torch_xla.sync()  # step closures run after the graph of the next sync
    self.finish()

  def finish(self):
    """Waits for the device and for every queued read; raises what a read raised."""
    xm.wait_device_ops()
    with self.idle:
      self.idle.wait_for(lambda: self.queued == 0)
    if self.error is not None:
      raise self.error

  def _read(self, window):
    try:
      self._write(window)
    except BaseException as e:  # raised again on the training thread by finish()
      self.error = self.error or e
    finally:
      with self.idle:
        self.queued -= 1
        self.idle.notify_all()

  def _write(self, window):
    values = [{k: v.item() if isinstance(v, torch.Tensor) else float(v)
               for k, v in entry["values"].items() if v is not None} for entry in window]
    done = time.perf_counter()  # the window's last step has run (its loss reached the host)
    began = window[-1]["began"]
    if not self.recent:  # the first read: from the start
      step_s = (done - self.origin) / len(window)
      self.recent.append((done, began, 0))
    else:
      self.recent.append((done, began, len(window)))
      steps = sum(count for *_, count in list(self.recent)[1:])
      # never faster than the host began steps: reads can return together (docs/recipes.md)
      step_s = max(done - self.recent[0][0], began - self.recent[0][1]) / steps
    rows = [{"step": entry["step"], **value, "step_ms": step_s * 1e3,
             "trace_ms": (entry["traced"] - entry["began"]) * 1e3, "host_ms": entry["host_ms"],
             "tokens_per_s": self.tokens / step_s,
             "began_s": entry["began"] - self.origin, "traced_s": entry["traced"] - self.origin}
            for entry, value in zip(window, values)]
    rows[-1]["done_s"] = done - self.origin
    for row in rows:
      if self.peak is not None:
        row["mfu"] = metrics.mfu(self.flops, row["tokens_per_s"], self.peak)
      self.sink.write(row)
    self.rows.extend(rows)
    self.log(_progress(rows[-1], self.steps))


def _graphs():
  """XLA programs run so far: each sync with pending work looks its graph up once."""
  return (met.counter_value("CachedCompile") or 0) + (met.counter_value("UncachedCompile") or 0)


def _progress(row, steps):
  filled = int(20 * row["step"] / steps)
  bar = "#" * filled + "." * (20 - filled)
  extra = "".join(f"  {name} {row[key]:{form}}" for key, name, form in (
      ("grad_norm", "grad norm", ".3f"), ("lr", "lr", ".2e"), ("mfu", "MFU", ".2%")) if key in row)
  eta = _duration((steps - row["step"]) * row["step_ms"] / 1e3)
  return (f"[{bar}] step {row['step']:>4}/{steps}  loss {row['loss']:.4f}{extra}  "
          f"{row['tokens_per_s']:>8.0f} tok/s  step {row['step_ms']:7.1f} ms  "
          f"trace {row['trace_ms']:6.1f} ms  ETA {eta}")


def _duration(seconds):
  minutes, seconds = divmod(round(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _overlaps_ms(rows):
  """Per step N whose device finish is known: how long the host traced step N + 1 before step N
  had finished (0 when the host waited for it)."""
  following = {row["step"] - 1: row for row in rows}
  return [max(0.0, min(following[r["step"]]["traced_s"], r["done_s"]) -
              following[r["step"]]["began_s"]) * 1e3
          for r in rows if "done_s" in r and r["step"] in following]


def _summary(cfg, out, reads, before, log, sharded_model=None):
  m, rows = cfg["model"], reads.rows
  layer = llama.DecoderLayer(m["dim"], m["heads"], m["kv_heads"], m["hidden"], m["experts"],
                             m["experts_per_token"])
  example = torch.zeros(cfg["train"]["batch"], cfg["train"]["seq"], m["dim"], requires_grad=True)
  with jb.override_ops(llama.ATTENTION[m["attention"]]):  # the attention the layers ran
    residuals = jb.saved_residuals(layer, example, torch.arange(cfg["train"]["seq"]),
                                   remat=config.remat_setting(cfg))
  # rates after the first read window (it holds the compiles), unless there is only one
  # A read window's rates come from when its read ran; a run without a whole window after the
  # first has no steady rate to report (its reads lag behind compiles).
  every = cfg["train"]["log_every"]
  steady = [r for r in rows if r["step"] > rows[0]["step"] + every - 1] if rows else []
  steady = steady if len(steady) >= max(every, 2) else []
  median = lambda key: statistics.median(r[key] for r in steady) if steady else None  # noqa: E731
  overlaps = _overlaps_ms(rows)
  summary = {
      "config": cfg, "steps_run": len(rows),
      "first_loss": rows[0]["loss"] if rows else None,
      "last_loss": rows[-1]["loss"] if rows else None,
      "compiles": (met.metric_data("CompileTime") or (0,))[0] - before[0],
      "graphs": _graphs() - before[1],
      "traces": jb.cache_info().misses,
      "residual_bytes_per_layer": residuals.total_bytes,
      "residual_host_bytes_per_layer": residuals.host_bytes,
      "flops_per_token": reads.flops, "peak_flops": reads.peak,
      "step_ms": median("step_ms"), "trace_ms": median("trace_ms"), "host_ms": median("host_ms"),
      "tokens_per_s": median("tokens_per_s"),
      "mfu": median("mfu") if reads.peak is not None and steady else None,
      "overlap_ms": statistics.median(overlaps) if overlaps else None,
      "fallbacks": [dataclasses.asdict(r) for r in jb.bridge_report().fallbacks()],
  }
  if sharded_model is not None:  # each parameter's sharding as it left the last step
    spec = jb.spmd.sharding_spec
    summary["param_shardings"] = {n: spec(p) for n, p in sharded_model.named_parameters()}
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  log(f"done: {summary['steps_run']} steps, loss {summary['first_loss']} -> "
      f"{summary['last_loss']}, {summary['compiles']} compiles, {summary['traces']} traces, "
      f"{residuals.total_bytes} residual bytes per layer; summary in {out / 'summary.json'}")
  if steady:
    mfu = f", MFU {summary['mfu']:.2%}" if summary["mfu"] is not None else ""
    overlap = (f"; the host traced each step while the previous one ran for "
               f"{summary['overlap_ms']:.1f} ms (median)" if summary["overlap_ms"] is not None
               else "")
    log(f"median step {summary['step_ms']:.1f} ms, trace {summary['trace_ms']:.1f} ms, "
        f"host {summary['host_ms']:.1f} ms CPU, "
        f"{summary['tokens_per_s']:.0f} tok/s{mfu}{overlap}")


def main(argv=None):
  """Parses `key=value` overrides, then trains. Config errors (also a run directory in use, a
  resume with another model) exit with the message, code 2."""
  try:
    train(config.load(sys.argv[1:] if argv is None else argv))
  except config.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
