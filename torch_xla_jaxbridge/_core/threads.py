"""What keeps the bridge right when several threads call it at once.

Tracing is serialized: JAX traces torch code through one torchax environment whose random key
is set per trace, so one trace runs at a time (`TRACING`, re-entrant for traces inside traces);
calls that find their signature in the cache do not wait. One-time set-up (pytree registrations,
the environment, kernels) runs once whichever thread comes first (`once`).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Protocol, TypeVar, cast

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)

TRACING = threading.RLock()


class Once(Protocol[_T_co]):
  """What `once` returns: a function of no arguments, and `done()`."""

  def __call__(self) -> _T_co: ...

  def done(self) -> bool: ...


def once(fn: Callable[[], _T]) -> Once[_T]:
  """`fn()` run once and its result kept; a caller that arrives while the first runs it waits.
  `wrapper.done()` says whether it has run.

  Example:
    >>> calls = []
    >>> make = once(lambda: calls.append(1) or len(calls))
    >>> make(), make(), make.done()
    (1, 1, True)
  """
  lock = threading.Lock()
  result: list[_T] = []

  @functools.wraps(fn)
  def wrapper() -> _T:
    if not result:
      with lock:
        if not result:
          result.append(fn())
    return result[0]

  setattr(wrapper, "done", lambda: bool(result))
  return cast(Once[_T], wrapper)


class Switch:
  """A per-thread switch, on inside `with switch.on():` in the thread that entered the block.

  Example:
    >>> switch = Switch()
    >>> with switch.on():
    ...   switch.is_on()
    True
    >>> switch.is_on()
    False
  """

  def __init__(self) -> None:
    self._local = threading.local()

  def is_on(self) -> bool:
    return getattr(self._local, "on", False)

  @contextlib.contextmanager
  def on(self) -> Iterator[None]:
    before = self.is_on()
    self._local.on = True
    try:
      yield
    finally:
      self._local.on = before
