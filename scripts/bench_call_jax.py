"""Per-call host overhead of `call_jax` on a cache hit: ours vs upstream `xb.call_jax`.

Runs both in one process (the per-call cost of a cache hit, in microseconds), alternated over
`--repeats` rounds, for a small signature (2 tensors) and a 20-input pytree; medians. Prints a
table and writes JSON (default: out/bench_call_jax.json).

  python scripts/bench_call_jax.py [--calls 2000] [--repeats 7] [--json PATH]
"""
import argparse
import time

import torch_xla_jaxbridge as jb  # noqa: F401  (sets PJRT_DEVICE=CPU first)
import jax.numpy as jnp
import torch
import torch_xla
import torch_xla.core.xla_builder as xb

import harness


def small(a, b):
  return a * b + 1


def pytree20(params, x):
  return {k: v * x for k, v in params.items()}, jnp.sum(x)


def cases():
  dev = torch_xla.device()
  a = torch.ones(8, 8, device=dev)
  params = {f"w{i}": torch.full((16,), float(i), device=dev) for i in range(20)}
  x = torch.ones(16, device=dev)
  return {"small (2 tensors)": (small, (a, a)), "pytree (20+1 tensors)": (pytree20, (params, x))}


def per_call_us(call, fn, args, calls):
  start = time.perf_counter()
  for _ in range(calls):
    call(fn, args)
  return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default="out/bench_call_jax.json")
  opts = parser.parse_args()
  impls = {"ours": jb.call_jax, "upstream": xb.call_jax}
  rows = []
  for case, (fn, args) in cases().items():
    for call in impls.values():  # warm up: trace, lower, and run once
      torch_xla.sync()
      call(fn, args)
      torch_xla.sync()

    def measure(impl):
      us = per_call_us(impls[impl], fn, args, opts.calls)
      torch_xla.sync()
      return us

    samples = harness.rounds([(impl,) for impl in impls], opts.repeats, measure, log=None)
    ours, upstream = (harness.spread(samples[(k,)])[0] for k in ("ours", "upstream"))
    rows.append({"case": case, "ours_us": round(ours, 2), "upstream_us": round(upstream, 2),
                 "ratio": round(ours / upstream, 3)})
  print(harness.table(rows, [("case", "case"), ("ours us/call", "ours_us", str),
                             ("upstream us/call", "upstream_us", str),
                             ("ours/upstream", "ratio", str)]))
  print("target: ours/upstream <= 0.5")
  harness.write_json(opts.json, {"calls": opts.calls, "repeats": opts.repeats, "rows": rows,
                                 "cache": jb.cache_info()._asdict()})


if __name__ == "__main__":
  harness.main(main)
