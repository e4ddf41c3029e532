"""Recipe checkpoints: exact restore of model, optimizer and random state; torn checkpoints
skipped with a warning naming them; a training process killed while saving resumes on the same
loss curve. A checkpoint saved on one mesh resuming on another and on one device is in test_spmd.py
(it reads the 4-device run's facts, which that test group starts anyway)."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch_xla

from torch_xla_jaxbridge.recipes import checkpoint, checksums, config, train

ROOT = pathlib.Path(__file__).parents[1]


def make(seed, dev):
  torch.manual_seed(seed)
  model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
  model = model.to(dev)
  return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def step(model, optimizer, x):
  model(x).pow(2).mean().backward()
  optimizer.step()
  optimizer.zero_grad()
  torch_xla.sync()


def cpu_state(module_or_optimizer):
  return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu().clone(),
                                           module_or_optimizer.state_dict())


def assert_same(a, b):
  flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
  flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
  assert spec_a == spec_b
  for x, y in zip(flat_a, flat_b):
    assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_load_restores_model_optimizer_and_random_state(tmp_path, dev):
  x = torch.randn(4, 6).to(dev)
  model, optimizer = make(0, dev)
  step(model, optimizer, x)
  step(model, optimizer, x)
  path = checkpoint.save(tmp_path, 2, model, optimizer)
  saved_model, saved_optimizer = cpu_state(model), cpu_state(optimizer)
  draws = torch.rand(3), torch.rand(3, device=dev).cpu()
  step(model, optimizer, x)
  model_, optimizer_ = make(1, dev)  # another init, no optimizer state yet
  assert checkpoint.load(path, model_, optimizer_) == 2
  assert_same(cpu_state(model_), saved_model)
  assert_same(cpu_state(optimizer_), saved_optimizer)
  state = optimizer_.state[next(iter(model_.parameters()))]
  assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "xla"
  assert torch.equal(torch.rand(3), draws[0])
  assert torch.equal(torch.rand(3, device=dev).cpu(), draws[1])
  step(model_, optimizer_, x)
  assert_same(cpu_state(model_), cpu_state(model))


def damage_data(path):
  data = next(path.glob("*.distcp"))
  data.write_bytes(data.read_bytes()[:100])
  return f"data file {data.name} is truncated (100 of "


def remove_data(path):
  data = next(path.glob("*.distcp"))
  data.unlink()
  return f"data file {data.name} is missing"


def damage_metadata(path):
  metadata = path / ".metadata"
  metadata.write_bytes(metadata.read_bytes()[:50])
  return "unreadable .metadata ("


def remove_metadata(path):
  (path / ".metadata").unlink()
  return "no .metadata file (the save did not finish)"


def damage_checksums(path):
  record = path / "checksums.json"
  record.write_bytes(record.read_bytes()[:20])
  return "unreadable checksums.json (JSONDecodeError"


def change_metadata(path):
  """One byte of `.metadata` changed where the pickle still loads: only the checksum sees it."""
  metadata = path / ".metadata"
  raw = bytearray(metadata.read_bytes())
  at = raw.index(b"model.0.weight") + len("model.0.weigh")  # a key: 'model.0.weighu'
  raw[at] += 1
  metadata.write_bytes(bytes(raw))
  assert checkpoint.torn(path, verify=False) is None  # sizes and structure look complete
  return "file .metadata does not match its crc32 checksum (saved "


@pytest.mark.parametrize("damage", [damage_data, remove_data, damage_metadata, remove_metadata,
                                    damage_checksums, change_metadata])
def test_torn_checkpoints_are_skipped_with_a_warning_naming_them(tmp_path, dev, damage):
  x = torch.randn(4, 6).to(dev)
  model, optimizer = make(0, dev)
  step(model, optimizer, x)
  checkpoint.save(tmp_path, 1, model, optimizer)
  at_one = cpu_state(model)
  step(model, optimizer, x)
  reason = damage(checkpoint.save(tmp_path, 2, model, optimizer))
  (tmp_path / "step_000003.partial").mkdir()  # killed while saving step 3
  with pytest.warns(checkpoint.TornCheckpointWarning) as caught:
    found = checkpoint.latest(tmp_path)
  assert found == tmp_path / "step_000001"
  messages = [str(w.message) for w in caught]
  assert len(messages) == 2
  assert messages[0].startswith(f"skipping torn checkpoint {tmp_path / 'step_000003.partial'}: "
                                f"a save that did not finish")
  assert messages[1].startswith(f"skipping torn checkpoint {tmp_path / 'step_000002'}: {reason}")
  model_, optimizer_ = make(1, dev)
  assert checkpoint.load(found, model_, optimizer_) == 1
  assert_same(cpu_state(model_), at_one)
  checkpoint.save(tmp_path, 2, model, optimizer)  # a new save of the torn step replaces it
  with pytest.warns(checkpoint.TornCheckpointWarning, match="step_000003.partial"):
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000002"


def flip_exponent_bit(path, weight):
  """Flips the top exponent bit of `weight[0, 0]` (float32) in the data file of checkpoint
  `path`, found by its row's bytes; returns the data file."""
  data = next(path.glob("*.distcp"))
  raw, row = bytearray(data.read_bytes()), weight[0].numpy().tobytes()
  assert raw.count(row) == 1
  raw[raw.index(row) + 3] ^= 0x40  # little-endian: byte 3 holds the sign and exponent bits 7-1
  data.write_bytes(bytes(raw))
  return data


def test_a_flipped_bit_in_a_weight_is_found_and_the_previous_checkpoint_loads(tmp_path, dev):
  x = torch.randn(4, 6).to(dev)
  model, optimizer = make(0, dev)
  step(model, optimizer, x)
  checkpoint.save(tmp_path, 1, model, optimizer)
  at_one, optimizer_at_one = cpu_state(model), cpu_state(optimizer)
  step(model, optimizer, x)
  newest = checkpoint.save(tmp_path, 2, model, optimizer)
  weight = cpu_state(model)["0.weight"]
  data = flip_exponent_bit(newest, weight)
  assert checkpoint.torn(newest, verify=False) is None  # sizes and metadata cannot see it
  model_, optimizer_ = make(1, dev)
  checkpoint.load(newest, model_, optimizer_)  # loaded unverified: garbage, without a word
  assert abs(cpu_state(model_)["0.weight"][0, 0]) > 1e30 > abs(weight[0, 0]) * 1e20
  with pytest.warns(checkpoint.TornCheckpointWarning) as caught:
    found = checkpoint.latest(tmp_path)
  assert found == tmp_path / "step_000001"
  assert [str(w.message) for w in caught] == [
      f"skipping torn checkpoint {newest}: file {data.name} does not match its crc32 checksum "
      f"(saved {json.loads((newest / 'checksums.json').read_text())['files'][data.name]['digest']}"
      f", {data.stat().st_size} bytes; now {checksums.digest(data)}, "
      f"{data.stat().st_size} bytes): its bytes changed after the save (disk, copy or transfer "
      f"damage). Resuming from an older one; delete {newest} once you no longer need it."]
  model_, optimizer_ = make(1, dev)
  assert checkpoint.load(found, model_, optimizer_) == 1
  assert_same(cpu_state(model_), at_one)
  assert_same(cpu_state(optimizer_), optimizer_at_one)


def test_prune_keeps_the_newest_complete_and_leaves_torn_and_newer_ones(tmp_path, dev):
  model, optimizer = make(0, dev)
  for n in (1, 2, 3, 4, 9):  # step 9: an earlier run's, in the same directory
    checkpoint.save(tmp_path, n, model, optimizer)
  damage_data(tmp_path / "step_000003")
  (tmp_path / "step_000000.deleting").mkdir()  # a deletion a crash interrupted
  deleted = checkpoint.prune(tmp_path, 2, 4)
  assert deleted == [tmp_path / "step_000001"]  # kept: 4 and 2 (3 is torn, 9 is not this run's)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003",
                                                         "step_000004", "step_000009"]


def metrics_losses(out):
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [row["step"] for row in rows], [row["loss"] for row in rows]


@pytest.mark.slow  # a run killed and resumed: about a minute on 2 cores
def test_killed_while_saving_resumes_from_the_last_complete_checkpoint(tmp_path, recipe_run):
  """The proof of item 5: SIGKILL after step 3's shards are on disk, before its metadata."""
  out, signal_file = tmp_path / "run", tmp_path / "saving"
  overrides = ["train.steps=3", "train.checkpoint_every=1", f"out={out}"]
  env = dict(os.environ, PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU",
             **{checkpoint.PAUSE_ENV: f"3:{signal_file}"})
  with open(tmp_path / "stderr.txt", "w") as stderr:
    process = subprocess.Popen([sys.executable, "-m", "torch_xla_jaxbridge.recipes.train",
                                *overrides], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
  try:
    while not signal_file.exists():
      assert process.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
      time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(60) == -signal.SIGKILL
  finally:
    if process.poll() is None:
      process.kill()
  partial = out / "checkpoints" / "step_000003.partial"
  assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()
  lines = []
  with pytest.warns(checkpoint.TornCheckpointWarning, match=f"torn checkpoint {partial}: a save "
                                                            f"that did not finish"):
    resumed = train.train(config.load([*overrides, "resume=true"]), log=lines.append)
  # the killed run's lock record is left; the kernel released its flock, so the lock is taken over
  assert lines[0].startswith(f"{out / 'run.lock'}: taking over the lock of pid {process.pid} on "
                             f"host ") and lines[0].endswith(", which ended without releasing it "
                                                             "(killed?)")
  assert lines[1] == f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2"
  uninterrupted = recipe_run()[0]  # the same 3 steps, never saved, in this process
  steps, losses = metrics_losses(out)
  assert steps == [1, 2, 3] and len(resumed) == 1
  assert losses == pytest.approx(uninterrupted, rel=1e-6)
  assert checkpoint.latest(out / "checkpoints") == out / "checkpoints" / "step_000003"
  assert not partial.exists()
