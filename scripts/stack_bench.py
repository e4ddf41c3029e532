"""Shared harness of bench_step.py and bench_scan.py: a pre-norm decoder stack trained with SGD on
the XLA CPU device, one way of running the stack per mode, with compile, host and step times.

Each (mode, depth) runs in a fresh process (`run_isolated`): run one after another in one
process, later modes were slower (host 8.0 ms for a mode run first, 9.5 ms after LazyTensor, 13.5
ms after seven other modes) and shared compiled programs and caches.

  python scripts/stack_bench.py --child MODE LAYERS STEPS   # one row as JSON, on the last line
"""
import resource
import statistics
import time

import torch_xla_jaxbridge as jb
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla.experimental.assume_pure import PureModule
from torch_xla.experimental.scan_layers import scan_layers as upstream_scan_layers

from torch_xla_jaxbridge.recipes.llama import DecoderLayer

import harness

D, HEADS, SEQ, BATCH = 256, 4, 64, 4
CONFIG = {"D": D, "heads": HEADS, "seq": SEQ, "batch": BATCH,
          "optimizer": "torch.optim.SGD(lr=1e-3, foreach=True), or jb.optim.SGD(lr=1e-3) where the "
                       "mode says '+ jb.optim.SGD'"}
FUSED_SGD = " + jb.optim.SGD"


class PositionsBound(torch.nn.Module):
  """A decoder layer taking only the hidden state (upstream scan_layers passes one argument)."""

  def __init__(self):
    super().__init__()
    self.layer = DecoderLayer(D, HEADS, HEADS, 4 * D)
    # int32: upstream assume_pure traces without x64 and rejects an int64 buffer
    self.register_buffer("positions", torch.arange(SEQ, dtype=torch.int32), persistent=False)

  def forward(self, h):
    return self.layer(h, self.positions)


def stack_forward(mode, stack):
  """`(forward, params)`: the function `h -> h` that runs `stack` the way `mode` says (our modes
  take a " remat=<preset>" suffix), and the parameters it trains."""
  base, _, remat = mode.partition(" remat=")
  remat = remat or None
  params = [p for layer in stack for p in layer.parameters()]
  if base == "LazyTensor":
    layers = stack
  elif base == "upstream PureModule":
    layers = [PureModule(l) for l in stack]
  elif base == "ours BridgeModule":
    layers = [jb.BridgeModule(l, remat=remat) for l in stack]
  elif base == "ours BridgeModule(whole stack)":
    layers = [jb.BridgeModule(torch.nn.Sequential(*stack), remat=remat)]
  elif base == "ours StackedLayers":
    stacked = jb.StackedLayers(stack, remat=remat)
    layers, params = [stacked], list(stacked.parameters())
  elif base == "upstream scan_layers":
    return (lambda h: upstream_scan_layers(stack, h)), params
  elif base == "ours scan_layers":
    return (lambda h: jb.scan_layers(stack, h, remat=remat)), params
  else:
    raise ValueError(mode)

  def run(h):
    for layer in layers:
      h = layer(h)
    return h

  return run, params


def native_jax(layers, steps):
  """The torchax-converted stack as one jitted JAX SGD step on JAX's own CPU device."""
  import jax
  import torchax

  torch.manual_seed(0)
  model = torch.nn.Sequential(*[PositionsBound() for _ in range(layers)])
  params, fn = torchax.extract_jax(model)
  x = jax.numpy.asarray(torch.randn(BATCH, SEQ, D).numpy())

  @jax.jit
  def step(params):
    loss, grads = jax.value_and_grad(lambda p: (fn(p, (x,)) ** 2).mean(), allow_int=True)(params)
    return loss, jax.tree.map(lambda p, g: p - 1e-3 * g if g.dtype.kind == "f" else p, params,
                              grads)

  start = time.perf_counter()
  loss, params = step(params)
  jax.block_until_ready(params)
  first = time.perf_counter() - start
  times, faults = [], []
  for _ in range(steps + 1):
    before, start = page_faults(), time.perf_counter()
    loss, params = step(params)
    jax.block_until_ready(params)
    times.append((time.perf_counter() - start) * 1e3)
    faults.append(page_faults() - before)
  return {"mode": "native jax.jit", "layers": layers, "compile_s": round(first, 2),
          "first_step_s": round(first, 2), "host_ms": None,
          "step_ms": round(statistics.median(times[1:]), 1),
          "page_faults": int(statistics.median(faults[1:])), "compiles_after_warmup": 0,
          "loss": round(float(loss), 6)}


HUGEPAGE_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def run_isolated(mode, layers, steps, env=None):
  """`run` (or `native_jax`) in a fresh Python process, with `env` added to its environment (e.g.
  `HUGEPAGE_MALLOC`: glibc backs its large blocks with transparent huge pages); returns its
  result row."""
  return harness.run_child(__file__, [mode, layers, steps], env)


def page_faults():
  """Minor page faults of this process so far: each first touch of a freshly mapped page. XLA:CPU
  allocates a program's buffers anew on every run, and glibc maps blocks of 32 MiB and more
  freshly each time, so this counts what a step pays for memory it gets new."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def compiles():
  data = met.metric_data("CompileTime")
  return (data[0], data[1]) if data else (0, 0)


def run(mode, layers, steps):
  """Trains `layers` decoder layers for 2 warm-up and `steps` timed steps; returns a result row."""
  torch.manual_seed(0)
  dev = torch_xla.device()
  stack = [PositionsBound().to(dev) for _ in range(layers)]
  fused = mode.endswith(FUSED_SGD)
  forward, params = stack_forward(mode.removesuffix(FUSED_SGD), stack)
  optimizer = (jb.optim.SGD(params, lr=1e-3) if fused else
               torch.optim.SGD(params, lr=1e-3, foreach=True))
  x = torch.randn(BATCH, SEQ, D).to(dev)  # CPU generator: the same input for every mode
  torch_xla.sync()  # the model's set-up (e.g. stacking) is not part of the step's compile
  before = compiles()
  parts = {"forward": [], "backward": [], "optimizer": []}
  host, times, faults, loss = [], [], [], None
  for step in range(steps + 2):
    faulted, start = page_faults(), time.perf_counter()
    loss = forward(x).pow(2).mean()
    forwarded = time.perf_counter()
    loss.backward()
    backwarded = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    traced = time.perf_counter()
    torch_xla.sync(wait=True)
    xm.wait_device_ops()  # sync(wait=True) alone returned before the step ran, for fused SGD
    done = time.perf_counter()
    if step == 0:
      first_s = done - start
    if step == 1:
      warm = compiles()
    if step >= 2:
      host.append((traced - start) * 1e3)
      times.append((done - start) * 1e3)
      faults.append(page_faults() - faulted)
      for part, (a, b) in zip(parts, ((start, forwarded), (forwarded, backwarded),
                                      (backwarded, traced))):
        parts[part].append((b - a) * 1e3)
  after = compiles()
  return {"mode": mode, "layers": layers, "compile_s": round((warm[1] - before[1]) / 1e9, 2),
          "first_step_s": round(first_s, 2), "host_ms": round(statistics.median(host), 2),
          **{f"host_{k}_ms": round(statistics.median(v), 2) for k, v in parts.items()},
          "step_ms": round(statistics.median(times), 1),
          "page_faults": int(statistics.median(faults)),
          "compiles_after_warmup": after[0] - warm[0],
          "loss": round(loss.item(), 6)}


def child(mode: str, layers: int, steps: int) -> dict:
  """One row, after a one-time set-up of XLA (or JAX) that is not the model's."""
  if mode == "native jax.jit":
    import jax
    jax.jit(lambda a: a + 1)(1.0).block_until_ready()  # one-time JIT set-up, not the model's
    return native_jax(layers, steps)
  (torch.ones(2, device=torch_xla.device()) + 1).cpu()  # one-time XLA set-up, likewise
  return run(mode, layers, steps)


if __name__ == "__main__":
  harness.main(lambda: "usage: python scripts/stack_bench.py --child MODE LAYERS STEPS", child)
