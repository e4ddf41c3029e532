"""Falling back to plain LazyTensor code where torch code cannot be bridged, and the report of it.

A bridged region (a `BridgeModule`, a module bridged by `bridge_modules`, a `jb.bridge`
function, `jb.train_step`) whose torch code cannot be traced (data-dependent Python control
flow, an op with no lowering, a tensor that cannot be lifted) runs as plain LazyTensor code
instead, as plain torch_xla would run it, while the modules inside it are bridged where they can
be (`auto`). Each fallback is said once (a `FallbackWarning` naming the region, the cause and the
line) and kept in the report `jb.bridge_report()`. With `fallback=False` the error is raised.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Callable, Iterator

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import diagnostics

_LOCK = threading.Lock()
_UNITS: weakref.WeakValueDictionary[int, Outcome] = weakref.WeakValueDictionary()
_COUNTER = iter(range(1 << 62))


def traced_by_torch(outcome: Outcome) -> None:
  """Records, in `outcome`'s row of the report, that a call runs as plain torch code because
  torch's own machinery traces it (said once, as a fallback for that call).

  Example:
    >>> outcome = Outcome("Layer", "module")
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore")
    ...   traced_by_torch(outcome)
    >>> outcome.status, outcome.reason.split(":")[0]
    ('fallback', 'TracedByTorchError')
  """
  outcome.fall_back(errors.TracedByTorchError(
      "called while torch's own machinery traces it (torch_xla's scan or scan_layers, "
      "AOTAutograd, torch.compile with another backend): it runs as plain torch code there; "
      "jb.scan_layers / jb.scan loop bridged layers"), True)


def can_fall_back(exc: BaseException) -> bool:
  """Whether `exc`, raised while a region was prepared or traced, means the region cannot be
  bridged (and plain LazyTensor code may still run it): any of the package's errors but a
  missing `rng_seed` or a `UsageError`, which are wrong calls in any mode.

  Example:
    >>> can_fall_back(errors.DataDependentError("if x.sum() > 0")), can_fall_back(KeyError())
    (True, False)
  """
  return isinstance(exc, errors.BridgeError) and exc.fallback_helps and not isinstance(
      exc, errors.MissingSeedError)


class Outcome:
  """How one bridged region runs: `"bridged"`, or `"fallback"` with the cause and the line.
  `fell_back`: it runs as plain code from now on; a cause that is a state of one call (a module
  hook, `errors.HookError`) makes that call plain only, and a later call that bridges says
  `"bridged"` again (`bridged_again`).

  Example:
    >>> outcome = Outcome("Encoder", "module")
    >>> outcome.status, outcome.fell_back
    ('bridged', False)
  """

  def __init__(self, name: str, kind: str, traces: Callable[[], int] = lambda: 0) -> None:
    self.name, self.kind, self.traces = name, kind, traces
    self.status, self.reason, self.where = "bridged", "", ""
    self.fell_back = False
    self.said: set[bool] = set()  # warned of a lasting fallback (True), of a passing one (False)
    self.before: tuple | None = None  # (status, reason, where, fell_back, said) before a fallback
    self.order = next(_COUNTER)
    with _LOCK:
      _UNITS[self.order] = self

  def fall_back(self, exc: BaseException, fallback: bool) -> None:
    """Records that the region cannot be bridged because of `exc` (for good, or for this call
    where `exc.lasting` is false) and says so once; re-raises `exc` when `fallback` is off or
    when it is not a bridging error."""
    if not fallback or not can_fall_back(exc):
      raise exc
    lasting = bool(getattr(exc, "lasting", True))
    with _LOCK:
      self.before = (self.status, self.reason, self.where, self.fell_back, set(self.said))
      first = lasting not in self.said
      self.said.add(lasting)
      self.status, self.fell_back = "fallback", self.fell_back or lasting
      self.reason = f"{type(exc).__name__}: {_first_line(exc)}"
      where = diagnostics.user_frame(exc.__cause__ or exc)  # the user's line, where known
      self.where = "" if where.startswith("<") else where
    if first:
      again = "" if lasting else " while its cause lasts"
      warnings.warn(
          f"{self.name} runs as plain LazyTensor code{again} ({self.reason}); the modules inside "
          f"it are bridged where they can be. jb.bridge_report() lists what runs bridged; "
          f"fallback=False raises instead.", errors.FallbackWarning, stacklevel=4)

  @contextlib.contextmanager
  def plain_run(self) -> Iterator[None]:
    """Around the plain run of a call that fell back: where it raises too, the error is the
    code's own (plain torch_xla raises it as well), not the bridge's, and it reaches the caller
    as plain torch_xla gives it; the fallback this call recorded is undone, so the next call is
    bridged again (one bad batch does not make a region plain for the rest of the run).

    Example:
      >>> outcome = Outcome("f", "function")
      >>> with warnings.catch_warnings():
      ...   warnings.simplefilter("ignore")
      ...   outcome.fall_back(errors.NoLoweringError("no rule"), True)
      >>> try:
      ...   with outcome.plain_run():
      ...     raise ValueError("the code's own error")
      ... except ValueError:
      ...   pass
      >>> outcome.fell_back, outcome.status
      (False, 'bridged')
    """
    before, self.before = self.before, None
    try:
      yield
    except Exception:
      if before is not None:
        with _LOCK:
          self.status, self.reason, self.where, self.fell_back, self.said = before
      raise

  def bridged_again(self) -> None:
    """A call bridged after calls that fell back for a passing cause: the region says so."""
    if self.status != "bridged":
      with _LOCK:
        if not self.fell_back:
          self.status, self.reason, self.where = "bridged", "", ""


def _first_line(exc: BaseException) -> str:
  text = str(exc).strip().splitlines()
  line = text[0] if text else ""
  return line if len(line) <= 300 else line[:297] + "..."


@dataclasses.dataclass(frozen=True)
class Row:
  """One bridged region in `BridgeReport`."""
  name: str  # a module's path (or class), a function's name, or the train step's
  kind: str  # "module", "function" or "step"
  status: str  # "bridged" or "fallback"
  reason: str  # the error that made it fall back
  where: str  # the line that raised it
  traces: int  # traces of its code so far (shared by structurally identical modules)


@dataclasses.dataclass(frozen=True)
class BridgeReport:
  """Every live bridged region, in the order they were made; `str()` gives a table. Pass it as
  `since=` to a later `bridge_report()` for the regions made after it."""
  rows: tuple
  mark: int = -1  # regions made after this report are numbered above it

  def fallbacks(self) -> list:
    """The rows of the regions that fell back."""
    return [r for r in self.rows if r.status == "fallback"]

  def row(self, name: str) -> Row | None:
    """The newest row named `name`, or None."""
    return next((r for r in reversed(self.rows) if r.name == name), None)

  def __str__(self) -> str:
    width = max([len(r.name) for r in self.rows] + [6])
    lines = [f"{'region':<{width}}  {'kind':<8}{'status':<10}{'traces':>6}  reason"]
    for r in self.rows:
      reason = f"{r.reason} at {r.where}" if r.where else r.reason
      lines.append(f"{r.name:<{width}}  {r.kind:<8}{r.status:<10}{r.traces:>6}  {reason}")
    return "\n".join(lines)


def bridge_report(since: BridgeReport | None = None) -> BridgeReport:
  """What runs bridged and what fell back to plain LazyTensor code, why, and how many traces
  each took: one row per live `BridgeModule`, module bridged by `jb.bridge_modules` (or bridged
  because a region around it fell back), `jb.bridge` function and `jb.train_step`, in the order
  they were made. A region goes with what it belongs to (a dropped model's rows go with it).
  `since`: an earlier report; only the regions made after it (the rows of the model built since).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> before = jb.bridge_report()
    >>> layer = jb.BridgeModule(torch.nn.Linear(2, 2).to("xla"))
    >>> _ = layer(torch.ones(1, 2, device="xla"))
    >>> [(r.name, r.status) for r in jb.bridge_report(since=before).rows]
    [('Linear', 'bridged')]
  """
  if since is not None and not isinstance(since, BridgeReport):
    raise errors.BadArgumentError(
        f"bridge_report: since= takes a report an earlier jb.bridge_report() returned; got a "
        f"{type(since).__name__}.")
  with _LOCK:
    mark = next(_COUNTER)
    units = sorted(_UNITS.values(), key=lambda u: u.order)
  floor = since.mark if since is not None else -1
  return BridgeReport(tuple(Row(u.name, u.kind, u.status, u.reason, u.where, int(u.traces()))
                            for u in units if u.order > floor), mark)
