"""Trains model after model in one process, each dropped after its steps, and prints as JSON what
the process holds after each: memory maps, resident memory, torch_xla's cached compiled
programs, the package's traces and report rows, and whether the model was freed.
test_long_lived runs it in fresh processes, plain torch_xla and bridged.

  python test/long_lived_check.py plain|bridged MODELS
"""
import gc
import json
import sys
import weakref

import torch
import torch_xla
import torch_xla.runtime as xr


def count_maps() -> int:
  with open("/proc/self/maps") as maps:
    return sum(1 for _ in maps)


def resident_mb() -> float:
  with open("/proc/self/status") as status:
    kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
  return kb / 1024


def build(index: int) -> torch.nn.Module:
  """The index-th model: widths and depths differ, so no two models share a program."""
  width, depth = 8 + index, 1 + index % 3
  layers = [torch.nn.Linear(6, width), torch.nn.Tanh()]
  for _ in range(depth):
    layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
  return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def train(index: int, bridged: bool) -> tuple:
  """Three steps of the index-th model; `(last loss, weak reference to the model)`."""
  torch.manual_seed(index)
  model = build(index).to("xla")
  x = torch.randn(4, 6).to("xla")
  if bridged:
    import torch_xla_jaxbridge as jb

    jb.bridge_modules(model, ["Sequential"])
    opt = jb.optim.AdamW(model.parameters(), lr=1e-2)
    step = jb.train_step(lambda: model(x).square().mean(), opt)
    losses = []
    for _ in range(3):  # a step per sync, as the plain loop (and a training loop) runs
      losses.append(step())
      torch_xla.sync()
  else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
      loss = model(x).square().mean()
      loss.backward()
      opt.step()
      opt.zero_grad()
      losses.append(loss.detach())
      torch_xla.sync()
  torch_xla.sync()
  return losses[-1].item(), weakref.ref(model)


def main(mode: str, models: int) -> None:
  bridged = mode == "bridged"
  rows = []
  for index in range(models):
    loss, ref = train(index, bridged)
    gc.collect()
    row = {"model": index, "loss": loss, "freed": ref() is None, "maps": count_maps(),
           "rss_mb": round(resident_mb(), 1),
           "xla_programs": xr.get_num_cached_compilation_graph()}
    if bridged:
      import torch_xla_jaxbridge as jb

      row["traces"] = jb.cache_info().currsize
      row["report_rows"] = len(jb.bridge_report().rows)
    rows.append(row)
  print(json.dumps(rows))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
