"""Checkpoints that survive crashes and mesh changes.

A checkpoint is a `torch.distributed.checkpoint` (DCP) directory written with torch_xla's SPMD
planners: each sharded tensor is written shard by shard from the devices that hold it (no gather
of the whole model on one host) and read back into whatever layout the loading model has, so a
run saved on a `(4, 1)` mesh resumes on `(2, 2)` or on one device. It holds the model, the
optimizer's `state_dict()`, the step (the recipe's data position: batch `i` depends only on seed
and `i`) and the torch and torch_xla random states.

A save writes `root/step_000006.partial/` and renames it to `root/step_000006/` when every file
is on disk: a crash leaves a `.partial` directory, never a directory that looks complete. Before
the rename it writes the run's config (`config.json`, when given) and `checksums.json`: a CRC32
of every file. `latest` checks each candidate's files against its metadata (a truncated or
missing file) and against its checksums (a changed byte), and skips torn ones with a
`TornCheckpointWarning` naming them. `prune` keeps the newest N.

One process drives all devices of the host (torch_xla SPMD); saving from several processes
(multi-host) would need a barrier before the rename and is refused.
"""
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge.recipes import checksums

PAUSE_ENV = "JAXBRIDGE_CHECKPOINT_TEST_PAUSE"
_NAME = re.compile(r"step_(\d+)(\.partial)?$")
RUN_CONFIG = "config.json"  # the resolved config of the run that saved the checkpoint
# DCP and torch_xla's planners warn on every single-process save or load, about their own code
_NOISE = ("torch.distributed is disabled", "The function definition for SavePlanner",
          "TypedStorage is deprecated", "Using a non-tuple sequence for multidimensional indexing")


class TornCheckpointWarning(UserWarning):
  """A checkpoint directory skipped because a save did not finish or its files are damaged."""


def save(root: str | os.PathLike, step: int, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, run_config: dict | None = None,
         checksum: str | None = "crc32") -> pathlib.Path:
  """Writes `root/step_<step>` (model, optimizer, step, random states) atomically; returns it.

  Before the commit rename it writes `run_config` (when given) as `config.json` and, unless
  `checksum` is None, `checksums.json`: the `checksum` ("crc32", or a `hashlib` name such as
  "sha256") of every file, which `latest` verifies.

  Example:
    >>> import tempfile
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> path = save(tempfile.mkdtemp(), 3, model, optimizer, run_config={"seed": 0})
    >>> path.name, sorted(p.name for p in path.iterdir())
    ('step_000003', ['.metadata', '__0_0.distcp', 'checksums.json', 'config.json'])
  """
  _refuse_multiple_processes()
  root = pathlib.Path(root)
  final = root / f"step_{step:06d}"
  partial = final.with_name(final.name + ".partial")
  shutil.rmtree(partial, ignore_errors=True)  # an earlier crash's leftover of the same step
  torch_xla.sync(wait=True)  # the planners read each shard's device data: none may be in flight
  state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
           "rng": _rng_state()}
  with _quiet():
    dcp.save(state, storage_writer=_Writer(partial, step), planner=_SavePlanner(),
             no_dist=True)
  if run_config is not None:
    checksums.write_durably(partial / RUN_CONFIG, json.dumps(run_config, indent=2))
  if checksum is not None:
    checksums.write(partial, checksum)
  _fsync_directory(partial)
  if final.exists():  # an earlier save of this step: a torn one, or an earlier run's
    shutil.rmtree(final)
  os.rename(partial, final)
  _fsync_directory(root)
  return final


def run_config(path: str | os.PathLike) -> dict | None:
  """The config saved with checkpoint `path` (`save(run_config=...)`), or None without one.

  Example:
    >>> import tempfile
    >>> run_config(tempfile.mkdtemp()) is None
    True
  """
  file = pathlib.Path(path) / RUN_CONFIG
  return json.loads(file.read_text()) if file.is_file() else None


def step_of(path: str | os.PathLike) -> int:
  """The step of checkpoint directory `path` (from its name).

  Example:
    >>> step_of("out/checkpoints/step_000150")
    150
  """
  match = _NAME.match(pathlib.Path(path).name)
  assert match is not None, path  # a name `checkpoint_names` gave
  return int(match.group(1))


def latest(root: str | os.PathLike) -> pathlib.Path | None:
  """The newest complete checkpoint directory under `root` (None: there is none); newer torn
  ones (unfinished, truncated, or not matching their checksums) are skipped with a
  `TornCheckpointWarning` naming each.

  Example:
    >>> import tempfile
    >>> latest(tempfile.mkdtemp()) is None
    True
  """
  for _, named_complete, path in _candidates(root):
    reason = torn(path) if named_complete else "a save that did not finish (killed while saving)"
    if reason is None:
      return path
    warnings.warn(f"skipping torn checkpoint {path}: {reason}. Resuming from an older one; "
                  f"delete {path} once you no longer need it.", TornCheckpointWarning,
                  stacklevel=2)
  return None


def prune(root: str | os.PathLike, keep: int, newest: int) -> list[pathlib.Path]:
  """Deletes the complete checkpoints under `root` older than the `keep` newest complete ones of
  steps up to `newest` (the one just saved); returns their paths. Torn ones and newer ones (an
  earlier run's) are left alone. "Complete" is checked without checksums (metadata and sizes:
  no data is read). A deletion is a rename to `step_N.deleting` (which `latest` ignores) then a
  removal; leftovers of a crash in between are removed by the next call.

  Example:
    >>> import tempfile
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> root = tempfile.mkdtemp()
    >>> for step in (1, 2, 3):
    ...   _ = save(root, step, model, optimizer)
    >>> [p.name for p in prune(root, 2, 3)], sorted(p.name for p in pathlib.Path(root).iterdir())
    (['step_000001'], ['step_000002', 'step_000003'])
  """
  root = pathlib.Path(root)
  for leftover in root.glob("step_*.deleting"):
    shutil.rmtree(leftover, ignore_errors=True)
  complete = [path for step, named_complete, path in _candidates(root)
              if named_complete and step <= newest and torn(path, verify=False) is None]
  for path in complete[keep:]:
    doomed = path.with_name(path.name + ".deleting")
    os.rename(path, doomed)
    shutil.rmtree(doomed)
  return complete[keep:]


def _candidates(root):
  """(step, named complete (not .partial), path) of the checkpoint directories under `root`,
  newest first."""
  found = [(int(m.group(1)), m.group(2) is None, p) for p in pathlib.Path(root).glob("step_*")
           if (m := _NAME.match(p.name)) and p.is_dir()]
  return sorted(found, reverse=True)


def torn(path: str | os.PathLike, verify: bool = True) -> str | None:
  """Why checkpoint directory `path` cannot be loaded (no or unreadable metadata, a data file
  missing or shorter than the metadata says; with `verify`, a file that does not match its
  checksum), or None when it is complete. A directory without `checksums.json` (saved before
  checksums, or with `checksum=None`) is not verified.

  Example:
    >>> import tempfile
    >>> torn(tempfile.mkdtemp())
    'no .metadata file (the save did not finish)'
  """
  path = pathlib.Path(path)
  if not (path / ".metadata").is_file():
    return "no .metadata file (the save did not finish)"
  try:
    metadata = dcp.FileSystemReader(path).read_metadata()
  except Exception as e:  # a damaged pickle raises any of several types
    return f"unreadable .metadata ({type(e).__name__}: {e})"
  needed: dict = {}
  for info in metadata.storage_data.values():
    end = info.offset + info.length
    needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
  for name, size in sorted(needed.items()):
    file = path / name
    if not file.is_file():
      return f"data file {name} is missing"
    if file.stat().st_size < size:
      return f"data file {name} is truncated ({file.stat().st_size} of {size} bytes)"
  return checksums.mismatch(path) if verify else None


def load(path, model, optimizer):
  """Loads checkpoint `path` into `model` and `optimizer` in their current layout (device,
  sharding; the mesh may differ from the saving run's), restores the random states, and
  returns the checkpoint's step.

  Example:
    >>> import tempfile
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> path = save(tempfile.mkdtemp(), 3, model, optimizer)
    >>> load(path, model, optimizer)
    3
  """
  _refuse_multiple_processes()
  reader = dcp.FileSystemReader(path)
  metadata = reader.read_metadata()
  state = {"model": model.state_dict(), "optimizer": _optimizer_template(optimizer, metadata),
           "step": -1, "rng": _rng_state()}
  with _quiet():
    dcp.load(state, storage_reader=reader, planner=SPMDLoadPlanner(), no_dist=True)
  model.load_state_dict(state["model"])  # also where state_dict() gave copies (StackedLayers)
  optimizer.load_state_dict(state["optimizer"])
  torch.set_rng_state(state["rng"]["torch"])
  xm.set_rng_state(state["rng"]["xla"])
  return state["step"]


def _optimizer_template(optimizer, metadata):
  """`optimizer.state_dict()` with a tensor for each saved state entry for DCP to load into: on
  the device and sharded as its parameter when it has the parameter's shape (moments), else on
  the CPU (AdamW's `step`; `optimizer.load_state_dict` moves what its optimizer wants moved)."""
  template = optimizer.state_dict()
  params = [p for group in optimizer.param_groups for p in group["params"]]
  shardings = jb.spmd.shardings_of(params) or [None] * len(params)
  state: dict = {}
  for key, saved in metadata.state_dict_metadata.items():
    parts = key.split(".")
    if parts[:2] != ["optimizer", "state"]:
      continue
    index, name = int(parts[2]), ".".join(parts[3:])
    value = None  # a non-tensor entry: DCP replaces it with the saved value
    if isinstance(saved, TensorStorageMetadata):
      param, size = params[index], tuple(saved.size)
      if size and size == tuple(param.shape):
        value = torch.zeros(size, dtype=saved.properties.dtype, device=param.device)
        jb.spmd.shard_like([value], [shardings[index]])
      else:
        value = torch.zeros(size, dtype=saved.properties.dtype)
    state.setdefault(index, {})[name] = value
  template["state"] = state
  return template


def _rng_state():
  return {"torch": torch.get_rng_state(), "xla": xm.get_rng_state()}


class _SavePlanner(SPMDSavePlanner):
  """torch_xla's SPMD save planner with each chunk planned once.

  A partially replicated tensor (a norm weight sharded over `fsdp`, replicated over `tensor`)
  has several local shards with the same offsets; torch_xla 2.9's global dedup takes the second
  one for a duplicate held by another process and drops every copy: the tensor silently missing
  from the checkpoint. One write item per chunk (the first replica) avoids that."""

  def create_local_plan(self):
    plan = super().create_local_plan()
    seen, items = set(), []
    for item in plan.items:  # MetadataIndex compares (fqn, offset), not the shard number
      if item.index not in seen:
        seen.add(item.index)
        items.append(item)
    return dataclasses.replace(plan, items=items)


class _Writer(dcp.FileSystemWriter):
  """DCP's file writer with the test hook between the shards and the metadata.

  `per_thread_copy_ahead=0`: DCP's overlapping device-to-host loader asks torch's custom device
  module (torchax's) for a stream, which it does not have; the serial loader is used instead."""

  def __init__(self, path, step):
    super().__init__(path, per_thread_copy_ahead=0)
    self.step = step

  def finish(self, metadata, results):
    _pause_for_test(self.step, self.path)
    super().finish(metadata, results)


def _pause_for_test(step, path):
  """With `JAXBRIDGE_CHECKPOINT_TEST_PAUSE=<step>:<file>`, the save of `step` stops after its
  shards are written and before its metadata: it creates `<file>` and waits to be killed."""
  wanted = os.environ.get(PAUSE_ENV, "")
  if wanted.split(":", 1)[0] != str(step):
    return
  pathlib.Path(wanted.split(":", 1)[1]).write_text(str(path))
  time.sleep(600)
  raise RuntimeError(f"{PAUSE_ENV} paused the save of step {step} and nothing killed it.")


@contextlib.contextmanager
def _quiet():
  with warnings.catch_warnings():
    for message in _NOISE:
      warnings.filterwarnings("ignore", message=message)
    yield


def _fsync_directory(path):
  """Makes a rename in `path` durable (POSIX: the directory entry is data of the directory)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _refuse_multiple_processes():
  if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
    raise errors.BridgeError(
        f"recipes.checkpoint saves and loads from one process (torch_xla SPMD drives every device "
        f"of a host from one); this run has {dist.get_world_size()} processes. Multi-host "
        f"checkpoints need a barrier before the commit rename: not supported.")
