"""Runs the shard_map checks on 4 virtual CPU devices and prints one JSON line of facts for
test_shard_map.py (SPMD is process-global, so this runs in its own process):

  CPU_NUM_DEVICES=4 XLA_FLAGS=--xla_force_host_platform_device_count=4 python test/shard_map_check.py
"""
import copy
import json
import os
import pathlib
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path[:0] = [str(pathlib.Path(__file__).parent), str(pathlib.Path(__file__).parents[1])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_xla_jaxbridge as jb  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from kernels import decoder_case, kernel_decoder  # noqa: E402
from parity import rel_err, run_checks  # noqa: E402
from torch_xla_jaxbridge.recipes import sharding  # noqa: E402

P = jax.sharding.PartitionSpec
hlo = lambda tensors: torch_xla._XLAC._get_xla_tensors_hlo(tensors)  # noqa: E731
spec = torch_xla._XLAC._get_xla_sharding_spec


def manual_region(text):
  """The manual-sharding facts of an HLO text: counts of the three markers."""
  return {"full_to_shard": text.count('custom_call_target="SPMDFullToShardShape"'),
          "manual": text.count("sharding={manual}"),
          "shard_to_full": text.count('custom_call_target="SPMDShardToFullShape"')}


def check_call_jax(mesh, dev):
  """A JAX function with shard_map (a per-shard matmul summed over "model") through call_jax,
  then the same inside a bridged function, with gradients."""
  def f(x, w):
    body = lambda xb, wb: jax.lax.psum(jnp.sin(xb) @ wb, "model")  # noqa: E731
    return jb.spmd.shard_map(body, (("data", "model"), ("model", None)), ("data", None),
                             mesh)(x, w)

  x, w = torch.randn(8, 8), torch.randn(8, 4)
  xx = x.to(dev)
  xs.mark_sharding(xx, mesh, ("data", "model"))
  out = jb.call_jax(f, (xx, w.to(dev)))
  text = hlo([out])
  ref = torch.sin(x) @ w
  facts = {"rel_err": rel_err(out, ref), "hlo": manual_region(text),
           "all_reduce": "all-reduce(" in text}
  xa, wa = x.to(dev).requires_grad_(True), w.to(dev).requires_grad_(True)
  out2 = jb.bridge(lambda a, b: jb.call_jax(f, (a, b)))(xa, wa)
  out2.pow(2).sum().backward()
  xr_, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
  (torch.sin(xr_) @ wr).pow(2).sum().backward()
  torch_xla.sync()
  facts.update(bridged_rel_err=rel_err(out2, ref), grad_x=rel_err(xa.grad, xr_.grad),
               grad_w=rel_err(wa.grad, wr.grad))
  return facts


def check_permuted_mesh(dev):
  """A mesh over devices [3, 2, 1, 0]: the values are the same."""
  mesh = xs.Mesh(np.array([3, 2, 1, 0]), (4,), ("d",))
  body = lambda t: t.cumsum(dim=1) * 2  # noqa: E731
  x = torch.randn(8, 6)
  out = jb.bridge(lambda t: jb.spmd.shard_map(body, (("d", None),), ("d", None), mesh)(t))(
      x.to(dev))
  return {"rel_err": rel_err(out, body(x))}


def check_layer(mesh, dev, stacked):
  """A decoder layer whose norms run the Pallas kernel in shard_map, FSDP-sharded, bridged (or
  two of them in `StackedLayers`): loss, output and every gradient against eager CPU."""
  layers, x, positions = decoder_case(2 if stacked else 1)
  ref = copy.deepcopy(layers)
  h = x
  for layer in ref:
    h = layer(h, positions)
  ref_loss = h.pow(2).mean()
  ref_loss.backward()
  ref_grads = [p.grad for layer in ref for p in layer.parameters()]
  kernel_layers = [kernel_decoder(layer, mesh) for layer in layers]
  model = (jb.StackedLayers(kernel_layers) if stacked else kernel_layers[0]).to(dev)
  specs = sharding.shard_model(model, mesh)
  bridged = model if stacked else jb.BridgeModule(model)
  xx = x.to(dev)
  xs.mark_sharding(xx, mesh, ("fsdp", None, None))
  out = bridged(xx, positions.to(dev))
  loss = out.pow(2).mean()
  fwd = hlo([loss])
  loss.backward()
  params = list(model.parameters())
  bwd = hlo([p.grad for p in params])
  torch_xla.sync()
  if stacked:  # the stacks' gradients, one layer after the other, as the reference lists them
    grads = [p.grad[i] for i in range(2) for p in params]
  else:
    grads = [p.grad for p in params]
  return {"loss": loss.item(), "ref_loss": ref_loss.item(), "out_rel_err": rel_err(out, h),
          "grad_errs": [rel_err(g, r) for g, r in zip(grads, ref_grads)],
          "grad_count": len(grads), "sharded": sum(s != (None,) * len(s) for s in specs.values()),
          "grads": [g.cpu().flatten().tolist() for g in grads],
          "fwd_hlo": manual_region(fwd), "bwd_hlo": manual_region(bwd),
          # the kernel's grid is a while loop in interpret mode: one per norm, none recomputed
          "kernel_loops": (fwd.count(" while("), bwd.count(" while("))}


def check_random(mesh, dev):
  """Dropout inside shard_map: each shard draws its own mask."""
  def body(t):
    return torch.nn.functional.dropout(t, p=0.5, training=True)

  out = jb.bridge(lambda t: jb.spmd.shard_map(body, (("fsdp", None),), ("fsdp", None), mesh)(t))(
      torch.ones(8, 64).to(dev)).cpu()
  masks = [(out[2 * i:2 * i + 2] != 0).tolist() for i in range(4)]
  return {"kept": float((out != 0).float().mean()), "values": sorted(set(out.flatten().tolist())),
          "distinct_masks": len({str(m) for m in masks})}


def check_bad_input(mesh, dev):
  """Each mistake's message, or None where nothing was raised."""
  x = torch.ones(8, 8).to(dev)

  def attempt(run):
    try:
      run()
      return None
    except jb.errors.BridgeError as e:
      return f"{type(e).__name__}: {e}"

  sm = jb.spmd.shard_map
  ident = lambda t: t * 1  # noqa: E731
  cases = {
      "in_rank": lambda: jb.bridge(lambda t: sm(ident, (("fsdp",),), ("fsdp", None), mesh)(t))(x),
      "out_rank": lambda: jb.bridge(lambda t: sm(ident, (("fsdp", None),), ("fsdp",), mesh)(t))(x),
      "unknown_axis": lambda: jb.bridge(
          lambda t: sm(ident, (("model", None),), ("fsdp", None), mesh)(t))(x),
      "jax_unknown_axis": lambda: jb.call_jax(
          lambda a: sm(lambda b: b, (P("fsdp", "model"),), P("fsdp"), mesh)(a), (x,)),
      "mutation": lambda: jb.bridge(
          lambda t: sm(lambda s: s.add_(1), (("fsdp", None),), ("fsdp", None), mesh)(t))(x * 1),
      "specs_per_argument": lambda: jb.bridge(
          lambda t: sm(ident, ("fsdp", None), ("fsdp", None), mesh)(t))(x),
      "outside_traced_code": lambda: sm(ident, (("fsdp", None),), ("fsdp", None), mesh)(x),
  }
  return {name: attempt(run) for name, run in cases.items()}


def main():
  xr.use_spmd()
  dev = torch_xla.device()
  mesh = sharding.make_mesh(4, 1)
  grid = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
  facts = {"devices": xr.global_runtime_device_count()}
  checks = {
      "call_jax": lambda: check_call_jax(grid, dev),
      "permuted_mesh": lambda: check_permuted_mesh(dev),
      "layer": lambda: check_layer(mesh, dev, stacked=False),
      "stacked": lambda: check_layer(mesh, dev, stacked=True),
      "random": lambda: check_random(mesh, dev),
      "bad_input": lambda: check_bad_input(mesh, dev),
  }
  print(json.dumps(run_checks(checks, facts)))


if __name__ == "__main__":
  main()
