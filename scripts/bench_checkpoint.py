"""What checkpoint checksums cost: the recipe's checkpoint (model and AdamW state after one step)
saved and loaded with and without them.

  save none    `checkpoint.save(..., checksum=None)`: DCP files, fsync, rename
  save crc32   the same, then `checksums.json` (CRC32 of every file; the recipe's default)
  save sha256  the same with SHA-256
  load none    `checkpoint.torn(path, verify=False)` (metadata and sizes), then `checkpoint.load`
  load crc32   `checkpoint.torn(path)` (also every file's CRC32 against checksums.json), then load
  load sha256  the same on a checkpoint saved with SHA-256
  hash crc32 / sha256   `checksums.record` alone: reading and hashing every file

The modes alternate over `--rounds` rounds in one process (a round saves, then loads what it
saved; the files are in the page cache: a load from a cold disk reads them twice with
verification). Each line: median milliseconds [min-max], and the checkpoint's bytes over the
median time. JSON: scripts/out/bench_checkpoint.json (or
--json).

  python scripts/bench_checkpoint.py [--rounds 7] [key=value ...]   # recipe overrides: model=...
"""
import argparse
import pathlib
import tempfile
import time

import torch_xla

from torch_xla_jaxbridge.recipes import checkpoint, checksums, config, data, train

import harness

ROOT = harness.ROOT


def trained(cfg):
  """The recipe's model and optimizer after one training step (AdamW has its moments)."""
  model = train.prepare(cfg, torch_xla.device())
  optimizer = train.make_optimizer(model.parameters(), cfg["train"])
  step = train.make_step(cfg, model, optimizer)
  t = cfg["train"]
  inputs, targets = data.batch(0, batch=t["batch"], seq=t["seq"], seed=t["seed"],
                               source=t["data"], vocab=cfg["model"]["vocab"])
  step(inputs.to(torch_xla.device()), targets.to(torch_xla.device()),
       train.make_schedule(optimizer, t))
  torch_xla.sync(wait=True)
  return model, optimizer


def timed(fn):
  began = time.perf_counter()
  fn()
  return time.perf_counter() - began


def round_(model, optimizer, work, cfg):
  """One round: each mode once; seconds by mode."""
  seconds, saved = {}, {}
  for algorithm in (None, "crc32", "sha256"):
    root = pathlib.Path(tempfile.mkdtemp(dir=work))
    seconds[f"save {algorithm or 'none'}"] = timed(
        lambda: saved.update({algorithm: checkpoint.save(root, 1, model, optimizer,
                                                         run_config=cfg, checksum=algorithm)}))
  for algorithm in ("crc32", "sha256"):
    seconds[f"hash {algorithm}"] = timed(lambda: checksums.record(saved[None], algorithm))
  for name, path, verify in (("none", saved[None], False), ("crc32", saved["crc32"], True),
                             ("sha256", saved["sha256"], True)):
    def load():
      assert checkpoint.torn(path, verify=verify) is None
      checkpoint.load(path, model, optimizer)
    seconds[f"load {name}"] = timed(load)
  return seconds, sum(f.stat().st_size for f in saved[None].iterdir())


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "bench_checkpoint.json"))
  parser.add_argument("overrides", nargs="*")
  opts = parser.parse_args()
  cfg = config.resolved(config.load(opts.overrides))  # as `train.train` saves it
  model, optimizer = trained(cfg)
  with tempfile.TemporaryDirectory() as work:
    round_(model, optimizer, work, cfg)  # warm-up: first save and load compile and allocate
    runs, sizes = zip(*[round_(model, optimizer, work, cfg) for _ in range(opts.rounds)])
  size, table, rows = sizes[-1], {}, []
  print(f"checkpoint: {size / 1e6:.1f} MB ({' '.join(opts.overrides) or 'defaults'}), "
        f"{opts.rounds} rounds")
  for mode in runs[0]:
    seconds = harness.spread(r[mode] for r in runs)
    table[mode] = {"median_s": seconds[0], "min_s": seconds[1], "max_s": seconds[2],
                   "mb_per_s": size / 1e6 / seconds[0]}
    rows.append({"mode": mode, "seconds": seconds, "mb_per_s": table[mode]["mb_per_s"]})
  print(harness.table(rows, [("mode", "mode"), ("ms", "seconds", lambda s: f"{s * 1e3:.1f}"),
                             ("MB/s", "mb_per_s", ".1f")]))
  harness.write_json(opts.json, {"overrides": opts.overrides, "bytes": size,
                                 "rounds": opts.rounds, "modes": table, "runs": list(runs)})
  return 0


if __name__ == "__main__":
  harness.main(main)
