"""The recipe's run directory under faults: a second run in the same `out` stops naming the one
that holds it, a killed holder's lock is taken over; a resume with another model is one config
error naming each differing key; a finished run is left as it is; retention keeps the newest N
checkpoints. (Damaged checkpoints: test_checkpoint.py.)"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest
import torch

from torch_xla_jaxbridge.recipes import checkpoint, config, rundir, train

ROOT = pathlib.Path(__file__).parents[1]
HOLD = ("import sys, time\nfrom torch_xla_jaxbridge.recipes import rundir\n"
        "with rundir.claim(sys.argv[1]):\n  print('held', flush=True)\n  time.sleep(300)\n")


def no_build(monkeypatch):
  monkeypatch.setattr(train, "prepare", lambda *a: pytest.fail("built a model"))


def snapshot(out):
  """Every file under `out` but the lock: name -> bytes."""
  return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
          if p.is_file() and p.name != rundir.LOCK}


def test_a_second_run_in_the_same_directory_stops_naming_the_running_one(tmp_path, monkeypatch,
                                                                        capsys):
  out = tmp_path / "run"
  out.mkdir()
  (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
  env = dict(os.environ, PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU")
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    no_build(monkeypatch)
    before = snapshot(out)
    assert train.main([f"out={out}", "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: out: {out} is in use by another run: pid {holder.pid} "
                          f"on host {socket.gethostname()} (started ")
    assert err.endswith("). Wait for it to finish or stop it, or give this run another out= "
                        "directory.\n") and err.count("\n") == 1
    assert snapshot(out) == before  # the refused run wrote nothing
  finally:
    holder.kill()
    holder.wait(60)
  assert holder.returncode == -signal.SIGKILL
  lines = []
  with rundir.claim(out, log=lines.append):  # the killed holder's record is left: taken over
    assert json.loads((out / rundir.LOCK).read_text())["pid"] == os.getpid()
  assert len(lines) == 1 and lines[0].startswith(
      f"{out / rundir.LOCK}: taking over the lock of pid {holder.pid} on host ")
  with pytest.raises(RuntimeError, match="boom"):
    with rundir.claim(out, log=lines.append):
      raise RuntimeError("boom")
  with rundir.claim(out, log=lines.append):  # released on the exception, with its record
    pass
  assert len(lines) == 1 and (out / rundir.LOCK).read_text() == ""


def saved_run(out, *overrides):
  """`out` as a run with `overrides` leaves it: a checkpoint at step 2 (a stand-in model: the
  checks under test read only its config), metrics and a summary."""
  cfg = config.load([f"out={out}", "train.steps=4", *overrides])
  model = torch.nn.Linear(2, 2)
  checkpoint.save(out / "checkpoints", 2, model, torch.optim.AdamW(model.parameters()),
                  run_config=config.resolved(cfg))  # as `train.train` saves it
  (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
  (out / "summary.json").write_text('{"last_loss": 4.0}')
  return out / "checkpoints" / "step_000002"


@pytest.mark.parametrize("saved, now, told", [
    ((), ["model.layers=2"], "model.layers saved 4, now 2"),
    ((), ["model.dim=128", "model.layers=2"], "model.dim saved 64, now 128; model.layers saved "
                                              "4, now 2"),
    ((), ["model.dtype=bfloat16", "model.heads=8", "model.kv_heads=4", "model.hidden=96",
          "model.vocab=512"],
     "model.dtype saved float32, now bfloat16; model.heads saved 4, now 8; model.hidden saved "
     "192, now 96; model.kv_heads saved 2, now 4; model.vocab saved 256, now 512"),
    ((), ["model=mixtral-tiny"], "model.experts saved 0, now 4; model.hidden saved 192, now 96; "
                                 "model.layers saved 4, now 2"),
    ((), ["train.optimizer=lion"], "train.optimizer saved adamw, now lion"),
    ((), ["remat.stack_layers=false"], "remat.stack_layers saved true, now false"),
], ids=["layers", "dim layers", "dtype heads kv_heads hidden vocab", "mixtral", "optimizer",
        "stack_layers"])
def test_resume_with_another_model_is_one_error_naming_each_key(tmp_path, monkeypatch, capsys,
                                                                saved, now, told):
  found = saved_run(tmp_path, *saved)
  before = snapshot(tmp_path)
  no_build(monkeypatch)
  assert train.main([f"out={tmp_path}", "train.steps=4", "resume=true", *now]) == 2
  again = " ".join(part.split(" saved ")[0] + "=" + part.split(" saved ")[1].split(",")[0]
                   for part in told.split("; "))
  assert capsys.readouterr().err == (
      f"config error: resume: {found} was saved with another configuration: {told}. Resume "
      f"with the saved values ({again}), or train this configuration in another out= "
      f"directory.\n")
  assert snapshot(tmp_path) == before


def test_a_run_resumes_in_its_own_layer_layout_under_the_default(tmp_path):
  tiny = [f"out={tmp_path}", "train.checkpoint_every=2", "model.layers=2", "train.batch=2",
          "train.seq=16", "train.log_every=1"]
  assert config.load(tiny)["remat"]["stack_layers"] == "auto"
  train.train(config.load([*tiny, "train.steps=2", "remat.stack_layers=false"]), log=print)
  lines = []
  losses = train.train(config.load([*tiny, "train.steps=4", "resume=true"]), log=lines.append)
  assert len(losses) == 2 and f"resumed from {tmp_path / 'checkpoints' / 'step_000002'} at " \
                              f"step 2" in lines
  newest = checkpoint.run_config(checkpoint.latest(tmp_path / "checkpoints"))
  assert newest["remat"]["stack_layers"] is False  # unrolled, as it was saved
  fresh = tmp_path / "fresh"
  train.train(config.load([*tiny, f"out={fresh}", "train.steps=2"]), log=print)
  assert checkpoint.run_config(fresh / "checkpoints" / "step_000002")["remat"][
      "stack_layers"] is True  # the default, decided


def test_a_checkpoint_saved_without_its_config_resumes_with_a_parameter_per_layer(tmp_path):
  """A checkpoint from before the run config was saved holds a parameter per layer (the default
  then): under `auto` it resumes so (stacked, its optimizer state raised an IndexError)."""
  tiny = [f"out={tmp_path}", "train.checkpoint_every=2", "model.layers=2", "train.batch=2",
          "train.seq=16"]
  full = train.train(config.load([*tiny, "train.steps=4", "remat.stack_layers=false",
                                  "train.checkpoint_every=0", f"out={tmp_path / 'full'}"]),
                     log=print)
  train.train(config.load([*tiny, "train.steps=2", "remat.stack_layers=false"]), log=print)
  saved = tmp_path / "checkpoints" / "step_000002"
  for name in ("config.json", "checksums.json"):  # as an older version saved it
    (saved / name).unlink()
  assert train.train(config.load([*tiny, "train.steps=4", "resume=true"]), log=print) == \
      pytest.approx(full[2:], rel=1e-6)


def test_what_does_not_change_the_state_resumes():
  saved = config.load()
  assert rundir.differences(saved, config.load([
      "train.optimizer=torch-adamw", "remat.bridge=layers",  # the same state layout (AdamW's)
      "model.attention=flash", "train.steps=400", "train.lr=0.1", "mesh.fsdp=1",
      "remat.policy=full", "train.batch=4"])) == []
  del saved["model"]["experts"]  # a key an older recipe did not save: not compared
  assert rundir.differences(saved, config.load(["model=mixtral-tiny"])) == [
      ("model.hidden", 192, 96), ("model.layers", 4, 2)]


def test_retention_keeps_the_newest_and_a_finished_run_is_left_as_it_is(tmp_path, monkeypatch):
  tiny = [f"out={tmp_path}", "train.checkpoint_every=1", "train.keep_checkpoints=2",
          "model.layers=1", "train.batch=2", "train.seq=16", "train.log_every=1"]
  listings, prune = [], checkpoint.prune

  def spy(root, keep, newest):  # the directory when older checkpoints are about to go
    listings.append(sorted(p.name for p in root.iterdir()))
    return prune(root, keep, newest)

  monkeypatch.setattr(checkpoint, "prune", spy)
  losses = train.train(config.load([*tiny, "train.steps=4"]), log=lambda line: None)
  assert len(losses) == 4
  assert listings == [["step_000001"], ["step_000001", "step_000002"],
                      ["step_000001", "step_000002", "step_000003"],
                      ["step_000002", "step_000003", "step_000004"]]  # the new one committed
  kept = sorted((tmp_path / "checkpoints").iterdir())
  assert [p.name for p in kept] == ["step_000003", "step_000004"]
  assert all(checkpoint.torn(p) is None and checkpoint.run_config(p)["model"]["layers"] == 1
             for p in kept)
  before, lines = snapshot(tmp_path), []
  no_build(monkeypatch)
  assert train.train(config.load([*tiny, "train.steps=4", "resume=true"]), log=lines.append) == []
  assert lines == [f"{tmp_path / 'checkpoints'}: the run is complete: its newest checkpoint "
                   f"step_000004 is at step 4 (train.steps=4); summary.json and metrics.jsonl "
                   f"are left as they are. To train further, raise train.steps."]
  assert snapshot(tmp_path) == before
  assert json.loads((tmp_path / "summary.json").read_text())["last_loss"] == losses[-1]
