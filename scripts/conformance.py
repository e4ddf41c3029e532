"""Upstream pytorch/xla's tests of scan, scan_layers, assume_pure and gradient checkpointing, run
with upstream's names and with this package's: passes per file, ours against upstream.

Each test file is copied from the checkout into a temporary folder twice: as it is, and with only
its import lines rewritten so that `torch_xla.experimental.scan`, `.scan_layers`, `.assume_pure`
and `torch_xla.utils.checkpoint` name small modules written next to it (`jb_names/`) that hold
this package's functions under upstream's names. Nothing of upstream's is kept in this
repository. Each copy runs in its own process (pytest; `test_grad_checkpoint.py`, a script, as a
script: one test, passed when it exits cleanly); the SPMD files on 4 virtual CPU devices. Tests
that read upstream's private caches, helpers or internal error texts are left out of both runs
(`EXCLUDED`, with the reason). Prints a table and writes JSON (default out/conformance.json).

  python scripts/conformance.py PATH_TO_PYTORCH_XLA_CHECKOUT [--only test_scan.py ...] [--json P]
"""
import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

import harness

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (file in the checkout, runs on 4 devices)
FILES = [("test/scan/test_scan.py", False), ("test/scan/test_scan_layers.py", False),
         ("test/test_assume_pure.py", False), ("test/test_assume_pure_torch.py", False),
         ("test/scan/test_scan_spmd.py", True), ("test/test_assume_pure_spmd.py", True),
         ("test/test_grad_checkpoint.py", False)]

# upstream module -> the module of jb_names/ holding our functions under its names
RENAMES = {"torch_xla.experimental.scan_layers": "jb_names.scan_layers",
           "torch_xla.experimental.scan": "jb_names.scan",
           "torch_xla.experimental.assume_pure": "jb_names.assume_pure",
           "torch_xla.utils.checkpoint": "jb_names.checkpoint"}

_PRIVATE = ("clears or reads upstream's private cache {} (its contents are upstream's "
            "implementation; this package's traces are cached by signature)")
EXCLUDED = {
    "test_scan.py": {
        "test_scan_computation_cache": _PRIVATE.format("scan._SCAN_COMPUTATION_CACHE"),
        "test_tree_flatten_none": "tests upstream's private helper scan.tree_flatten_none",
        "test_transform_": "tests upstream's private AOTAutograd helper "
                           "scan.value_and_grad_partitioned",
        "test_scan_external_in_place_mutation": (
            "expects upstream's internal error (an AssertionError from AOTAutograd's FakeTensor "
            "check, text 'FakeTensor'); this package refuses the same code with "
            "errors.InPlaceInputError, a RuntimeError naming the tensor (test_scan_fn.py)"),
    },
    "test_scan_layers.py": {
        "test_scan_layers_cache": _PRIVATE.format("scan_layers._ONE_LAYER_CACHE"),
    },
    "test_assume_pure.py": {
        "test_assume_pure_avoid_retracing_avoid_rejit": _PRIVATE.format(
            "xla_builder._JAX_TO_XLA_COMPUTATION_CACHE"),
    },
}

# jb_names/: this package's functions under upstream's names. A private cache that upstream's
# tests clear in setUp() is an object whose clear() clears this package's trace cache.
SHIMS = {
    "__init__.py": "",
    "_common.py": '''
import torch_xla_jaxbridge as jb


class ClearsCache:
  """Upstream's private cache, cleared by its tests' setUp: clears this package's cache."""

  def clear(self):
    jb.clear_cache()


def upstream_only(name):
  def missing(*args, **kwargs):
    raise NotImplementedError(f"{name} is upstream's private helper; its test is excluded")
  return missing
''',
    "scan.py": '''
import torch_xla_jaxbridge as jb
from jb_names._common import ClearsCache, upstream_only

scan = jb.scan
_SCAN_COMPUTATION_CACHE = ClearsCache()
value_and_grad_partitioned = upstream_only("value_and_grad_partitioned")
tree_flatten_none = upstream_only("tree_flatten_none")
''',
    "scan_layers.py": '''
import torch_xla_jaxbridge as jb
from jb_names._common import ClearsCache

scan_layers = jb.scan_layers
_ONE_LAYER_CACHE = ClearsCache()
''',
    "assume_pure.py": '''
import torch_xla_jaxbridge as jb
from jb_names._common import ClearsCache

assume_pure = jb.assume_pure
PureModule = jb.PureModule
_XLA_COMPUTATION_CACHE = ClearsCache()


def assume_pure_torch(func, use_cache=False):
  """Upstream's forward-only variant: jb.assume_pure with its use_cache."""
  return jb.assume_pure(func, use_cache=use_cache)
''',
    "checkpoint.py": '''
import torch_xla_jaxbridge as jb

checkpoint = jb.checkpoint
''',
}


def rewrite_imports(source):
  """`source` with upstream's module names replaced by jb_names' in its import lines only."""
  pattern = re.compile("|".join(re.escape(name) for name in RENAMES) + r"\b")
  lines = []
  for line in source.splitlines(keepends=True):
    if re.match(r"\s*(import|from)\s", line):
      line = pattern.sub(lambda m: RENAMES[m.group(0)], line)
    lines.append(line)
  return "".join(lines)


def run_file(checkout, rel, spmd, names, work, timeout):
  """Runs one copy of the test file; returns {passed, total, failed, seconds, log}."""
  source = (checkout / rel).read_text()
  if names == "ours":
    source = rewrite_imports(source)
  folder = work / names / pathlib.Path(rel).parent
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / pathlib.Path(rel).name
  path.write_text(source)
  env = dict(os.environ, PJRT_DEVICE="CPU",
             PYTHONPATH=os.pathsep.join([str(ROOT), str(work / "names"), str(checkout / "test"),
                                         str(checkout / "examples")]))
  if spmd:
    env.update(CPU_NUM_DEVICES="4", XLA_FLAGS=(env.get("XLA_FLAGS", "") +
                                               " --xla_force_host_platform_device_count=4"))
  report = path.with_suffix(".xml")
  if path.name == "test_grad_checkpoint.py":  # a script, not a test module
    command = [sys.executable, str(path)]
  else:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path),
               f"--junitxml={report}", "--rootdir", str(folder)]
    excluded = EXCLUDED.get(path.name, {})
    if excluded:
      command += ["-k", " and ".join(f"not {name}" for name in excluded)]
  start = time.time()
  try:
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True,
                          timeout=timeout)
    code, log = done.returncode, done.stdout + done.stderr
  except subprocess.TimeoutExpired as e:
    code, log = None, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
  seconds = round(time.time() - start, 1)
  if path.name == "test_grad_checkpoint.py":
    return {"passed": int(code == 0), "total": 1, "failed": [] if code == 0 else ["run"],
            "seconds": seconds, "log": log[-3000:]}
  passed, total, failed = 0, 0, []
  if report.exists():
    for case in ElementTree.parse(report).iter("testcase"):
      total += 1
      outcome = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
      if not outcome:
        passed += 1
      elif outcome[0] != "skipped":
        failed.append(case.get("name"))
  return {"passed": passed, "total": total, "failed": failed, "seconds": seconds,
          "log": log[-3000:]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("checkout", type=pathlib.Path, help="a pytorch/xla source checkout")
  parser.add_argument("--only", nargs="+", help="file names to run (default: all)")
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
  parser.add_argument("--json", default=str(ROOT / "scripts" / "out" / "conformance.json"))
  opts = parser.parse_args()
  checkout = opts.checkout.resolve()
  needed = [rel for rel, _ in FILES] + ["test/test_utils.py", "examples/decoder_only_model.py"]
  missing = [rel for rel in needed if not (checkout / rel).exists()]
  if missing:
    sys.exit(f"conformance: {checkout} lacks {missing}; give the root of a pytorch/xla checkout "
             f"(the one matching the installed torch_xla).")
  rows = []
  with tempfile.TemporaryDirectory(prefix="conformance_") as tmp:
    work = pathlib.Path(tmp)
    for name, text in SHIMS.items():
      (work / "names" / "jb_names").mkdir(parents=True, exist_ok=True)
      (work / "names" / "jb_names" / name).write_text(text.lstrip())
    for rel, spmd in FILES:
      if opts.only and pathlib.Path(rel).name not in opts.only:
        continue
      row = {"file": rel, "spmd": spmd,
             "excluded": EXCLUDED.get(pathlib.Path(rel).name, {})}
      for names in ("upstream", "ours"):
        row[names] = run_file(checkout, rel, spmd, names, work, opts.timeout)
        print(f"{rel} {names}: {row[names]['passed']}/{row[names]['total']} passed "
              f"({row[names]['seconds']} s) failed: {row[names]['failed']}", flush=True)
      rows.append(row)
      harness.write_json(opts.json, rows)  # after each file: a long run keeps what it measured
  print(f"\n{'file':<34}{'upstream':>10}{'ours':>10}  ours failed where upstream passed")
  for row in rows:
    up, ours = row["upstream"], row["ours"]
    regressions = sorted(set(ours["failed"]) - set(up["failed"]))
    print(f"{row['file']:<34}{up['passed']:>5}/{up['total']:<4}{ours['passed']:>5}/"
          f"{ours['total']:<4}  {', '.join(regressions) or '-'}")
  for row in rows:
    for name, reason in row["excluded"].items():
      print(f"excluded {pathlib.Path(row['file']).name}::{name}*: {reason}")
  print(f"wrote {opts.json}")


if __name__ == "__main__":
  main()
