"""One recipe start-up in its own process (run by test_startup.py), on 4 virtual CPU devices when
the mesh asks for them; prints its facts as JSON on the last line.

  python test/startup_check.py MODE STEPS OUT key=value ... [--warm]

MODE `sharded`: the recipe's start-up (`train.prepare`: meta build, each parameter placed as its
shards). MODE `eager`: the start-up before it, kept here as the reference: the whole model built on
the host (`llama.build` without `place`), moved with `.to(device)`, then `shard_model`.
STEPS > 0 then trains that many steps (`train.train`, the same loop either way) and reports the
losses; STEPS = 0 reports the loss of the first batch (forward only) instead.

Peak host memory is the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
just before start-up) minus the resident set just before it. On XLA:CPU the devices' buffers are
host memory too, so the facts also give the bytes the devices hold afterwards. `--warm` compiles
and runs a small program first (`warm_up`), so a start-up that runs programs (the stacked one
assembles its stacks on the devices) is not charged the process's first compile. The facts also
name the parameters still holding a graph to run after start-up (`pending`) and each
parameter's sharding next to its `sharding.model_specs` entry's (`spec_shardings`).
"""
import hashlib
import json
import math
import pathlib
import sys
import time

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs

from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge.recipes import config, data, llama, sharding, train


def memory():
  """(resident, peak resident) bytes of this process."""
  fields = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text()
                .splitlines())
  return tuple(int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))


def device_bytes(model, mesh):
  """Bytes the devices hold for the parameters: each once per device its spec replicates it on."""
  if mesh is None:
    return sum(p.numel() * p.element_size() for p in model.parameters())
  sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
  specs = sharding.model_specs(model, *mesh.mesh_shape)
  total = 0
  for name, p in model.named_parameters():
    spec = specs[name]
    total += p.numel() * p.element_size() * mesh.size() // math.prod(sizes[a] for a in spec if a)
  return int(total)


def spec_shardings(model, mesh):
  """Each parameter's `sharding.model_specs` entry as torch_xla's sharding text, read back from a
  small tensor of the parameter's rank marked with it (the text names the tiling, not the shape);
  {} without a mesh."""
  if mesh is None:
    return {}
  sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
  found = {}
  for name, spec in sharding.model_specs(model, *mesh.mesh_shape).items():
    probe = torch.zeros([sizes[a] if a else 1 for a in spec], device=torch_xla.device())
    xs.mark_sharding(probe, mesh, spec)
    found[name] = torch_xla._XLAC._get_xla_sharding_spec(probe)
  return found


def warm_up(mesh, device):
  """Compiles and runs one small program of the kind a stacked start-up runs (a slice of a
  sharded stack updated in place) before memory is measured. A process's first compile pages in
  the compiler's code (about 90 MB of file-backed resident memory on the 2 x 2 mesh) and grows
  its heap once; the first training step's compile needs that anyway, and it is not what
  start-up holds of the model. Run with `--warm`."""
  stack = torch.zeros(2, 8, 8, device=device)
  if mesh is not None:
    xs.mark_sharding(stack, mesh, (None,) + tuple(mesh.axis_names))
  stack.index_copy_(0, torch.tensor([1], device=device), torch.ones(1, 8, 8, device=device))
  torch_xla.sync()
  xm.wait_device_ops()


def main(mode, steps, out, overrides, warm=False):
  cfg = config.load([f"out={out}", f"train.steps={max(steps, 1)}", "train.checkpoint_every=0",
                     *overrides])
  mesh = sharding.make_mesh(*sharding.mesh_shape(cfg))
  device = torch_xla.device()
  facts = {"mode": mode}
  if mode == "eager":
    build = llama.build

    def eager_build(model_cfg, seed, place, stack=None):
      model = build(model_cfg, seed, stack=stack).to(device)
      if mesh is not None:
        sharding.shard_model(model, mesh)
      return model

    llama.build = eager_build
  prepare = train.prepare

  def measured_prepare(cfg, device):
    if warm:
      warm_up(mesh, device)
    before = memory()[0]
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    began = time.perf_counter()
    model = prepare(cfg, device)
    facts["prepare_s"] = time.perf_counter() - began
    # every parameter device data as start-up leaves it (a stack assembled on the device included)
    pending = torch_xla_private.live_pending_ids(str(device))
    facts["pending"] = [n for n, p in model.named_parameters()
                        if torch_xla._XLAC._xla_get_tensor_id(p) in pending]
    facts["pending_tensors"] = len(pending)
    torch_xla.sync()
    xm.wait_device_ops()
    after, peak = memory()
    params = list(model.parameters())
    facts.update(peak_increase=peak - before, retained=after - before,
                 model_bytes=sum(p.numel() * p.element_size() for p in params),
                 largest_float32_bytes=max(p.numel() * 4 for p in params),
                 device_bytes=device_bytes(model, mesh),
                 dtypes=sorted({str(p.dtype) for p in params}),
                 largest_stack_bytes=max([p.numel() * p.element_size()
                                          for n, p in model.named_parameters()
                                          if n.startswith("layers.layer.")] or [0]),
                 shardings={n: torch_xla._XLAC._get_xla_sharding_spec(p)
                            for n, p in model.named_parameters()},
                 spec_shardings=spec_shardings(model, mesh),
                 digests={k: hashlib.sha256(v.cpu().view(torch.uint8).numpy().tobytes())
                          .hexdigest()[:16] for k, v in model.state_dict().items()})
    return model

  train.prepare = measured_prepare
  if steps:
    facts["losses"] = train.train(cfg, log=lambda line: None)
  else:
    model = train.prepare(cfg, device)
    t = cfg["train"]
    inputs, targets = data.batch(0, batch=t["batch"], seq=t["seq"], seed=t["seed"],
                                 source=t["data"], vocab=cfg["model"]["vocab"])
    inputs, targets = inputs.to(device), targets.to(device)
    if mesh is not None:
      for batch in (inputs, targets):  # the batch split over fsdp, as the recipe's loader does
        xs.mark_sharding(batch, mesh, ("fsdp", None))
    with torch.no_grad():
      logits = model(inputs)
      loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    facts["losses"] = [loss.item()]
  print(json.dumps(facts))


if __name__ == "__main__":
  args = sys.argv[4:]
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], [a for a in args if a != "--warm"],
       warm="--warm" in args)
