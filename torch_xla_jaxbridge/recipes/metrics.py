"""What a training run measures and where it goes: model FLOPs per token from the config, the
device's peak FLOP/s (a spec table, or a calibration matmul on the CPU), MFU, and the metrics log
(`metrics.jsonl`, and TensorBoard when the `tensorboard` package is installed).

MFU = flops_per_token x tokens/s / peak FLOP/s, with the training FLOPs of one token
6 N + 12 L d T (N: weights of the matrix multiplications, L layers, d = heads x head_dim, T the
sequence length; PaLM's appendix B). docs/recipes.md says what is counted and why.
"""
import functools
import json
import pathlib
import time

import torch

# Dense peak FLOP/s of one chip from the vendors' spec sheets: (substring of the XLA device kind,
# bfloat16, float32). First match wins. float32 is the rate of torch_xla's default matmul
# precision: one bfloat16 pass on TPU (so the bfloat16 peak), TF32 tensor cores on NVIDIA GPUs.
PEAK_FLOPS = (
    ("TPU v6 lite", 918e12, 918e12),  # v6e (Trillium)
    ("TPU v5 lite", 197e12, 197e12),  # v5e
    ("TPU v5", 459e12, 459e12),  # v5p ("TPU v5p", or "TPU v5" on older runtimes)
    ("TPU v4", 275e12, 275e12),
    ("H200", 989e12, 494.5e12),  # SXM; same tensor cores as the H100 SXM
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494.5e12),  # SXM
    ("A100", 312e12, 156e12),
)


def flops_per_token(model: dict, seq: int) -> int:
  """Training FLOPs of one token (forward and backward) for the config's `model` section at
  sequence length `seq`: 6 N + 12 L d T. N counts the weights of every matrix multiplication
  (attention q/k/v/o, the MLP, per token the `experts_per_token` experts a token is routed to and
  the router, the output projection; not the embedding lookup or the norms).

  Example (llama-tiny: N = 4 x (12,288 + 36,864) + 16,384 = 212,992; 12 x 4 x 64 x 64 = 196,608):
    >>> from torch_xla_jaxbridge.recipes import config
    >>> flops_per_token(config.load()["model"], 64)
    1474560
  """
  dim, heads, layers = model["dim"], model["heads"], model["layers"]
  head_dim = dim // heads
  attention = 2 * dim * heads * head_dim + 2 * dim * model["kv_heads"] * head_dim
  mlp = 3 * dim * model["hidden"]
  if model["experts"]:
    mlp = model["experts_per_token"] * mlp + dim * model["experts"]
  weights = layers * (attention + mlp) + dim * model["vocab"]
  return 6 * weights + 12 * layers * heads * head_dim * seq


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
  """Model FLOPs utilisation: the fraction of `peak` FLOP/s that the model's FLOPs reach.

  Example:
    >>> mfu(1e9, 1e3, 1e13)
    0.1
  """
  return flops_per_token * tokens_per_s / peak


@functools.cache
def calibrated_cpu_peak(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
  """The host CPU's matmul FLOP/s: the best of `repeats` torch `size` x `size` matmuls in `dtype`
  (all threads torch uses), measured once per process.

  Example:
    >>> calibrated_cpu_peak("float32", size=128, repeats=2) > 0
    True
  """
  a = torch.randn(size, size, dtype=getattr(torch, dtype))
  b = torch.randn(size, size, dtype=getattr(torch, dtype))
  a @ b  # warm-up: thread pool, kernels
  best = float("inf")
  for _ in range(repeats):
    began = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - began)
  return 2 * size**3 / best


def device_kind() -> str:
  """torch_xla's kind of the device ('cpu', 'TPU v5 lite', 'NVIDIA H100 80GB HBM3', ...). Under
  SPMD torch_xla names only its virtual device: then the device type ('TPU', 'CUDA', 'CPU').

  Example:
    >>> device_kind()
    'cpu'
  """
  import torch_xla.core.xla_model as xm
  import torch_xla.runtime as xr

  try:
    return xm.xla_device_kind()
  except RuntimeError:  # "Unknown device SPMD:0"
    return xr.device_type() or "unknown"  # None before a device is chosen: no peak known


def peak_flops(kind: str, dtype: str = "float32", devices: int = 1):
  """(peak FLOP/s of `devices` chips of XLA device kind `kind` in `dtype`, or None when it is not
  known; the line that says where it came from). The CPU is measured (`calibrated_cpu_peak`,
  the whole host, however many virtual devices it is split into); accelerators come from
  `PEAK_FLOPS`.

  Example:
    >>> peak_flops("TPU v5 lite", "bfloat16", devices=4)
    (788000000000000.0, 'peak (TPU v5 lite x 4, bfloat16, spec table): 788.0 TFLOP/s')
    >>> peak_flops("Some NPU")[0] is None
    True
  """
  if kind.lower() == "cpu":
    peak = calibrated_cpu_peak(dtype)
    return peak, f"peak (CPU, calibrated matmul): {peak / 1e9:.1f} GFLOP/s"
  for name, bf16, fp32 in PEAK_FLOPS:
    if name in kind:
      peak = devices * (bf16 if dtype == "bfloat16" else fp32)
      return peak, f"peak ({kind} x {devices}, {dtype}, spec table): {peak / 1e12:.1f} TFLOP/s"
  return None, (f"peak: device kind {kind!r} is not in recipes.metrics.PEAK_FLOPS; MFU is not "
                f"reported (add the chip's dense {dtype} FLOP/s there)")


class MetricsLog:
  """Rows (dicts with a `step`) to `out/metrics.jsonl`, one JSON object a line, and, when the
  `tensorboard` package is installed, their `BOARD_KEYS` as TensorBoard scalars in
  `out/tensorboard` (skipped silently otherwise).

  Example:
    >>> import tempfile
    >>> with MetricsLog(tempfile.mkdtemp()) as log:
    ...   log.write({"step": 1, "loss": 2.5})
    >>> log.path.read_text()
    '{"step": 1, "loss": 2.5}\\n'
  """

  BOARD_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_ms", "trace_ms")

  def __init__(self, out, append: bool = False):
    self.path = pathlib.Path(out) / "metrics.jsonl"
    self.file = open(self.path, "a" if append else "w")
    try:
      from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has everything
      self.board = None
    else:
      self.board = SummaryWriter(str(pathlib.Path(out) / "tensorboard"))

  def write(self, row: dict):
    self.file.write(json.dumps(row) + "\n")
    self.file.flush()
    if self.board is not None:
      for key in self.BOARD_KEYS:
        if key in row:
          self.board.add_scalar(key, row[key], row["step"])

  def close(self):
    self.file.close()
    if self.board is not None:
      self.board.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
