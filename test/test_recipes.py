"""Recipes: config loading and errors, losses of every wrapping against plain LazyTensor, resume."""
import json
import re
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge.recipes import config, data, llama, train


def quiet(line):
  pass


def test_defaults_model_file_and_overrides():
  cfg = config.load(["model=mixtral-8x7b", "model.layers=2", "train.lr=1", "remat.save=query_proj",
                     "remat.policy=dots", "remat.scan_layers=true"])
  assert cfg["model"]["name"] == "mixtral-8x7b" and cfg["model"]["experts"] == 8
  assert cfg["model"]["layers"] == 2 and cfg["train"]["lr"] == 1.0
  assert cfg["remat"]["save"] == ["query_proj"] and cfg["remat"]["scan_layers"] is True
  assert config.remat_setting(cfg) == train.jb.Remat(save=("query_proj",), policy="dots")
  assert config.load()["model"]["name"] == "llama-tiny"


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", r"train.stepz: unknown key 'stepz' in train; valid keys: batch, "
                      r"checkpoint_every, data, keep_checkpoints, log_every, lr, master_weights, "
                      r"max_grad_norm, optimizer, optimizer_args, schedule, seed, seq, steps, "
                      r"sync_each_step, warmup_steps, weight_decay"),
    ("train.optimizer=adam", r"train.optimizer: 'adam' is not valid; choose one of "
                             + re.escape(", ".join(config.optimizer_choices()) + ".")),
    ("train.schedule=step", r"train.schedule: 'step' is not valid; choose one of constant, cosine"),
    ("train.warmup_steps=-1", r"train.warmup_steps: must be between 0 and train.steps \(200\), "
                              r"got -1"),
    ("train.warmup_steps=201", r"train.warmup_steps: must be between 0 and train.steps \(200\)"),
    ("train.max_grad_norm=-1", r"train.max_grad_norm: must be > 0 \(or null or 0: no clipping\)"),
    ("trian.steps=3", r"trian.steps: unknown key 'trian' in the top level; valid keys: mesh, "
                      r"model, out, remat, resume, train"),
    ("train.steps=many", r"train.steps: expected int \(like 200\), got str 'many'"),
    ("remat.scan_layers=1", r"remat.scan_layers: expected bool"),
    ("remat.policy=minimum", r"remat.policy: 'minimum' is not valid; choose one of "
                             + re.escape(", ".join(jb.remat.presets()) + ".")),
    ("remat.save=[query_proj,attn_scores]", r"remat.save: 'attn_scores' is not valid; choose one "
                                            r"of decoder_layer_input, query_proj, key_proj"),
    ("model=gpt-5", r"model: unknown model 'gpt-5'; choose one of "
                    + re.escape(", ".join(config.model_choices()) + ".")),
    ("mesh.fsdp=4", r"mesh.fsdp \* mesh.tensor = 4 \* 1 = 4 devices, but this process sees 1\. "
                    r"Make the product equal the device count \(on CPU, start the process with "
                    r"CPU_NUM_DEVICES=4"),
    ("mesh.tensor=0", r"mesh.tensor: must be at least 1, got 0"),
    ("steps", r"override 'steps': expected key=value"),
])
def test_bad_config_names_the_key_and_the_choices(override, message):
  with pytest.raises(config.ConfigError, match=message):
    config.load([override])


def test_scan_and_stack_together_is_a_config_error():
  with pytest.raises(config.ConfigError, match="remat.scan_layers and remat.stack_layers are both "
                                               "true; pick one"):
    config.load(["remat.scan_layers=true", "remat.stack_layers=true"])


def test_stack_layers_takes_true_false_or_auto_and_auto_follows_the_other_keys():
  with pytest.raises(config.ConfigError, match="remat.stack_layers: expected true, false or auto, "
                                               "got 'maybe'"):
    config.load(["remat.stack_layers=maybe"])
  with pytest.raises(config.ConfigError, match="remat.layer_loop and remat.stack_layers are both "
                                               "true; pick one"):
    config.load(["remat.layer_loop=true", "remat.stack_layers=true"])
  # a later override of the same key replaces an earlier one (a script's modes, then the user's)
  assert config.load(["remat.stack_layers=true", "remat.stack_layers=auto"])["remat"][
      "stack_layers"] == "auto"
  decided = {o: config.stacked(config.load(list(o))) for o in [
      (), ("remat.bridge=layers",), ("remat.bridge=none",), ("remat.scan_layers=true",),
      ("remat.layer_loop=true",)]}
  assert list(decided.values()) == [True, True, False, False, False]


def test_stacked_layers_keep_the_checkpoint_keys_of_the_layer_list():
  plain = train.prepare(config.load(["remat.stack_layers=false"]), torch_xla.device())
  stacked = train.prepare(config.load(), torch_xla.device())  # the default
  assert isinstance(stacked.layers, train.jb.StackedLayers)
  stacked_state, plain_state = stacked.state_dict(), plain.state_dict()
  assert list(stacked_state) == list(plain_state)
  for key, value in stacked_state.items():  # same seed: the same values
    assert torch.equal(value.cpu(), plain_state[key].cpu()), key
  plain.load_state_dict(stacked_state)


def test_bad_config_stops_before_any_build(capsys, monkeypatch):
  monkeypatch.setattr(train, "prepare", lambda *a: pytest.fail("built a model"))
  assert train.main(["remat.bridge=none", "remat.policy=full"]) == 2
  assert "config error: remat.bridge=none runs plain LazyTensor layers" in capsys.readouterr().err


def test_batches_depend_only_on_seed_and_step():
  a = data.batch(5, batch=2, seq=16, seed=1, source="corpus", vocab=256)
  b = data.batch(5, batch=2, seq=16, seed=1, source="corpus", vocab=256)
  assert all(torch.equal(x, y) for x, y in zip(a, b))
  assert data.corpus_tokens().max() < 256


def three_steps(tmp_path, *overrides):
  cfg = config.load(["train.steps=3", "train.checkpoint_every=0", f"out={tmp_path}",
                     *overrides])
  return train.train(cfg, log=quiet)


@pytest.fixture(scope="module")
def lazy_tensor_losses(recipe_run):
  return recipe_run("remat.bridge=none")[0]


# One run per way of running the step in `make test` (about 25 s each on 2 cores); the other
# presets and combinations under `make slow`.
# The default stacks the layers (remat.stack_layers=auto); `false` keeps a parameter per layer.
UNROLLED = "remat.stack_layers=false"
FAST_RECIPE_RUNS = [(), ("remat.policy=full",), ("remat.scan_layers=true",), (UNROLLED,),
                    ("remat.bridge=layers", UNROLLED)]


@pytest.mark.parametrize("overrides", [
    pytest.param(o, marks=() if o in FAST_RECIPE_RUNS else pytest.mark.slow) for o in [
        (), *[(f"remat.policy={name}",) for name in jb.remat.presets()],
        ("remat.save=[mlpwi]", "remat.offload=[query_proj]"),
        ("remat.scan_layers=true",), ("remat.scan_layers=true", "remat.policy=dots_no_batch"),
        (UNROLLED,), (UNROLLED, "remat.policy=full"),
        ("remat.bridge=layers",), ("remat.bridge=layers", UNROLLED)]
], ids=lambda o: " ".join(o) or "bridged step, stacked")
def test_losses_match_plain_lazy_tensor(recipe_run, lazy_tensor_losses, overrides):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # offload on CPU warns; test_remat checks that warning
    losses, out = recipe_run(*overrides)  # the bridged and scan runs: test_spmd's references
  assert losses == pytest.approx(lazy_tensor_losses, rel=2e-4)
  assert lazy_tensor_losses[2] < lazy_tensor_losses[0]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps_run"] == 3 and summary["residual_bytes_per_layer"] > 0


def test_jb_adamw_losses_match_torch_adamw_with_clipping_and_schedule(recipe_run):
  schedule = ("train.schedule=cosine", "train.warmup_steps=1")  # default max_grad_norm: 1.0
  ours, out = recipe_run(*schedule)  # default: jb.optim.AdamW in the one-node step
  torch_losses, torch_out = recipe_run(*schedule, "train.optimizer=torch-adamw",
                                       "remat.bridge=layers")
  assert ours == pytest.approx(torch_losses, rel=1e-5)
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  torch_rows = [json.loads(line) for line in (torch_out / "metrics.jsonl").read_text().splitlines()]
  assert [r["lr"] for r in rows] == [r["lr"] for r in torch_rows] == pytest.approx(
      [0.003 * 0.5, 0.003, 0.003 * 0.5])  # warmup, then cosine to 0 at step 3
  assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in torch_rows],
                                                         rel=1e-5)
  assert rows[0]["grad_norm"] > 1.0  # the clipping was active


def test_resume_continues_the_same_loss_curve(tmp_path):
  straight = train.train(config.load(["train.steps=4", "train.checkpoint_every=2",
                                      f"out={tmp_path / 'straight'}"]), log=quiet)
  interrupted = tmp_path / "interrupted"
  first = train.train(config.load(["train.steps=2", "train.checkpoint_every=2",
                                   f"out={interrupted}"]), log=quiet)
  lines = []
  rest = train.train(config.load(["train.steps=4", "train.checkpoint_every=2", "resume=true",
                                  f"out={interrupted}"]), log=lines.append)
  assert lines[0].startswith("resumed from") and lines[0].endswith("step_000002 at step 2")
  assert first + rest == pytest.approx(straight, rel=1e-5)
  assert len((interrupted / "metrics.jsonl").read_text().splitlines()) == 4


def test_mixtral_variant_trains(tmp_path):
  losses = three_steps(tmp_path, "model=mixtral-tiny")
  assert all(l == l for l in losses) and losses[-1] < losses[0]


def test_llama_1b_config_has_llama_3_2_1b_shapes():
  m = config.load(["model=llama-1b"])["model"]
  with torch.device("meta"):
    model = llama.Llama(vocab=m["vocab"], dim=m["dim"], layers=m["layers"], heads=m["heads"],
                        kv_heads=m["kv_heads"], hidden=m["hidden"])
  d, kv = m["dim"], m["dim"] // m["heads"] * m["kv_heads"]
  layer = 2 * d * d + 2 * d * kv + 3 * d * m["hidden"] + 2 * d
  expected = 2 * m["vocab"] * d + m["layers"] * layer + d
  assert sum(p.numel() for p in model.parameters()) == expected == 1_498_482_688
