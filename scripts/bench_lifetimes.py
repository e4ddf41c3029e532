"""What a dropped model leaves behind: resident memory growth per model when one process builds,
trains (2 steps) and drops many small models through each entry point of the package.

Each entry point runs in its own process: `--models` models one after another, model `i` a
`Linear-ReLU-Linear` (3 stacked Linear layers for the stacks, 2 Linear layers around an
`if h.sum() > 0:` for the fallbacks) of width `--width + 8 * i` (every model a new structure, so
nothing can be shared between them; `--same`: all of one width), trained 2 steps (forward,
backward, optimizer step, `torch_xla.sync()`), then `del` and `gc.collect()`. After each model
it records the process's resident memory (after `malloc_trim`, so freed heap memory is not
counted), how many of the model's modules and parameters are still alive (weak references) and
the bytes of those parameters, `jb.cache_info().currsize` and the rows of `jb.bridge_report()`.
The growth per model is the slope of resident memory over the models after the first `--warmup`
(a least-squares fit). `lazytensor` (plain torch_xla, no bridge) is the floor: torch_xla's own
cache of compiled programs grows with every new graph. Results: docs/performance.md ("Dropped
models").

  python scripts/bench_lifetimes.py [--models 20] [--width 512] [--same] [--entries ...]
      [--out FILE]  (FILE holding a run with the same settings: its other entries are kept)
"""
import argparse
import ctypes
import gc
import json
import os
import pathlib
import warnings
import weakref

import harness

ENTRY_POINTS = ("lazytensor", "BridgeModule", "bridge_modules", "bridge", "assume_pure",
                "train_step", "StackedLayers", "scan_layers", "fallback", "fallback train_step")


def _rss_mib():
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _one_model(entry, width):
  """Builds and trains a model 2 steps; returns weak references to it, its modules and its
  parameters, and each parameter's bytes."""
  import torch
  import torch_xla

  import torch_xla_jaxbridge as jb

  class Branchy(torch.nn.Module):  # data-dependent control flow: its region falls back
    def __init__(self):
      super().__init__()
      self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
      h = self.a(x)
      if h.sum() > 0:
        h = torch.relu(h)
      return self.b(h)

  def mlp():
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width))

  x = torch.randn(8, width, device="xla")
  stack = lambda: [torch.nn.Linear(width, width) for _ in range(3)]  # noqa: E731
  model = {"StackedLayers": lambda: jb.StackedLayers(stack()),
           "scan_layers": lambda: torch.nn.ModuleList(stack()),
           "fallback": Branchy, "fallback train_step": Branchy}.get(entry, mlp)().to("xla")
  if entry in ("train_step", "fallback train_step"):
    optimizer = jb.optim.AdamW(model.parameters(), lr=1e-3)
    step = jb.train_step(lambda x: model(x).square().mean(), optimizer)
    for _ in range(2):
      step(x)
      torch_xla.sync()
    return _refs(model)
  if entry in ("BridgeModule", "fallback"):
    forward = jb.BridgeModule(model)
  elif entry == "bridge_modules":
    jb.bridge_modules(model, ["Linear"])
    forward = model
  elif entry == "bridge":
    forward = jb.bridge(lambda x: model(x))
  elif entry == "assume_pure":
    forward = jb.assume_pure(lambda x: model(x))
  elif entry == "scan_layers":
    forward = lambda x: jb.scan_layers(model, x)  # noqa: E731
  else:
    forward = model
  optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
  for _ in range(2):
    forward(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
  return _refs(model)


def _refs(model):
  params = list(model.parameters())
  return ([weakref.ref(o) for o in [model, *model.modules(), *params]],
          [(weakref.ref(p), p.numel() * p.element_size()) for p in params])


def child(entry: str, models: int, width: int, same: bool) -> list:
  import torch_xla

  import torch_xla_jaxbridge as jb
  warnings.simplefilter("ignore", jb.errors.FallbackWarning)
  rows = []
  for i in range(models):
    refs, params = _one_model(entry, width if same else width + 8 * i)
    gc.collect()
    torch_xla.sync()
    rows.append({"rss_mib": round(_rss_mib(), 1),
                 "alive": sum(r() is not None for r in refs),
                 "alive_param_mib": round(sum(n for r, n in params if r() is not None) / 2**20, 2),
                 "cache_entries": jb.cache_info().currsize,
                 "report_rows": len(jb.bridge_report().rows)})
  return rows


def _slope(values):
  n = len(values)
  mean_x, mean_y = (n - 1) / 2, sum(values) / n
  num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
  return num / sum((i - mean_x) ** 2 for i in range(n))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", type=int, default=20)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--warmup", type=int, default=4)
  parser.add_argument("--same", action="store_true", help="every model of one width")
  parser.add_argument("--entries", nargs="*", default=list(ENTRY_POINTS))
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  settings = {"models": args.models, "width": args.width, "same": args.same}
  results = {}
  if args.out and args.out.exists():  # entries measured before with the same settings: kept
    earlier = json.loads(args.out.read_text())
    results = earlier["results"] if {k: earlier[k] for k in settings} == settings else {}
  for entry in args.entries:
    rows = harness.run_child(__file__, [entry, args.models, args.width, args.same])
    growth = _slope([r["rss_mib"] for r in rows[args.warmup:]])
    results[entry] = {"rss_growth_mib_per_model": round(growth, 2), "per_model": rows}
    last = rows[-1]
    print(f"{entry:22} {growth:6.2f} MiB/model  models with objects alive: "
          f"{sum(r['alive'] > 0 for r in rows):2d}/{len(rows)} (parameters "
          f"{sum(r['alive_param_mib'] for r in rows):6.2f} MiB)  cache entries at the end: "
          f"{last['cache_entries']:3d}  report rows: {last['report_rows']:3d}", flush=True)
    if args.out:  # after each entry: a run cut short keeps what it measured
      harness.write_json(args.out, {**settings, "results": results})


if __name__ == "__main__":
  harness.main(main, child)
