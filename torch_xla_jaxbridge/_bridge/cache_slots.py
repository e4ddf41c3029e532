"""One layer's slot of a Hugging Face cache, passed through a bridged call in place of the cache.

A decoder layer writes its own slot of the cache (`cache.update(k, v, self.layer_idx)` fills
`cache.layers[layer_idx]`). Passed as a `CacheSlot`, only that slot's state enters the trace, so
layers whose slots are alike can share one trace (`layer_slots`). Inside the trace the cache's
copy holds a `SlotList` as its `layers`: the own slot, at whatever index the traced layer gives;
any other slot, iteration or change of the list raises `OtherSlotTouched`, so code that reads
another layer's slot never runs on a partial cache.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, NoReturn

_LOCAL = threading.local()  # .index: the slot index of the layer being called (`addressing`)


class OtherSlotTouched(Exception):
  """A layer called with its own cache slot reached for the rest of the cache (not an
  AttributeError, so `getattr(..., default)` and `hasattr` do not swallow it)."""


class CacheSlot:
  """`cache` as seen by the layer at `index`: its slot `cache.layers[index]` and the cache's
  other attributes; `fingerprint` names the layer's program (`layer_slots.fingerprint`), so calls
  share a trace only where it is equal.

  Example:
    >>> import types
    >>> cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=None)] * 2)
    >>> CacheSlot(cache, 1, 0).own() is cache.layers[1]
    True
  """
  __slots__ = ("cache", "index", "fingerprint")

  def __init__(self, cache: Any, index: int, fingerprint: int | None) -> None:
    self.cache, self.index, self.fingerprint = cache, index, fingerprint

  def own(self) -> Any:
    return self.cache.layers[self.index]

  def view(self) -> Any:
    """A shallow copy of the cache whose `layers` is a `SlotList` of the own slot alone."""
    view = object.__new__(type(self.cache))
    vars(view).update(vars(self.cache))
    view.layers = SlotList(len(self.cache.layers), self.own())
    return view

  def write(self, view: Any) -> None:
    """Sets the cache's state to `view`'s (a `view()` after the layer's call): its attributes,
    and its own slot in place."""
    state = dict(vars(view))
    own = state.pop("layers").own
    vars(self.cache).update(state)
    if type(self.own()) is type(own):
      vars(self.own()).clear()
      vars(self.own()).update(vars(own))
    else:
      self.cache.layers[self.index] = own


class SlotList:
  """A cache's `layers` inside a trace: `length` slots of which only `own`, at the index of the
  layer being called (`addressing`), is there.

  Example:
    >>> with addressing(2):
    ...   slots = SlotList(4, "own slot")
    >>> slots[2], len(slots)
    ('own slot', 4)
    >>> try:
    ...   slots[0]
    ... except OtherSlotTouched as e:
    ...   print(e)
    the layer at index 2 read the cache's layers[0], another layer's slot
  """
  __slots__ = ("length", "own", "index")

  def __init__(self, length: int, own: Any) -> None:
    self.length, self.own, self.index = length, own, getattr(_LOCAL, "index", None)

  def __len__(self) -> int:
    return self.length

  def _check(self, i: object) -> None:
    if type(i) is not int or self.index is None or i != self.index:
      _refuse(f"the layer at index {self.index} read the cache's layers[{i!r}], another "
              f"layer's slot")

  def __getitem__(self, i: object) -> Any:
    self._check(i)
    return self.own

  def __setitem__(self, i: object, value: Any) -> None:
    self._check(i)
    self.own = value

  def __iter__(self) -> Iterator[Any]:
    _refuse(f"the layer at index {self.index} went through every cache slot")

  def __getattr__(self, name: str) -> Any:  # append, extend, index, ...: the whole list
    _refuse(f"the layer at index {self.index} used the cache's layers.{name}")


def _refuse(message: str) -> NoReturn:
  """Raises `OtherSlotTouched`, noting it for `violated` (code that catches it still counts)."""
  _LOCAL.violated = True
  raise OtherSlotTouched(message)


def violated() -> bool:
  """Whether a `SlotList` was reached past its own slot inside the innermost `addressing` block,
  even where the code caught the error.

  Example:
    >>> with addressing(1):
    ...   try:
    ...     SlotList(2, "slot")[0]
    ...   except OtherSlotTouched:
    ...     pass
    ...   violated()
    True
  """
  return bool(getattr(_LOCAL, "violated", False))


@contextlib.contextmanager
def addressing(index: int | None) -> Iterator[None]:
  """Inside the block, `SlotList`s made are the slots of the layer at `index` (None: of no
  layer).

  Example:
    >>> with addressing(0):
    ...   SlotList(1, "slot")[0]
    'slot'
  """
  before = getattr(_LOCAL, "index", None), getattr(_LOCAL, "violated", False)
  _LOCAL.index, _LOCAL.violated = index, False
  try:
    yield
  finally:
    _LOCAL.index, _LOCAL.violated = before
