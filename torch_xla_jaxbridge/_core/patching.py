"""Temporary replacement of attributes other libraries own, safe across threads and nesting.

Bridged code runs torch code that calls `xs.mark_sharding`, `torch.utils.checkpoint` or
`torch.cond`; inside a trace those must do something else. A `Patch` installs replacements while
at least one thread is inside it (a lock and a depth counter, so nested and concurrent traces
install and restore once) and tells each replacement whether the calling thread is inside, so
other threads keep the original behaviour.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Literal

_MISSING = object()


class Patch:
  """Replaces `name` on every object `owners()` returns with `replacements[name]` while any thread
  is inside `with patch:`. A replacement calls `patch.active()` to learn whether its caller's
  thread is inside, and `patch.original(name)` for what it replaced (None where it was unset).

  Example:
    >>> import types
    >>> box = types.SimpleNamespace(f=lambda: "plain")
    >>> patch = Patch(lambda: [box], {"f": lambda: "patched" if patch.active() else "plain"})
    >>> with patch:
    ...   box.f()
    'patched'
    >>> box.f()
    'plain'
  """

  def __init__(self, owners: Callable[[], list], replacements: dict[str, Any]) -> None:
    self._owners = owners
    self._replacements = dict(replacements)
    self._originals: dict[str, Any] = {}
    self._installed_on: list = []
    self._lock = threading.Lock()
    self._depth = 0
    self._local = threading.local()

  def active(self) -> bool:
    """Whether the calling thread is inside this patch."""
    return getattr(self._local, "depth", 0) > 0

  def original(self, name: str) -> Any:
    """The value `name` had before the patch (None where it had none)."""
    found = self._originals.get(name, _MISSING)
    return None if found is _MISSING else found

  def __enter__(self) -> Patch:
    with self._lock:
      if self._depth == 0:
        self._install()
      self._depth += 1
    self._local.depth = getattr(self._local, "depth", 0) + 1
    return self

  def __exit__(self, *exc: object) -> Literal[False]:
    self._local.depth -= 1
    with self._lock:
      self._depth -= 1
      if self._depth == 0:
        self._restore()
    return False

  def _install(self) -> None:
    owners = [o for o in self._owners() if o is not None]
    self._installed_on = owners
    for name in self._replacements:  # the first owner's value is the original
      self._originals[name] = _stored(owners[0], name) if owners else _MISSING
    for owner in owners:
      for name, replacement in self._replacements.items():
        if _stored(owner, name) is self._originals[name]:
          setattr(owner, name, replacement)

  def _restore(self) -> None:
    for owner in self._installed_on:
      for name, replacement in self._replacements.items():
        if _stored(owner, name) is replacement:
          if self._originals[name] is _MISSING:
            delattr(owner, name)
          else:
            setattr(owner, name, self._originals[name])
    self._installed_on = []


def _stored(owner: object, name: str) -> Any:
  """The value stored under `name` (a class's classmethod object itself, not a bound method)."""
  return inspect.getattr_static(owner, name, _MISSING)
