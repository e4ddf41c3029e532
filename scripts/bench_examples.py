"""pytorch/xla's own example scripts, unmodified and with the package adopted by a small edit:
first step (trace and compile), steady step, and the losses against the unmodified run.

Examples (from a pytorch/xla checkout; nothing of upstream's is kept in this repository):
- `decoder`: `examples/train_decoder_only_base.py` with `examples/decoder_only_model.py`;
- `scan`: the same trainer with `examples/scan/decoder_with_scan.py`'s `DecoderWithScan`
  (upstream's `scan_layers` over the decoder layers);
- `resnet`: `examples/train_resnet_base.py` (torchvision's ResNet-50).

Modes (the adoption, applied as a textual edit to a copy of the example in a temporary folder):
- `unmodified`: the example as it is;
- `by class`: one line after the model is built, `jb.bridge_modules(self.model, [layer class])`
  (`DecoderLayer`, `Bottleneck`);
- `train_step`: the compiled step is `jb.train_step(loss, optimizer)` in place of the example's
  `step_fn` (forward, loss, backward, optimizer step), its loss a lambda over the model and loss
  module read into locals first (the line before), and the optimizer its `jb.optim` equivalent
  (`torch.optim.Adam` -> `jb.optim.AdamW(weight_decay=0.0)`, `SGD` -> `jb.optim.SGD`, same
  arguments): three edited lines;
- `jb.scan_layers` (scan example): the import of upstream's `scan_layers` replaced by the
  package's.

Every mode (the unmodified one too) gets the same size edits: the step count (ResNet's steps take
seconds here, the decoder's under one), the decoder's batch and sequence length, ResNet's batch (the examples' full sizes take minutes a step on a 2-core
CPU); the decoder's model sizes are the example's command-line flags (`--hidden-size` ...), its
other sizes (vocabulary 3200, 2 layers, 8 query and 4 key/value heads) the example's own.

Each (example, mode) runs in its own process, seeded as the example's `__main__` seeds, through
the example's own loop (`start_training()`), its compiled step wrapped to wait for the device
before and after each step; the modes of an example alternate over `--rounds` rounds. Per run:
the wall time of the first two steps (both trace and compile: the decoder's second step has
Adam's state), the steady step (median wall time of the steps after `WARMUP`) and its process CPU
time (tracing and XLA:CPU's execution threads: less sensitive than wall time to other processes
on a shared machine), and every step's loss. Prints medians [min-max] over rounds; the ratio
unmodified / mode of the steady step per round (above 1: the mode is faster), as median
[min-max]; the largest loss difference against the unmodified run of the same round; and for the
scan example the ratio against the decoder example's unmodified run (the same model with a loop
of layers). Writes JSON.

  python scripts/bench_examples.py PATH_TO_PYTORCH_XLA_CHECKOUT [--examples decoder scan resnet]
      [--rounds 3] [--steps 16] [--resnet-steps 6] [--json scripts/out/bench_examples.json]
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WARMUP = 2  # steps left out of the steady time: both compile (the second: Adam's first state)
DECODER = "examples/train_decoder_only_base.py"
RESNET = "examples/train_resnet_base.py"
SCAN = "examples/scan/decoder_with_scan.py"
IMPORT = ("import torch_xla\n", "import torch_xla\nimport torch_xla_jaxbridge as jb\n")
COMPILE = "self.compiled_step_fn = torch_xla.compile(\n        self.step_fn,"
# a lambda reads the model and loss from locals: `jb.train_step` lifts the modules a function
# closes over (or, for a bound method, its object's), not those of an object it closes over
DECODER_STEP = (
    "model, loss_fn, vocab = self.model, self.loss_fn, self.config.vocab_size\n"
    "    self.compiled_step_fn = torch_xla.compile(\n        jb.train_step(lambda data, target: "
    "loss_fn(model(data).view(-1, vocab), target.view(-1)), self.optimizer),")
RESNET_STEP = (
    "model, loss_fn = self.model, self.loss_fn\n"
    "    self.compiled_step_fn = torch_xla.compile(\n        jb.train_step(lambda data, target: "
    "loss_fn(model(data), target), self.optimizer),")
# example -> files copied, the trainer module and class, the size edits, and per mode the edits
# (file, text, replacement); each text must occur exactly once
EXAMPLES = {
    "decoder": {
        "files": [DECODER, "examples/decoder_only_model.py"],
        "trainer": ("train_decoder_only_base", "TrainDecoderOnlyBase"), "model": None,
        "sizes": [(DECODER, "self.batch_size = 16", "self.batch_size = {batch}"),
                  (DECODER, "self.seq_len = 512", "self.seq_len = {seq}")],
        "modes": {
            "unmodified": [],
            "by class": [(DECODER, *IMPORT), (
                DECODER, "self.model = decoder_cls(self.config).to(self.device)\n",
                "self.model = decoder_cls(self.config).to(self.device)\n"
                "    jb.bridge_modules(self.model, ['DecoderLayer'])\n")],
            "train_step": [(DECODER, *IMPORT), (
                DECODER, "torch.optim.Adam(self.model.parameters(), lr=0.0001)",
                "jb.optim.AdamW(self.model.parameters(), lr=0.0001, weight_decay=0.0)"), (
                DECODER, COMPILE, DECODER_STEP)],
        },
    },
    "scan": {
        "files": [DECODER, "examples/decoder_only_model.py", SCAN],
        "trainer": ("train_decoder_only_base", "TrainDecoderOnlyBase"),
        "model": ("decoder_with_scan", "DecoderWithScan"),
        "sizes": [(DECODER, "self.batch_size = 16", "self.batch_size = {batch}"),
                  (DECODER, "self.seq_len = 512", "self.seq_len = {seq}")],
        "modes": {
            "unmodified": [],
            "jb.scan_layers": [(SCAN, "from torch_xla.experimental.scan_layers import scan_layers",
                                "from torch_xla_jaxbridge import scan_layers")],
        },
    },
    "resnet": {
        "files": [RESNET],
        "trainer": ("train_resnet_base", "TrainResNetBase"), "model": None,
        "sizes": [(RESNET, "self.batch_size = 128", "self.batch_size = {resnet_batch}"),
                  (RESNET, "self.num_steps = 300", "self.num_steps = {resnet_steps}")],
        "modes": {
            "unmodified": [],
            "by class": [(RESNET, *IMPORT), (
                RESNET, "self.model = torchvision.models.resnet50().to(self.device)\n",
                "self.model = torchvision.models.resnet50().to(self.device)\n"
                "    jb.bridge_modules(self.model, ['Bottleneck'])\n")],
            "train_step": [(RESNET, *IMPORT), (
                RESNET, "optim.SGD(self.model.parameters(), weight_decay=1e-4)",
                "jb.optim.SGD(self.model.parameters(), weight_decay=1e-4)"), (
                RESNET, COMPILE, RESNET_STEP)],
        },
    },
}


def prepare(checkout, example, mode, folder, sizes):
  """Copies the example's files into `folder` (keeping their paths under examples/) with the size
  edits and the mode's edits applied; returns the folder the trainer imports from."""
  spec = EXAMPLES[example]
  texts = {rel: (checkout / rel).read_text() for rel in spec["files"]}
  for rel, old, new in [*spec["sizes"], *spec["modes"][mode]]:
    count = texts[rel].count(old)
    if count != 1:
      raise SystemExit(f"bench_examples: {rel} holds {old!r} {count} times, not once: this "
                       f"checkout's example differs from the one the edits were written for.")
    texts[rel] = texts[rel].replace(old, new.format(**sizes))
  for rel, text in texts.items():
    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
    (folder / rel).write_text(text)
  return folder / "examples"


def child(folder, example, steps, config):
  """Runs the example's trainer in this process; returns its step times and losses."""
  import importlib

  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm

  sys.path[:0] = [str(folder), str(folder / "scan")]
  spec = EXAMPLES[example]
  torch.manual_seed(42)  # as the example's __main__
  torch_xla.manual_seed(42)
  trainer = getattr(importlib.import_module(spec["trainer"][0]), spec["trainer"][1])
  if example == "resnet":
    base = trainer()
  else:
    from decoder_only_model import DecoderOnlyConfig
    model = spec["model"] and getattr(importlib.import_module(spec["model"][0]), spec["model"][1])
    base = trainer(*[model] if model else [], num_steps=steps, config=DecoderOnlyConfig(**config))
  step, walls, cpus, losses = base.compiled_step_fn, [], [], []

  def timed(data, target):
    xm.wait_device_ops()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = step(data, target)
    xm.wait_device_ops()
    walls.append((time.perf_counter() - wall) * 1e3)
    cpus.append((time.process_time() - cpu) * 1e3)
    losses.append(loss.item())
    return loss

  base.compiled_step_fn = timed
  base.start_training()
  return {"first_ms": walls[0], "second_ms": walls[1],
          "steady_ms": statistics.median(walls[WARMUP:]),
          "steady_cpu_ms": statistics.median(cpus[WARMUP:]), "walls_ms": walls, "cpus_ms": cpus,
          "losses": losses}


def run(checkout, example, mode, opts, work):
  """One (example, mode) in its own process."""
  folder = pathlib.Path(tempfile.mkdtemp(dir=work))
  sizes = {"batch": opts.batch, "seq": opts.seq, "resnet_batch": opts.resnet_batch,
           "resnet_steps": opts.resnet_steps}
  prepare(checkout, example, mode, folder, sizes)
  config = {"hidden_size": opts.hidden_size, "num_hidden_layers": opts.layers,
            "num_attention_heads": opts.heads, "num_key_value_heads": opts.kv_heads,
            "intermediate_size": opts.intermediate_size}
  proc = subprocess.run(
      [sys.executable, __file__, "--child", str(folder / "examples"), example, str(opts.steps),
       json.dumps(config)], capture_output=True, text=True, cwd=folder,
      env=dict(os.environ, PJRT_DEVICE="CPU",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
  shutil.rmtree(folder, ignore_errors=True)
  if proc.returncode != 0:
    raise RuntimeError(f"{example} {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  return dict(json.loads(proc.stdout.strip().splitlines()[-1]), example=example, mode=mode)


def spread(values):
  """[median, min, max]."""
  return [statistics.median(values), min(values), max(values)]


def summarize(runs):
  """One row per (example, mode): medians [min, max] over rounds; the ratios unmodified / mode
  of the steady step (wall and CPU) per round, as median [min, max]; the largest loss
  difference against the unmodified run of the same round."""
  rows = []
  for example in dict.fromkeys(r["example"] for r in runs):
    mine = [r for r in runs if r["example"] == example]
    base = {r["round"]: r for r in mine if r["mode"] == "unmodified"}
    decoder = {r["round"]: r for r in runs if (r["example"], r["mode"]) == ("decoder",
                                                                              "unmodified")}
    for mode in dict.fromkeys(r["mode"] for r in mine):
      these = [r for r in mine if r["mode"] == mode]
      row = {"example": example, "mode": mode, "rounds": len(these)}
      for key in ("first_ms", "second_ms", "steady_ms", "steady_cpu_ms"):
        row[key] = spread([r[key] for r in these])
      row["ratio"] = spread([base[r["round"]]["steady_ms"] / r["steady_ms"] for r in these])
      row["cpu_ratio"] = spread([base[r["round"]]["steady_cpu_ms"] / r["steady_cpu_ms"]
                                 for r in these])
      if example == "scan" and decoder:  # against the decoder example's loop of layers
        row["ratio_decoder"] = spread([decoder[r["round"]]["steady_ms"] / r["steady_ms"]
                                       for r in these if r["round"] in decoder])
      row["loss_diff"] = max(abs(a - b) for r in these
                             for a, b in zip(r["losses"], base[r["round"]]["losses"]))
      row["losses"] = these[0]["losses"]
      rows.append(row)
  return rows


def show(rows, opts):
  print(f"\ndecoder and scan: hidden {opts.hidden_size}, intermediate {opts.intermediate_size}, "
        f"{opts.layers} layers, heads {opts.heads}/{opts.kv_heads}, batch {opts.batch}, "
        f"seq {opts.seq}, {opts.steps} steps; resnet: batch {opts.resnet_batch}, 224x224, "
        f"{opts.resnet_steps} steps; steady from step {WARMUP + 1}; medians [min-max] over rounds")
  print(f"{'example':<8}{'mode':<15}{'step 1 s':>19}{'step 2 s':>19}{'steady ms':>19}"
        f"{'x unmod':>18}{'cpu x unmod':>18}{'loss diff':>10}")
  for r in rows:
    secs = lambda k: "{:.1f} [{:.1f}-{:.1f}]".format(*(v / 1e3 for v in r[k]))  # noqa: E731
    ratio = lambda k: "{:.2f} [{:.2f}-{:.2f}]".format(*r[k])  # noqa: E731
    print(f"{r['example']:<8}{r['mode']:<15}{secs('first_ms'):>19}{secs('second_ms'):>19}"
          f"{'{:.0f} [{:.0f}-{:.0f}]'.format(*r['steady_ms']):>19}{ratio('ratio'):>18}"
          f"{ratio('cpu_ratio'):>18}{r['loss_diff']:>10.1e}")
  for r in rows:
    if "ratio_decoder" in r:
      print(f"scan {r['mode']} against the decoder example's unmodified loop: "
            "{:.2f} [{:.2f}-{:.2f}]".format(*r["ratio_decoder"]))


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    folder, example, steps, config = sys.argv[2:6]
    print(json.dumps(child(pathlib.Path(folder), example, int(steps), json.loads(config))))
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("checkout", type=pathlib.Path, help="a pytorch/xla source checkout")
  parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
  parser.add_argument("--modes", nargs="+", help="modes to run (default: all of each example)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=16, help="decoder and scan steps a run")
  parser.add_argument("--resnet-steps", type=int, default=6, help="resnet steps a run")
  parser.add_argument("--batch", type=int, default=4, help="decoder batch (the example's: 16)")
  parser.add_argument("--seq", type=int, default=128, help="decoder sequence (example's: 512)")
  parser.add_argument("--hidden-size", type=int, default=128, help="the example's: 1024")
  parser.add_argument("--intermediate-size", type=int, default=4096,
                      help="the example's: 32 x 1024")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--resnet-batch", type=int, default=2, help="the example's: 128")
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "bench_examples.json"))
  opts = parser.parse_args()
  if min(opts.steps, opts.resnet_steps) <= WARMUP:
    parser.error(f"--steps and --resnet-steps must be over {WARMUP} (the warm-up steps)")
  checkout = opts.checkout.resolve()
  missing = [rel for spec in EXAMPLES.values() for rel in spec["files"]
             if not (checkout / rel).exists()]
  if missing:
    sys.exit(f"bench_examples: {checkout} lacks {sorted(set(missing))}; give the root of a "
             f"pytorch/xla checkout (the one matching the installed torch_xla).")
  runs = []
  with tempfile.TemporaryDirectory(prefix="bench_examples_") as work:
    for round_ in range(opts.rounds):
      for example in opts.examples:
        for mode in EXAMPLES[example]["modes"]:
          if opts.modes and mode not in opts.modes and mode != "unmodified":
            continue
          runs.append(dict(run(checkout, example, mode, opts, pathlib.Path(work)), round=round_))
          r = runs[-1]
          print(f"round {round_}: {example} {mode}: first {r['first_ms'] / 1e3:.2f} s, steady "
                f"{r['steady_ms']:.0f} ms", flush=True)
          write(opts, runs, None)  # after each run: an interrupted run keeps what it measured
  rows = summarize(runs)
  show(rows, opts)
  write(opts, runs, rows)


def write(opts, runs, rows):
  os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
  with open(opts.json, "w") as f:
    json.dump({"config": {k: str(v) for k, v in vars(opts).items()}, "runs": runs, "rows": rows,
               "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
  main()
