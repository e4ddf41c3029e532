"""Shared harness of bench_step.py and bench_scan.py: a pre-norm decoder stack trained with SGD on
the XLA CPU device, one way of running the stack per mode, with compile, host and step times."""
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
  """The function `h -> h` that runs `stack` the way `mode` says."""
  if mode == "LazyTensor":
    layers = stack
  elif mode == "upstream PureModule":
    layers = [PureModule(l) for l in stack]
  elif mode == "ours BridgeModule":
    layers = [jb.BridgeModule(l) for l in stack]
  elif mode == "ours BridgeModule remat=full":
    layers = [jb.BridgeModule(l, remat="full") for l in stack]
  elif mode == "upstream scan_layers":
    return lambda h: upstream_scan_layers(stack, h)
  elif mode == "ours scan_layers":
    return lambda h: jb.scan_layers(stack, h)
  elif mode == "ours scan_layers remat=full":
    return lambda h: jb.scan_layers(stack, h, remat="full")
  else:
    raise ValueError(mode)

  def run(h):
    for layer in layers:
      h = layer(h)
    return h

  return run


def compiles():
  data = met.metric_data("CompileTime")
  return (data[0], data[1]) if data else (0, 0)


def run(mode, layers, steps):
  """Trains `layers` decoder layers for 2 warm-up and `steps` timed steps; returns a result row."""
  torch.manual_seed(0)
  dev = torch_xla.device()
  stack = [PositionsBound().to(dev) for _ in range(layers)]
  params = [p for l in stack for p in l.parameters()]
  fused = mode.endswith(FUSED_SGD)
  forward = stack_forward(mode.removesuffix(FUSED_SGD), stack)
  optimizer = (jb.optim.SGD(params, lr=1e-3) if fused else
               torch.optim.SGD(params, lr=1e-3, foreach=True))
  x = torch.randn(BATCH, SEQ, D).to(dev)  # CPU generator: the same input for every mode
  before = compiles()
  parts = {"forward": [], "backward": [], "optimizer": []}
  host, times, loss = [], [], None
  for step in range(steps + 2):
    start = time.perf_counter()
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
      for part, (a, b) in zip(parts, ((start, forwarded), (forwarded, backwarded),
                                      (backwarded, traced))):
        parts[part].append((b - a) * 1e3)
  after = compiles()
  return {"mode": mode, "layers": layers, "compile_s": round((warm[1] - before[1]) / 1e9, 2),
          "first_step_s": round(first_s, 2), "host_ms": round(statistics.median(host), 2),
          **{f"host_{k}_ms": round(statistics.median(v), 2) for k, v in parts.items()},
          "step_ms": round(statistics.median(times), 1), "compiles_after_warmup": after[0] - warm[0],
          "loss": round(loss.item(), 6)}
