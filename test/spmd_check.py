"""Runs the SPMD checks on 4 virtual CPU devices and prints one JSON line of facts for
test_spmd.py. SPMD is process-global and irreversible, so this runs in its own process:

  CPU_NUM_DEVICES=4 XLA_FLAGS=--xla_force_host_platform_device_count=4 python test/spmd_check.py OUT
"""
import copy
import json
import os
import pathlib
import shutil
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path[:0] = [str(pathlib.Path(__file__).parent), str(pathlib.Path(__file__).parents[1])]  # this checkout

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import torch_xla_jaxbridge as jb  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from models import MLP, DecoderLayer  # noqa: E402
from parity import rel_err, run_checks  # noqa: E402
from torch_xla_jaxbridge.recipes import config, sharding, train  # noqa: E402

spec = torch_xla._XLAC._get_xla_sharding_spec
hlo = lambda tensors: torch_xla._XLAC._get_xla_tensors_hlo(tensors)  # noqa: E731


def sharding_lines(text):
  return [line.split("sharding=")[1].split(", metadata")[0] for line in text.splitlines()
          if 'custom_call_target="Sharding"' in line]


def check_call_jax(mesh, dev):
  a, b = torch.randn(8, 6), torch.randn(6, 4)
  xa, xb = a.to(dev), b.to(dev)
  xs.mark_sharding(xa, mesh, ("fsdp", None))
  out = jb.call_jax(jnp.matmul, (xa, xb))
  before = spec(out)
  torch_xla.sync()
  return {"rel_err": rel_err(out, a @ b), "spec_before_sync": before, "spec": spec(out)}


def check_model(mesh, dev, make, inputs, layout):
  """Loss and every gradient of a bridged module on sharded tensors against eager CPU."""
  torch.manual_seed(0)
  cpu = make()
  ref = copy.deepcopy(cpu)
  ref_out = ref(*inputs)
  ref_loss = ref_out.pow(2).mean()
  ref_loss.backward()
  model = copy.deepcopy(cpu).to(dev)
  specs = {}
  if layout == "fsdp":
    specs = sharding.shard_model(model, mesh)
  bridged = jb.BridgeModule(model)
  xin = [x.to(dev) for x in inputs]
  xs.mark_sharding(xin[0], mesh, ("fsdp",) + (None,) * (xin[0].dim() - 1))
  out = bridged(*xin)
  loss = out.pow(2).mean()
  loss.backward()
  torch_xla.sync()
  grads = {n: (rel_err(p.grad, r.grad), spec(p), spec(p.grad))
           for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters())}
  return {"loss": loss.item(), "ref_loss": ref_loss.item(), "out_rel_err": rel_err(out, ref_out),
          "out_spec": spec(out), "grads": grads, "specs": {n: list(s) for n, s in specs.items()}}


def check_scan(mesh, dev):
  torch.manual_seed(0)
  cpu = torch.nn.ModuleList(MLP(8, 16, 8) for _ in range(3))
  ref = copy.deepcopy(cpu)
  x = torch.randn(8, 8)
  h = x
  for layer in ref:
    h = layer(h)
  h.pow(2).mean().backward()
  layers = copy.deepcopy(cpu).to(dev)
  for layer in layers:
    sharding.shard_model(layer, mesh)
  xx = x.to(dev)
  xs.mark_sharding(xx, mesh, ("fsdp", None))
  out = jb.scan_layers(layers, xx)
  out.pow(2).mean().backward()
  torch_xla.sync()
  errs = [rel_err(p.grad, r.grad) for p, r in zip(layers.parameters(), ref.parameters())]
  return {"out_rel_err": rel_err(out, h), "max_grad_rel_err": max(errs), "out_spec": spec(out),
          "grad_specs": [(spec(p), spec(p.grad)) for p in layers.parameters()]}


def check_constraints(dev):
  """A sharding asked for inside bridged torch code and inside a JAX function."""
  reversed_mesh = xs.Mesh(np.array([3, 2, 1, 0]), (4,), ("d",))

  @jb.bridge
  def scaled(x):
    y = x * 2
    xs.mark_sharding(y, reversed_mesh, ("d", None))
    return y + 1

  x = torch.randn(8, 8).to(dev).requires_grad_(True)
  out = scaled(x)
  fwd_hlo = sharding_lines(hlo([out]))
  out.sum().backward()
  bwd_hlo = sharding_lines(hlo([x.grad]))
  torch_xla.sync()
  reference = torch.zeros(8, 8).to(dev)
  xs.mark_sharding(reference, reversed_mesh, ("d", None))

  with_grads = jb.bridge(lambda t: xs.mark_sharding_with_gradients(t * 2, reversed_mesh,
                                                                  (None, "d")) + 1)
  w = torch.randn(8, 8).to(dev).requires_grad_(True)
  out3 = with_grads(w)
  out3.sum().backward()
  torch_xla.sync()
  grid = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))

  def jax_fn(a):
    return jb.spmd.with_sharding_constraint(jnp.sin(a), grid, (None, "model")) * 2

  z = torch.randn(8, 8)
  out2 = jb.call_jax(jax_fn, (z.to(dev),))
  jax_hlo = sharding_lines(hlo([out2]))
  torch_xla.sync()
  return {"bridge_hlo": fwd_hlo, "bridge_grad_hlo": bwd_hlo, "bridge_out_spec": spec(out),
          "bridge_grad_spec": spec(x.grad), "torch_xla_spec": spec(reference),
          "bridge_rel_err": rel_err(out, x.detach().cpu() * 2 + 1),
          "with_gradients_specs": [spec(out3), spec(w.grad)],
          "hooks_restored": xs.mark_sharding.__name__ == "mark_sharding",
          "jax_hlo": jax_hlo, "jax_out_spec": spec(out2),
          "jax_rel_err": rel_err(out2, torch.sin(z) * 2)}


def check_bad_input(dev):
  cases = {
      "mesh_too_small": lambda t: xs.mark_sharding(t, xs.Mesh(np.arange(2), (2,), ("d",)),
                                                   ("d", None)),
      "spec_too_short": lambda t: xs.mark_sharding(t, xs.Mesh(np.arange(4), (4,), ("d",)),
                                                   ("d",)),
      "unknown_axis": lambda t: xs.mark_sharding(t, xs.Mesh(np.arange(4), (4,), ("d",)),
                                                 ("model", None)),
  }
  messages = {}
  for name, body in cases.items():
    bridged = jb.bridge(lambda x, body=body: body(x * 1) * 2, name=name, fallback=False)
    try:
      bridged(torch.ones(8, 8).to(dev))
      messages[name] = None
    except jb.errors.BridgeError as e:
      messages[name] = f"{type(e).__name__}: {e}"
  try:
    config.load(["mesh.fsdp=4", "train.batch=6"])
    messages["odd_batch"] = None
  except config.ConfigError as e:
    messages["odd_batch"] = str(e)
  return messages


def check_recipe(out_dir, *overrides):
  cfg = config.load(["train.steps=3", "train.checkpoint_every=1", "mesh.fsdp=4",
                     f"out={out_dir}", *overrides])
  losses = train.train(cfg, log=lambda line: None)
  summary = json.loads((pathlib.Path(out_dir) / "summary.json").read_text())
  return {"losses": losses, "param_shardings": summary["param_shardings"]}


def check_recipe_flash(out_dir):
  """The recipe with flash attention on a (2, 2) mesh: its losses, and the manual-sharding region
  (the kernel runs per device in shard_map) in the HLO of one step's loss and gradients."""
  found = check_recipe(out_dir, "mesh.fsdp=2", "mesh.tensor=2", "model.attention=flash",
                       "train.checkpoint_every=0")
  cfg = config.load(["mesh.fsdp=2", "mesh.tensor=2", "model.attention=flash", "train.batch=4",
                     "train.seq=16"])
  model = train.prepare(cfg, torch_xla.device())
  tokens = torch.zeros(4, 16, dtype=torch.long, device="xla")
  xs.mark_sharding(tokens, sharding.make_mesh(2, 2), ("fsdp", None))
  loss = model(tokens).sum()
  loss.backward()
  hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss] + [p.grad for p in model.parameters()])
  torch_xla.sync()
  return {**found, "full_to_shard": hlo.count("SPMDFullToShardShape"),
          "shard_to_full": hlo.count("SPMDShardToFullShape")}


def check_recipe_resharded(out_dir):
  """The "recipe" run's step-1 checkpoint (mesh (4, 1)) resumed on (2, 2), which saves steps 2
  and 3: its losses, shardings and checkpoints (test_checkpoint.py resumes them on one device)."""
  first, second = pathlib.Path(out_dir), pathlib.Path(out_dir) / "fsdp2_tensor2"
  shutil.copytree(first / "checkpoints" / "step_000001", second / "checkpoints" / "step_000001")
  resumed = train.train(config.load(["train.steps=3", "train.checkpoint_every=1", f"out={second}",
                                     "mesh.fsdp=2", "mesh.tensor=2", "resume=true"]),
                        log=lambda line: None)
  summary = json.loads((second / "summary.json").read_text())
  keys = lambda path: sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)  # noqa: E731
  return {"resumed": resumed, "checkpoints": str(second / "checkpoints"),
          "param_shardings": summary["param_shardings"],
          "keys_fsdp4": keys(first / "checkpoints" / "step_000003"),
          "keys_resharded": keys(second / "checkpoints" / "step_000003")}


def main(out_dir):
  xr.use_spmd()
  dev = torch_xla.device()
  mesh = sharding.make_mesh(4, 1)
  facts = {"devices": xr.global_runtime_device_count()}
  checks = {
      "call_jax": lambda: check_call_jax(mesh, dev),
      "mlp_dp": lambda: check_model(mesh, dev, lambda: MLP(8, 32, 4), [torch.randn(16, 8)],
                                    "dp"),
      "mlp_fsdp": lambda: check_model(mesh, dev, lambda: MLP(8, 32, 4), [torch.randn(16, 8)],
                                      "fsdp"),
      "decoder_dp": lambda: check_model(mesh, dev, lambda: DecoderLayer(32, 4, 2, 64),
                                        [torch.randn(4, 8, 32), torch.arange(8)], "dp"),
      "decoder_fsdp": lambda: check_model(mesh, dev, lambda: DecoderLayer(32, 4, 2, 64),
                                          [torch.randn(4, 8, 32), torch.arange(8)], "fsdp"),
      "scan": lambda: check_scan(mesh, dev),
      "constraints": lambda: check_constraints(dev),
      "bad_input": lambda: check_bad_input(dev),
      "recipe": lambda: check_recipe(out_dir, "remat.stack_layers=false"),  # per layer
      "recipe_scan": lambda: check_recipe(pathlib.Path(out_dir) / "scan", "remat.scan_layers=true"),
      "recipe_stacked": lambda: check_recipe(pathlib.Path(out_dir) / "stacked"),  # default
      "recipe_layers": lambda: check_recipe(pathlib.Path(out_dir) / "layers",
                                            "remat.bridge=layers", "remat.stack_layers=false"),
      "recipe_resharded": lambda: check_recipe_resharded(out_dir),
      "recipe_flash": lambda: check_recipe_flash(pathlib.Path(out_dir) / "flash"),
  }
  print(json.dumps(run_checks(checks, facts)))


if __name__ == "__main__":
  main(sys.argv[1])
