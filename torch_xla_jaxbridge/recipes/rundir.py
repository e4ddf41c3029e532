"""The run directory `out` under faults: one run at a time, resumes only from a checkpoint of the
same model, a finished run left as it is, metrics cut back to the resumed step.

- `claim(out)` holds `out/run.lock` (an exclusive `flock`, which the kernel releases when the
  process ends however it ends) while a run runs; the file names the holder (pid, host, start
  time). A second run in the same directory stops with a `ConfigError` naming the directory and
  the holder. A lock file left with a record by a killed run is taken over and said so.
- `check_resume(found, cfg)`: resuming with another model shape, dtype, optimizer (state
  layout) than the checkpoint's is a `ConfigError` listing each differing key.
- `complete(found, cfg)`: whether the checkpoint to resume from is at `train.steps` already.
"""
import contextlib
import fcntl
import json
import os
import pathlib
import socket
import time
from collections.abc import Callable, Iterator

from torch_xla_jaxbridge.recipes import checkpoint, config

LOCK = "run.lock"
# Keys that shape a checkpoint's state: every model key but these (how the same weights are run,
# or documentation), and the settings of the optimizer state's layout. torch's AdamW and
# jb.optim's share the layout (docs/recipes.md), so a run may resume under the other.
_SAME_STATE = ("model.name", "model.architecture", "model.attention")
_STATE_KEYS = ("train.optimizer", "train.master_weights", "remat.stack_layers")
_SAME_OPTIMIZER_STATE = {config.TORCH_ADAMW: "adamw"}


@contextlib.contextmanager
def claim(out: str | os.PathLike, log: Callable[[str], object] = print) -> Iterator[None]:
  """Holds the lock of run directory `out` (made if missing) while the block runs, released on
  any exit; raises `ConfigError` when another process holds it.

  Example:
    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> try:
    ...   with claim(out), claim(out):
    ...     pass
    ... except config.ConfigError as e:
    ...   print(str(e).startswith(f"out: {out} is in use by another run: pid {os.getpid()} on"))
    True
  """
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  file = open(out / LOCK, "a+")
  try:
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise config.ConfigError(_busy(out, _holder(file))) from None
    except OSError as e:  # a filesystem without flock (some FUSE mounts)
      raise config.ConfigError(f"out: cannot lock {out / LOCK} ({e}): its filesystem does not "
                               f"support flock; give an out= directory on a local or NFS "
                               f"filesystem.") from None
    stale = _holder(file)
    if stale:
      log(f"{out / LOCK}: taking over the lock of {_who(stale)}, which ended without releasing "
          f"it (killed?)")
    _write(file, {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    try:
      yield
    finally:
      _write(file, None)
      fcntl.flock(file, fcntl.LOCK_UN)
  finally:
    file.close()


def _holder(file):
  """The holder record in the lock file (None: empty or unreadable)."""
  file.seek(0)
  try:
    return json.loads(file.read())
  except ValueError:  # empty (released), or the holder is writing it now
    return None


def _write(file, holder):
  file.truncate(0)
  if holder is not None:
    file.write(json.dumps(holder))
  file.flush()


def _who(holder):
  return (f"pid {holder.get('pid')} on host {holder.get('host')} (started "
          f"{holder.get('started')})")


def _busy(out, holder):
  """The message for a run directory whose lock another process holds."""
  if holder is None:
    who = "a process that has not written its pid yet"
  else:
    who = _who(holder)
    if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
      who += f"; pid {holder.get('pid')} has exited, a process it started still holds the lock"
  return (f"out: {out} is in use by another run: {who}. Wait for it to finish or stop it, or "
          f"give this run another out= directory.")


def _alive(pid):
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, TypeError, ValueError):  # another user's process; no pid
    return True
  return True


def check_resume(found: str | os.PathLike, cfg: dict) -> None:
  """Raises `ConfigError` (one line) when checkpoint `found` was saved with a model or optimizer
  state layout other than `cfg`'s, naming each differing key with its saved and current value.
  A checkpoint without a saved config (an older recipe's) is not checked.

  Example:
    >>> import tempfile
    >>> check_resume(tempfile.mkdtemp(), config.load())  # no config.json: nothing to compare
  """
  saved = checkpoint.run_config(found)
  if saved is None:
    return
  differ = differences(saved, cfg)
  if differ:
    told = "; ".join(f"{key} saved {_value(a)}, now {_value(b)}" for key, a, b in differ)
    again = " ".join(f"{key}={_value(a)}" for key, a, _ in differ)
    raise config.ConfigError(
        f"resume: {found} was saved with another configuration: {told}. Resume with the saved "
        f"values ({again}), or train this configuration in another out= directory.")


def differences(saved: dict, cfg: dict) -> list[tuple]:
  """(key, saved value, current value) of each key that shapes the checkpoint's state and differs
  between configs `saved` and `cfg`; keys absent from either are skipped.

  Example:
    >>> differences(config.load(), config.load(["model.layers=2", "train.optimizer=lion"]))
    [('model.layers', 4, 2), ('train.optimizer', 'adamw', 'lion')]
  """
  keys = sorted({f"model.{k}" for k in {**saved.get("model", {}), **cfg["model"]}}
                - set(_SAME_STATE)) + list(_STATE_KEYS)
  found = []
  for key in keys:
    section, name = key.split(".")
    if name not in saved.get(section, {}) or name not in cfg[section]:
      continue
    a, b = saved[section][name], cfg[section][name]
    if key == "train.optimizer":
      same = _SAME_OPTIMIZER_STATE.get(a, a) == _SAME_OPTIMIZER_STATE.get(b, b)
    else:
      same = a == b
    if not same:
      found.append((key, a, b))
  return found


def _value(value):
  """`value` as an override writes it (true, 4, float32)."""
  return str(value).lower() if isinstance(value, bool) else str(value)


def complete(found: str | os.PathLike, cfg: dict, log: Callable[[str], object] = print) -> bool:
  """Whether checkpoint `found` is at (or past) `train.steps`: the run is complete, which is
  logged, and nothing is to be trained or written.

  Example:
    >>> complete("out/checkpoints/step_000150", config.load())
    False
    >>> complete("out/checkpoints/step_000200", config.load(), log=lambda line: None)
    True
  """
  step, steps = checkpoint.step_of(found), cfg["train"]["steps"]
  if step < steps:
    return False
  log(f"{pathlib.Path(found).parent}: the run is complete: its newest checkpoint "
      f"{pathlib.Path(found).name} is at step {step} (train.steps={steps}); summary.json and "
      f"metrics.jsonl are left as they are. To train further, raise train.steps.")
  return True


def keep_metrics_until(path: str | os.PathLike, step: int) -> None:
  """Drops the rows of `metrics.jsonl` file `path` after `step` (a run killed after its last
  checkpoint wrote them; the resumed run writes them again) and a last line cut short by the
  kill.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> _ = path.write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3}\\n{"st')
    >>> keep_metrics_until(path, 2)
    >>> path.read_text()
    '{"step": 1}\\n{"step": 2}\\n'
  """
  path = pathlib.Path(path)
  if not path.exists():
    return
  rows = []
  for line in path.read_text().splitlines():
    try:
      if json.loads(line)["step"] <= step:
        rows.append(line + "\n")
    except (json.JSONDecodeError, KeyError):
      pass
  path.write_text("".join(rows))
