"""Typical uses of the public API, checked by mypy in `make test` (not run by pytest): a user's
code type-checks against the package's annotations (`py.typed`)."""
from typing import Any

import jax.numpy as jnp
import torch

import torch_xla_jaxbridge as jb


def one_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
  optimizer: jb.optim.RuleOptimizer = jb.optim.AdamW(model.parameters(), lr=1e-3,
                                                     max_grad_norm=1.0)
  step = jb.train_step(
      lambda a, b: (model(a) - b).square().mean(), optimizer, remat="full")
  return step(x, y)


def bridged(layer: torch.nn.Module, x: torch.Tensor) -> Any:
  wrapped = jb.BridgeModule(layer, remat=jb.Remat(save=("query_proj",), policy="dots"))
  double = jb.bridge(lambda t: t * 2, name="double")
  info: jb.CacheInfo = jb.cache_info()
  assert info.misses >= 0
  return double(wrapped(x))


def jax_call(x: torch.Tensor) -> Any:
  return jb.call_jax(lambda a: jnp.sin(a) * 2, (x,), name="sin2")


def memory(x: torch.Tensor) -> int:
  report: jb.MemoryReport = jb.memory_report(lambda: x * 2, sync=False)
  return report.total_bytes


def presets() -> list[str]:
  return [name for name, preset in jb.remat.presets().items() if not preset.offloads]


def schedules(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
  return torch.optim.lr_scheduler.LambdaLR(optimizer, jb.optim.warmup_cosine(10, 100))


def upstream_drop_ins(layers: torch.nn.ModuleList, x: torch.Tensor) -> Any:
  carry, ys = jb.scan(lambda c, t: (c + t, c * t), torch.zeros_like(x[0]), x)
  hidden = jb.scan_layers(layers, carry, partition_fn=None, is_layer_pure=True)
  return jb.checkpoint(layers[0], hidden) + ys.sum()


def custom_op_lowering() -> None:
  jb.register_lowering(torch.ops.aten.gelu, lambda t, approximate="none": t * 2)


def stacked(layers: torch.nn.ModuleList) -> jb.StackedLayers:
  return jb.StackedLayers(layers, remat="full")
