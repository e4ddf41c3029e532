"""Host time of one training step, split into its parts, against a native `jax.jit` dispatch.

For each config (the recipe's llama-tiny and llama-mid, the latter also with 32 layers) and mode
(the recipe's default one-node step, whose layers are stacked (`remat.stack_layers=auto`), the
same step with a parameter per layer (`remat.stack_layers=false`), plain LazyTensor + torch
AdamW), each run is its own process and the modes are alternated over `--rounds` rounds. A
process builds the recipe's model, optimizer and step with the recipe's own functions, then times
`--steps` steps after warm-up (none of them compiling), waiting for the device before each so the
measured host work does not share the cores with XLA's execution:

- `step_cpu_ms` / `sync_cpu_ms`: process CPU time of the step body (tracing: forward, backward,
  optimizer; LazyTensor's backward runs on autograd's thread) and the calling thread's CPU time
  in `torch_xla.sync()` (graph hash, lookup, dispatch; XLA:CPU starts running the program on its
  own threads before sync returns, which is device time); `host_ms` their sum, the host time a
  step costs. Wall times alongside.
- parts: the same steps once more under cProfile (timing CPU time), each function's own time
  assigned to a part (`PARTS`: Python call path, flatten and cache key, argument checks, data
  handles, optimizer bookkeeping, the node, sync, other), as shares scaled to `host_ms` (the
  profiler slows Python more than C++, so the Python parts read high).
- `anchor_ms`: host time of calling a `jax.jit` function of as many arrays as the step's inputs
  and outputs (parameters, optimizer state, batch; donated), on JAX's CPU device: what a
  dispatch costs without torch_xla.
- `floor_ms`: torch_xla's own share for the same `tensors` (parameters and optimizer states; a
  `jb.optim` optimizer's states are one flat buffer per (state name, dtype) without SPMD):
  one user computation over them and `torch_xla.sync()`, no Python of this package and no
  data-handle swaps. What any one-node step that updates that many tensors costs at least.

Prints a table of medians [min-max] over rounds and writes JSON.

  python scripts/bench_host.py [--rounds 3] [--steps 20] [--configs tiny mid mid32]
                               [--json scripts/out/bench_host.json]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import time

import harness

CONFIGS = {"tiny": ["model=llama-tiny"], "mid": ["model=llama-mid", "train.seq=256"],
           "mid32": ["model=llama-mid", "train.seq=256", "model.layers=32"]}
MODES = {"default step (StackedLayers)": [],
         "step, a parameter per layer": ["remat.stack_layers=false"],
         "LazyTensor + torch AdamW": ["remat.bridge=none", "train.optimizer=torch-adamw"]}
# part -> substrings of "file:function" that belong to it (first match wins)
PARTS = {
    "sync (graph hash, lookup, dispatch)": ["_xla_step_marker"],
    "the node (torch_xla user computation)": ["_xla_user_computation"],
    "data handles and aliasing": ["replace_data", "_replace_xla_tensor", "_propagate_xla_data",
                                  "_functionalize", "_from_functional_tensor",
                                  "increment_version"],
    "optimizer bookkeeping": ["optim/_", "torch/optim", "lr_scheduler",
                              "built-in method torch.tensor", "'to' of 'torch._C"],
    "flatten and cache key": ["tree_util", "jax/_src/tree", "lowering.py", "call.py", "plain.py",
                              "spec.py:split", "__hash__", "__eq__"],
    "argument checks": ["check_params", "_check", "is_traced", "_any_traced"],
    "Python call path (bridge, captures, state walk)": ["torch_xla_jaxbridge", "torch/nn/modules"],
}


def child(config: str, mode: str, steps: int) -> dict:
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm

  import torch_xla_jaxbridge as jb  # noqa: F401  (registers the package's features)
  from torch_xla_jaxbridge.recipes import config as recipe_config, data, train

  cfg = recipe_config.load([*CONFIGS[config], *MODES[mode], "train.checkpoint_every=0"])
  t = cfg["train"]
  device = torch_xla.device()
  model = train.prepare(cfg, device)
  optimizer = train.make_optimizer(model.parameters(), t)
  schedule = train.make_schedule(optimizer, t)
  step_fn = train.make_step(cfg, model, optimizer)
  batches = [(x.to(device), y.to(device)) for x, y in data.Batches(
      0, 4, batch=t["batch"], seq=t["seq"], seed=0, source=t["data"], vocab=cfg["model"]["vocab"])]
  torch_xla.sync()
  xm.wait_device_ops()
  kept = []

  def one(i, profile=None):
    x, y = batches[i % len(batches)]
    cpu, wall = time.process_time(), time.perf_counter()
    if profile:
      profile.enable()
    loss, grad_norm, _ = step_fn(x, y, schedule)
    kept[:] = [loss.detach(), None if grad_norm is None else grad_norm.detach().clone()]
    mid_cpu, mid_wall, mid_thread = time.process_time(), time.perf_counter(), time.thread_time()
    torch_xla.sync()
    if profile:
      profile.disable()
    end_wall = time.perf_counter()
    end_cpu = mid_cpu + time.thread_time() - mid_thread  # this thread's: XLA runs on others
    xm.wait_device_ops()
    return ((mid_cpu - cpu) * 1e3, (end_cpu - mid_cpu) * 1e3, (mid_wall - wall) * 1e3,
            (end_wall - mid_wall) * 1e3)

  for i in range(6):  # warm-up: the first steps compile
    one(i)
  times = [one(i) for i in range(steps)]
  median = lambda k: statistics.median(t[k] for t in times)  # noqa: E731
  result = {"config": config, "mode": mode, "step_cpu_ms": median(0), "sync_cpu_ms": median(1),
            "step_wall_ms": median(2), "sync_wall_ms": median(3),
            "params": sum(1 for _ in model.parameters())}
  result["host_ms"] = result["step_cpu_ms"] + result["sync_cpu_ms"]
  profile = cProfile.Profile(time.thread_time)  # CPU time: sync's wait for the device is not
  for i in range(steps):
    one(i, profile)
  result["parts"] = _parts(profile, result["host_ms"])
  result["anchor_ms"] = _anchor(model, optimizer, batches[0])
  result["floor_ms"], result["tensors"] = _floor(model, optimizer)
  return result


def _parts(profile, host_ms):
  stats = pstats.Stats(profile).stats
  totals = dict.fromkeys(list(PARTS) + ["other"], 0.0)
  for (filename, _, function), (_, _, own, _, _) in stats.items():
    where = f"{filename}:{function}"
    part = next((name for name, keys in PARTS.items() if any(k in where for k in keys)), "other")
    totals[part] += own
  whole = sum(totals.values()) or 1.0
  return {name: host_ms * value / whole for name, value in totals.items()}


def _anchor(model, optimizer, batch):
  """Host ms of one call of a `jax.jit` step over as many arrays (donated) as the torch step."""
  import jax
  import jax.numpy as jnp

  arrays = [jnp.zeros(tuple(t.shape), jnp.float32) for t in _updated(model, optimizer)]
  x = jnp.zeros(tuple(batch[0].shape), jnp.int32)

  def step(arrays, x):
    return [a * 0.999 for a in arrays], jnp.sum(x)

  donated = jax.jit(step, donate_argnums=(0,))
  out = donated(arrays, x)
  jax.block_until_ready(out)
  times = []
  for _ in range(20):
    start = time.thread_time()  # the dispatch; XLA:CPU runs the program on its own threads
    out = donated(out[0], x)
    times.append((time.thread_time() - start) * 1e3)
    jax.block_until_ready(out)
  return statistics.median(times)


def _updated(model, optimizer):
  """Copies of the tensors a step updates: the parameters and the optimizer's state, which
  `jb.optim` keeps (without SPMD) in one flat buffer per (state name, dtype) (docs/optim.md)."""
  import torch
  import torch_xla.runtime as xr

  import torch_xla_jaxbridge as jb

  buffers = {}
  for state in optimizer.state.values():
    for name, v in state.items():
      if torch.is_tensor(v) and v.device.type == "xla" and v.dim() > 0:
        buffers.setdefault((name, v.dtype), []).append(v.detach().reshape(-1))
  flat = isinstance(optimizer, jb.optim.RuleOptimizer) and not xr.is_spmd()
  states = ([torch.cat(vs) for vs in buffers.values()] if flat else
            [v.clone() for vs in buffers.values() for v in vs])
  return [p.detach().clone() for p in model.parameters()] + states


def _floor(model, optimizer):
  """Host ms of torch_xla's own share for as many tensors as the step updates: one user
  computation over the parameters and optimizer states (each scaled), its outputs taken as the
  next inputs, and `torch_xla.sync()`; none of this package's Python (only `_compat`'s one-line
  wrappers of torch_xla's entry points) and no data-handle swaps."""
  import jax
  import torch_xla
  import torch_xla.core.xla_model as xm

  from torch_xla_jaxbridge._compat import torch_xla_private

  tensors = _updated(model, optimizer)
  avals = [jax.ShapeDtypeStruct(tuple(t.shape), jax.numpy.float32) for t in tensors]
  proto = jax.jit(lambda *xs: [x * 0.999 for x in xs]).lower(*avals).compiler_ir(
      "hlo").as_serialized_hlo_module_proto()
  computation = torch_xla_private.computation_from_proto("xla::floor", proto)
  torch_xla.sync()
  times = []
  for i in range(26):
    xm.wait_device_ops()
    start = time.thread_time()
    tensors = torch_xla_private.user_computation("xla::floor", tensors, computation)
    torch_xla.sync()
    if i >= 6:  # the first calls compile
      times.append((time.thread_time() - start) * 1e3)
  return statistics.median(times), len(tensors)


def summarize(results):
  """One row per (config, mode): medians [min, max] over rounds; each part's median."""
  rows = []
  for (config, mode), runs in results.items():
    rows.append({"config": config, "mode": mode, "params": runs[0]["params"],
                 "tensors": runs[0]["tensors"], "rounds": len(runs),
                 **harness.spreads(runs, ["host_ms", "step_cpu_ms", "sync_cpu_ms", "anchor_ms",
                                          "floor_ms"]),
                 "parts": {part: statistics.median(r["parts"][part] for r in runs)
                           for part in runs[0]["parts"]}})
  return rows


def show(rows):
  median = lambda key: lambda row: row[key][0]  # noqa: E731
  print(harness.table(rows, [
      ("config", "config"), ("mode", "mode"), ("params", "params"), ("tensors", "tensors"),
      ("host ms", "host_ms", ".2f"), ("step cpu", median("step_cpu_ms"), ".2f"),
      ("sync cpu", median("sync_cpu_ms"), ".2f"), ("jax.jit", median("anchor_ms"), ".2f"),
      ("torch_xla floor", median("floor_ms"), ".2f")]))
  for r in rows:
    parts = ", ".join(f"{name} {ms:.2f}" for name, ms in r["parts"].items() if ms >= 0.01)
    print(f"  {r['config']} {r['mode']}: {parts}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--modes", nargs="+", default=list(MODES))
  parser.add_argument("--json", default="scripts/out/bench_host.json")
  opts = parser.parse_args()
  results = harness.rounds(
      [(config, mode) for config in opts.configs for mode in opts.modes], opts.rounds,
      lambda config, mode: harness.run_child(__file__, [config, mode, opts.steps],
                                             {"PJRT_DEVICE": "CPU"}),
      describe=lambda run: f"host {run['host_ms']:.2f} ms")
  rows = summarize(results)
  show(rows)
  harness.write_json(opts.json, {"runs": harness.in_order(results), "rows": rows,
                                 "load": os.getloadavg()})


if __name__ == "__main__":
  harness.main(main, child)
