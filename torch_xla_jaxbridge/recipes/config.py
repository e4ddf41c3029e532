"""Recipe configuration: YAML defaults, a model file, and `key=value` overrides, all checked
before anything is built."""
import inspect
import pathlib

import torch
import yaml

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge.recipes import data
from torch_xla_jaxbridge.recipes.llama import ATTENTION, CHECKPOINT_NAMES, DTYPES

CONFIGS = pathlib.Path(__file__).parent / "configs"
TORCH_ADAMW = "torch-adamw"  # train.optimizer: torch.optim.AdamW; every other name is a jb.optim one
OPTIMIZER_ARGS = {"sgd": {"momentum": 0.9}}  # the recipe's own defaults, under train.optimizer_args
SCHEDULES = ("constant", "cosine", "linear")  # train.schedule after train.warmup_steps
BRIDGES = ("step", "layers", "none")  # remat.bridge: how much of a step is bridged


class ConfigError(errors.BridgeError, ValueError):
  """A config key or value the recipe does not accept; says which and what is valid."""


def optimizer_choices():
  """`train.optimizer`'s values: the `jb.optim` optimizers by name, then torch's AdamW.

  Example:
    >>> optimizer_choices()[-1]
    'torch-adamw'
  """
  return (*jb.optim.optimizers(), TORCH_ADAMW)


def model_choices():
  """The model files in configs/model, by name."""
  return sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))


def load(overrides=()):
  """The full config: defaults, the chosen model file, then `key=value` overrides.

  Example:
    >>> cfg = load(["train.steps=3", "remat.policy=minimal"])
    >>> cfg["train"]["steps"], cfg["model"]["dim"]
    (3, 64)
  """
  cfg = yaml.safe_load((CONFIGS / "default.yaml").read_text())
  pairs = [_split(o) for o in overrides]
  for key, value in pairs:
    if key == "model":
      cfg["model"] = value
  cfg["model"] = _model_file(cfg["model"])
  for key, value in pairs:
    if key != "model":
      _set(cfg, key, value)
  check(cfg)
  return cfg


def _split(override):
  """`(key, value)` of one override. Hydra's `+key=` and `++key=` set the key (every key exists
  here); deleting (`~key`) and config groups other than `model=` (`model/remat=`) are refused."""
  if override.startswith("~"):
    raise ConfigError(f"override {override!r}: deleting a key is not supported (the recipe reads "
                      f"every key); set it instead: {override[1:].split('=')[0]}=VALUE.")
  if "=" not in override:
    raise ConfigError(f"override {override!r}: expected key=value, e.g. train.steps=10.")
  key, raw = override.split("=", 1)
  key = key.strip().lstrip("+")
  if "/" in key:
    raise ConfigError(f"{key}: the only config group is model=; torchprime's model/remat presets "
                      f"are remat.* keys here and model/sharding is mesh.* (docs/recipes.md, "
                      f"'From torchprime').")
  return key, yaml.safe_load(raw) if raw.strip() else ""


def _model_file(name):
  if not isinstance(name, str) or name not in model_choices():
    raise ConfigError(f"model: unknown model {name!r}; choose one of {', '.join(model_choices())}.")
  model = yaml.safe_load((CONFIGS / "model" / f"{name}.yaml").read_text())
  model["name"] = name
  return model


def _set(cfg, key, value):
  node, parts = cfg, key.split(".")
  for depth, part in enumerate(parts):
    if not isinstance(node, dict) or part not in node:
      where = ".".join(parts[:depth]) or "the top level"
      valid = sorted(node) if isinstance(node, dict) else []
      raise ConfigError(f"{key}: unknown key {part!r} in {where}; valid keys: {', '.join(valid)}.")
    if depth == len(parts) - 1:
      node[part] = _typed(key, node[part], value)
    else:
      node = node[part]


_NULLABLE = ("train.max_grad_norm",)  # keys with a non-null default that also take null
AUTO = "auto"  # remat.stack_layers: decided from the other keys (and a resumed checkpoint's)


def _typed(key, default, value):
  """`value` checked against the type of the default it replaces."""
  if default is None or (value is None and key in _NULLABLE):
    return value
  if key == "remat.stack_layers":
    if isinstance(value, bool) or value == AUTO:
      return value
    raise ConfigError(f"{key}: expected true, false or {AUTO}, got {value!r}.")
  if isinstance(default, bool) or isinstance(value, bool):
    if isinstance(default, bool) and isinstance(value, bool):
      return value
  elif isinstance(default, float) and isinstance(value, int):
    return float(value)
  elif isinstance(default, list) and isinstance(value, str):
    return [value]
  elif isinstance(value, type(default)):
    return value
  raise ConfigError(f"{key}: expected {type(default).__name__} (like {default!r}), got "
                    f"{type(value).__name__} {value!r}.")


def check(cfg):
  """Raises ConfigError for values the recipe cannot run, naming the key and the valid choices."""
  train, remat, model, mesh = cfg["train"], cfg["remat"], cfg["model"], cfg["mesh"]
  _choice("train.optimizer", train["optimizer"], optimizer_choices())
  _choice("train.schedule", train["schedule"], SCHEDULES)
  _choice("train.data", train["data"], ("corpus", "synthetic"))
  _choice("model.architecture", model["architecture"], ("llama", "mixtral"))
  _choice("model.dtype", model["dtype"], DTYPES)
  if train["master_weights"] and model["dtype"] == "float32":
    raise ConfigError("train.master_weights=true keeps float32 copies of low-precision parameters, "
                      "but model.dtype is float32; set model.dtype=bfloat16 or drop master_weights.")
  _choice("remat.bridge", remat["bridge"], BRIDGES)
  if remat["bridge"] == "step" and train["optimizer"] == TORCH_ADAMW:
    raise ConfigError(f"train.optimizer={TORCH_ADAMW}: remat.bridge=step runs the whole step "
                      f"(loss, gradients and a jb.optim optimizer's update) as one graph node; "
                      f"use train.optimizer={' or '.join(jb.optim.optimizers())}, or "
                      f"remat.bridge=layers with {TORCH_ADAMW}.")
  _choice("model.attention", model["attention"], tuple(ATTENTION))
  if model["attention"] != "reference" and remat["bridge"] == "none":
    raise ConfigError(f"model.attention={model['attention']} replaces attention inside bridged "
                      f"layers, and remat.bridge=none runs plain LazyTensor layers, which would "
                      f"keep the reference attention; use remat.bridge=step (or layers) or "
                      f"model.attention=reference.")
  if remat["policy"] is not None:
    _choice("remat.policy", remat["policy"], tuple(jb.remat.presets()))
  for field in ("save", "offload"):
    for name in remat[field]:
      _choice(f"remat.{field}", name, CHECKPOINT_NAMES)
  both = sorted(set(remat["save"]) & set(remat["offload"]))
  if both:
    raise ConfigError(f"remat.save and remat.offload both name {both}; keep each in one.")
  wants_remat = remat["policy"] is not None or remat["save"] or remat["offload"]
  if remat["bridge"] == "none" and (wants_remat or remat["scan_layers"] or
                                    remat["stack_layers"] is True):
    raise ConfigError("remat.bridge=none runs plain LazyTensor layers: remat.policy, save, "
                      "offload, scan_layers and stack_layers need remat.bridge=step or layers.")
  if remat["scan_layers"] and remat["stack_layers"] is True:
    raise ConfigError("remat.scan_layers and remat.stack_layers are both true; pick one (both "
                      "run the stack as one scan; stack_layers also stores it stacked).")
  if remat["layer_loop"] and remat["stack_layers"] is True:
    raise ConfigError("remat.layer_loop and remat.stack_layers are both true; pick one "
                      "(stacked layers already run as one scan, with no loop of layers to find).")
  for key in ("batch", "seq", "steps", "log_every"):
    _at_least(f"train.{key}", train[key], 1)
  _at_least("train.checkpoint_every", train["checkpoint_every"], 0)
  _at_least("train.keep_checkpoints", train["keep_checkpoints"], 0)
  _check_optimizer(train)
  _check_out(cfg["out"])
  _check_data(train, model)
  _check_mesh(mesh, train)
  _check_model(model)


def stacked(cfg):
  """Whether the decoder stack is a `jb.StackedLayers`: `remat.stack_layers`, where `auto` is
  true for bridged layers (`remat.bridge` step or layers) that are not `remat.scan_layers` and
  not `remat.layer_loop` (those run the model's own loop).

  Example:
    >>> [stacked(load(o)) for o in ([], ["remat.bridge=none"], ["remat.scan_layers=true"],
    ...                             ["remat.layer_loop=true"])]
    [True, False, False, False]
  """
  remat = cfg["remat"]
  if remat["stack_layers"] != AUTO:
    return remat["stack_layers"]
  return remat["bridge"] != "none" and not remat["scan_layers"] and not remat["layer_loop"]


def resolved(cfg, saved=None):
  """`cfg` with `remat.stack_layers=auto` decided: `stacked(cfg)`, but false when resuming from a
  checkpoint whose layers were not stacked (so a run continues in its own layout; one saved
  stacked resumes stacked unless `cfg` rules stacking out). `saved` is the checkpoint's config
  when resuming ({} for a checkpoint saved without one, or without this key: from before
  stacking was the default, so a parameter per layer), None otherwise.

  Example:
    >>> resolved(load())["remat"]["stack_layers"]
    True
    >>> resolved(load(), {"remat": {"stack_layers": False}})["remat"]["stack_layers"]
    False
    >>> resolved(load(), {})["remat"]["stack_layers"]
    False
  """
  remat = cfg["remat"]
  if remat["stack_layers"] != AUTO:
    return cfg
  before = None if saved is None else saved.get("remat", {}).get("stack_layers", False)
  decided = stacked(cfg) and before is not False
  return {**cfg, "remat": {**remat, "stack_layers": decided}}


def _check_model(model):
  """Positive shapes; heads that divide dim into even head sizes (rotary); kv_heads that divide
  heads; experts_per_token at most experts."""
  for key in ("vocab", "dim", "layers", "heads", "kv_heads", "hidden"):
    _at_least(f"model.{key}", model[key], 1)
  _at_least("model.experts", model["experts"], 0)
  if model["dim"] % model["heads"] or (model["dim"] // model["heads"]) % 2:
    raise ConfigError(f"model.heads: {model['heads']} does not divide model.dim={model['dim']} "
                      f"into heads of even size (rotary embeddings rotate pairs); choose heads "
                      f"with dim / heads even.")
  if model["heads"] % model["kv_heads"]:
    raise ConfigError(f"model.kv_heads: {model['kv_heads']} does not divide model.heads="
                      f"{model['heads']}; choose a divisor of {model['heads']}.")
  if model["experts"] and not 1 <= model["experts_per_token"] <= model["experts"]:
    raise ConfigError(f"model.experts_per_token: {model['experts_per_token']} is not between 1 "
                      f"and model.experts={model['experts']}.")


def _check_data(train, model):
  """The shipped corpus holds windows of at most its length - 2 tokens, byte tokens < 256."""
  if train["data"] != "corpus":
    return
  length = data.CORPUS.stat().st_size  # one token a byte
  if train["seq"] > length - 2:
    raise ConfigError(f"train.seq: {train['seq']} is longer than the corpus allows (it has "
                      f"{length} tokens: train.seq at most {length - 2}); use a shorter seq or "
                      f"train.data=synthetic.")
  if model["vocab"] < 256:
    raise ConfigError(f"model.vocab: {model['vocab']} is too small for train.data=corpus (byte "
                      f"tokens 0..255): use at least 256, or train.data=synthetic.")


def _at_least(key, value, low):
  if value < low:
    raise ConfigError(f"{key}: must be at least {low}, got {value}.")


def _positive(key, value):
  if not value > 0:  # also refuses nan
    raise ConfigError(f"{key}: must be greater than 0, got {value}.")


def _check_optimizer(train):
  """Learning rate, weight decay, clipping norm and warmup the optimizer and schedule can run."""
  _positive("train.lr", train["lr"])
  _at_least("train.weight_decay", train["weight_decay"], 0)
  if train["max_grad_norm"] is not None and train["max_grad_norm"] < 0:
    raise ConfigError(f"train.max_grad_norm: must be > 0 (or null or 0: no clipping), got "
                      f"{train['max_grad_norm']}.")
  cls = jb.optim.optimizers().get(train["optimizer"], torch.optim.AdamW)
  accepted = sorted(set(inspect.signature(cls).parameters) - {"params"})
  for key in train["optimizer_args"]:
    if key not in accepted:
      raise ConfigError(f"train.optimizer_args: {train['optimizer']} takes no argument {key!r}; "
                        f"its arguments: {', '.join(accepted)}.")
  if not 0 <= train["warmup_steps"] <= train["steps"]:
    raise ConfigError(f"train.warmup_steps: must be between 0 and train.steps ({train['steps']}), "
                      f"got {train['warmup_steps']}.")


def _check_out(out):
  """`out` names a directory, existing or not (not a file, not nothing)."""
  if not isinstance(out, str) or not out.strip():
    raise ConfigError(f"out: {out!r} names no directory; give the run's directory, e.g. "
                      f"out=out/train.")
  if pathlib.Path(out).exists() and not pathlib.Path(out).is_dir():
    raise ConfigError(f"out: {out} is a file, not a directory; give a directory for the run's "
                      f"metrics, summary and checkpoints.")


def _check_mesh(mesh, train):
  """A mesh over more than one device must match the device count and divide the batch."""
  for key in ("fsdp", "tensor"):
    _at_least(f"mesh.{key}", mesh[key], 1)
  size = mesh["fsdp"] * mesh["tensor"]
  if size == 1:
    return
  import torch_xla.runtime as xr

  count = xr.global_runtime_device_count()
  if size != count:
    raise ConfigError(
        f"mesh.fsdp * mesh.tensor = {mesh['fsdp']} * {mesh['tensor']} = {size} devices, but this "
        f"process sees {count}. Make the product equal the device count (on CPU, start the process "
        f"with CPU_NUM_DEVICES={size} XLA_FLAGS=--xla_force_host_platform_device_count={size}).")
  if train["batch"] % mesh["fsdp"]:
    raise ConfigError(f"train.batch: {train['batch']} does not divide over mesh.fsdp="
                      f"{mesh['fsdp']}; use a multiple of {mesh['fsdp']}.")


def _choice(key, value, valid):
  if value not in valid:
    raise ConfigError(f"{key}: {value!r} is not valid; choose one of {', '.join(map(str, valid))}.")


def remat_setting(cfg):
  """The `remat=` value the config asks for (None, a preset name, or a jb.Remat).

  Example:
    >>> remat_setting(load(["remat.policy=dots"]))
    'dots'
  """
  remat = cfg["remat"]
  if remat["save"] or remat["offload"]:
    return jb.Remat(save=tuple(remat["save"]), offload=tuple(remat["offload"]),
                    policy=remat["policy"])
  return remat["policy"]
