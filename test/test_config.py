"""Recipe config checks: every value the recipe cannot run is a ConfigError naming the key, the
value and what is valid, raised by `config.load` before anything is built; Hydra-style override
prefixes a torchprime user brings."""
import re

import pytest

from torch_xla_jaxbridge.recipes import config, data, train

CORPUS = data.CORPUS.stat().st_size


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=0"], r"train.lr: must be greater than 0, got 0.0"),
    (["train.lr=-1"], r"train.lr: must be greater than 0, got -1.0"),
    (["train.lr=.nan"], r"train.lr: must be greater than 0, got nan"),
    (["train.weight_decay=-0.1"], r"train.weight_decay: must be at least 0, got -0.1"),
    (["train.optimizer=adam"], r"train.optimizer: 'adam' is not valid; choose one of "
                               + re.escape(", ".join(config.optimizer_choices()) + ".")),
    (["train.optimizer=torch-adamw"], r"train.optimizer=torch-adamw: remat.bridge=step runs the "
                                      r"whole step .* or remat.bridge=layers with torch-adamw\."),
    (["train.optimizer=lion", "train.optimizer_args={momentum: 0.9}"],
     r"train.optimizer_args: lion takes no argument 'momentum'; its arguments: betas, lr, "
     r"max_grad_norm, maximize, weight_decay\."),
    (["train.steps=0"], r"train.steps: must be at least 1, got 0"),
    (["train.batch=-2"], r"train.batch: must be at least 1, got -2"),
    (["train.seq=0"], r"train.seq: must be at least 1, got 0"),
    (["train.checkpoint_every=-1"], r"train.checkpoint_every: must be at least 0, got -1"),
    (["train.keep_checkpoints=-1"], r"train.keep_checkpoints: must be at least 0, got -1"),
    ([f"train.seq={CORPUS}"], rf"train.seq: {CORPUS} is longer than the corpus allows \(it has "
                              rf"{CORPUS} tokens: train.seq at most {CORPUS - 2}\); use a shorter "
                              rf"seq or train.data=synthetic"),
    (["model.vocab=100"], r"model.vocab: 100 is too small for train.data=corpus \(byte tokens "
                          r"0..255\): use at least 256, or train.data=synthetic"),
    (["model.dim=0"], r"model.dim: must be at least 1, got 0"),
    (["model.layers=0"], r"model.layers: must be at least 1, got 0"),
    (["model.hidden=-1"], r"model.hidden: must be at least 1, got -1"),
    (["model.heads=3"], r"model.heads: 3 does not divide model.dim=64 into heads of even size"),
    (["model.heads=64"], r"model.heads: 64 does not divide model.dim=64 into heads of even size "
                         r"\(rotary"),
    (["model.kv_heads=3"], r"model.kv_heads: 3 does not divide model.heads=4; choose a divisor "
                           r"of 4"),
    (["model=mixtral-tiny", "model.experts_per_token=5"],
     r"model.experts_per_token: 5 is not between 1 and model.experts=4"),
    (["model.experts=-1"], r"model.experts: must be at least 0, got -1"),
    (["mesh.fsdp=2", "mesh.tensor=2"], r"mesh.fsdp \* mesh.tensor = 2 \* 2 = 4 devices, but this "
                                       r"process sees 1"),
    (["~train.seed"], r"override '~train.seed': deleting a key is not supported \(the recipe "
                      r"reads every key\); set it instead: train.seed=VALUE"),
    (["model/remat=llama-scan"], r"model/remat: the only config group is model=; torchprime's "
                                 r"model/remat presets are remat.\* keys here"),
    (["+train.extra=1"], r"train.extra: unknown key 'extra' in train; valid keys: batch"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_value_names_key_value_and_what_is_valid(overrides, message):
  with pytest.raises(config.ConfigError, match=message):
    config.load(overrides)


@pytest.mark.parametrize("overrides", [
    [f"train.seq={CORPUS - 2}", "train.batch=1"], [f"train.seq={CORPUS}", "train.data=synthetic"],
    ["model.vocab=100", "train.data=synthetic"], ["model.heads=2", "model.kv_heads=1"],
])
def test_limits_are_exact(overrides):
  cfg = config.load(overrides)  # the largest corpus window exists; synthetic data has no limit
  t = cfg["train"]
  inputs, _ = data.batch(0, batch=t["batch"], seq=t["seq"], seed=0, source=t["data"],
                         vocab=cfg["model"]["vocab"])
  assert inputs.shape == (t["batch"], t["seq"]) and int(inputs.max()) < cfg["model"]["vocab"]


def test_hydra_add_prefixes_set_an_existing_key():
  cfg = config.load(["+train.steps=7", "++train.lr=0.5"])
  assert cfg["train"]["steps"] == 7 and cfg["train"]["lr"] == 0.5


def test_main_prints_the_error_and_exits_2_before_building(capsys, monkeypatch):
  monkeypatch.setattr(train, "prepare", lambda *a: pytest.fail("built a model"))
  assert train.main([f"train.seq={CORPUS + 10}"]) == 2
  assert capsys.readouterr().err.startswith(f"config error: train.seq: {CORPUS + 10} is longer")


def test_every_registered_optimizer_and_preset_is_a_choice_and_a_bad_one_lists_them():
  """The registries are the recipe's only lists: default.yaml's comments point to them."""
  import torch_xla_jaxbridge as jb

  for name in jb.optim.optimizers():
    assert config.load([f"train.optimizer={name}"])["train"]["optimizer"] == name
  for name in jb.remat.presets():
    assert config.load([f"remat.policy={name}"])["remat"]["policy"] == name
  with pytest.raises(config.ConfigError, match=", ".join(map(re.escape, jb.remat.presets()))):
    config.load(["remat.policy=nope"])
  text = (config.CONFIGS / "default.yaml").read_text()
  assert "jb.optim.optimizers()" in text and "jb.remat.presets()" in text
