"""pytorch/xla's own example scripts, unmodified and with the package adopted by a small edit:
first step (trace and compile), steady step, and the losses against the unmodified run.

Examples (from a pytorch/xla checkout; nothing of upstream's is kept in this repository):
- `decoder`: `examples/train_decoder_only_base.py` with `examples/decoder_only_model.py`;
- `scan`: the same trainer with `examples/scan/decoder_with_scan.py`'s `DecoderWithScan`
  (upstream's `scan_layers` over the decoder layers);
- `resnet`: `examples/train_resnet_base.py` (torchvision's ResNet-50);
- `eager`: `examples/eager/train_decoder_only_eager.py`: the decoder example under torch_xla's
  eager mode (`eager_mode(True)`, each op run as it is called), its step uncompiled (the eager
  example's two lines, applied to the decoder's trainer).

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
seconds here, the decoder's under one), the decoder's batch and sequence length, ResNet's batch
(the examples' full sizes take minutes a step on a 2-core CPU); the decoder's model sizes are the
example's command-line flags (`--hidden-size` ...), its other sizes (vocabulary 3200, 2 layers, 8
query and 4 key/value heads) the example's own.

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
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import harness

ROOT = harness.ROOT
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
DECODER_SIZES = [(DECODER, "self.batch_size = 16", "self.batch_size = {batch}"),
                 (DECODER, "self.seq_len = 512", "self.seq_len = {seq}")]
DECODER_BY_CLASS = [(DECODER, *IMPORT), (
    DECODER, "self.model = decoder_cls(self.config).to(self.device)\n",
    "self.model = decoder_cls(self.config).to(self.device)\n"
    "    jb.bridge_modules(self.model, ['DecoderLayer'])\n")]
# example -> files copied, the trainer module and class, the size edits, and per mode the edits
# (file, text, replacement); each text must occur exactly once
EXAMPLES = {
    "decoder": {
        "files": [DECODER, "examples/decoder_only_model.py"],
        "trainer": ("train_decoder_only_base", "TrainDecoderOnlyBase"), "model": None,
        "sizes": DECODER_SIZES,
        "modes": {
            "unmodified": [],
            "by class": DECODER_BY_CLASS,
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
        "sizes": DECODER_SIZES,
        "modes": {
            "unmodified": [],
            "jb.scan_layers": [(SCAN, "from torch_xla.experimental.scan_layers import scan_layers",
                                "from torch_xla_jaxbridge import scan_layers")],
        },
    },
    "eager": {
        "files": [DECODER, "examples/decoder_only_model.py"],
        "trainer": ("train_decoder_only_base", "TrainDecoderOnlyBase"), "model": None,
        "eager_mode": True,
        "sizes": DECODER_SIZES,
        "modes": {
            "unmodified": [],
            "by class": DECODER_BY_CLASS,
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


def child(folder: str, example: str, steps: int, config: dict) -> dict:
  """Runs the example's trainer in this process; returns its step times and losses."""
  import importlib

  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm

  sys.path[:0] = [folder, os.path.join(folder, "scan")]
  spec = EXAMPLES[example]
  torch.manual_seed(42)  # as the example's __main__
  torch_xla.manual_seed(42)
  trainer = getattr(importlib.import_module(spec["trainer"][0]), spec["trainer"][1])
  if spec.get("eager_mode"):
    torch_xla.experimental.eager_mode(True)
  if example == "resnet":
    base = trainer()
  else:
    from decoder_only_model import DecoderOnlyConfig
    model = spec["model"] and getattr(importlib.import_module(spec["model"][0]), spec["model"][1])
    base = trainer(*[model] if model else [], num_steps=steps, config=DecoderOnlyConfig(**config))
  if spec.get("eager_mode"):
    base.compiled_step_fn = base.step_fn  # as the eager example's trainer
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
  try:
    result = harness.run_child(__file__, [str(folder / "examples"), example, opts.steps, config],
                               {"PJRT_DEVICE": "CPU"}, cwd=folder)
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  return dict(result, example=example, mode=mode)


def summarize(results):
  """One row per (example, mode): medians [min, max] over rounds; the ratios unmodified / mode
  of the steady step (wall and CPU) per round, as median [min, max]; the largest loss
  difference against the unmodified run of the same round."""
  rows = []
  decoder = results.get(("decoder", "unmodified"))
  for (example, mode), these in results.items():
    base = results[(example, "unmodified")]
    row = {"example": example, "mode": mode, "rounds": len(these),
           **harness.spreads(these, ["first_ms", "second_ms", "steady_ms", "steady_cpu_ms"]),
           "ratio": harness.ratio(base, these, "steady_ms"),
           "cpu_ratio": harness.ratio(base, these, "steady_cpu_ms")}
    if example == "scan" and decoder:  # against the decoder example's loop of layers
      row["ratio_decoder"] = harness.ratio(decoder, these, "steady_ms")
    row["loss_diff"] = harness.max_difference(these, base, "losses")
    row["losses"] = these[0]["losses"]
    rows.append(row)
  return rows


def show(rows, opts):
  print(f"\ndecoder and scan: hidden {opts.hidden_size}, intermediate {opts.intermediate_size}, "
        f"{opts.layers} layers, heads {opts.heads}/{opts.kv_heads}, batch {opts.batch}, "
        f"seq {opts.seq}, {opts.steps} steps; resnet: batch {opts.resnet_batch}, 224x224, "
        f"{opts.resnet_steps} steps; steady from step {WARMUP + 1}; medians [min-max] over rounds")
  seconds = lambda ms: f"{ms / 1e3:.1f}"  # noqa: E731
  print(harness.table(rows, [
      ("example", "example"), ("mode", "mode"), ("step 1 s", "first_ms", seconds),
      ("step 2 s", "second_ms", seconds), ("steady ms", "steady_ms", ".0f"),
      ("x unmod", "ratio", ".2f"), ("cpu x unmod", "cpu_ratio", ".2f"),
      ("loss diff", "loss_diff", ".1e")]))
  for r in rows:
    if "ratio_decoder" in r:
      print(f"scan {r['mode']} against the decoder example's unmodified loop: "
            "{:.2f} [{:.2f}-{:.2f}]".format(*r["ratio_decoder"]))


def main() -> None:
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
  cases = [(example, mode) for example in opts.examples for mode in EXAMPLES[example]["modes"]
           if not opts.modes or mode in opts.modes or mode == "unmodified"]
  with tempfile.TemporaryDirectory(prefix="bench_examples_") as work:
    results = harness.rounds(
        cases, opts.rounds,
        lambda example, mode: run(checkout, example, mode, opts, pathlib.Path(work)),
        describe=lambda r: f"first {r['first_ms'] / 1e3:.2f} s, steady {r['steady_ms']:.0f} ms",
        after=lambda results: write(opts, results, None))  # an interrupted run keeps its runs
  rows = summarize(results)
  show(rows, opts)
  write(opts, results, rows)


def write(opts, results, rows):
  harness.write_json(opts.json, {"config": {k: str(v) for k, v in vars(opts).items()},
                                 "runs": harness.in_order(results, "round"), "rows": rows,
                                 "load": os.getloadavg()})


if __name__ == "__main__":
  harness.main(main, child)
