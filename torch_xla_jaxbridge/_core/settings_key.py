"""A module's plain attribute values (numbers, strings) as a trace's cache key
(`modules.StateWalk.settings`): all of them, or only those a shared forward's traces read.
"""
from typing import Any, Iterable

# (submodule path, names of its plain attributes) of each submodule holding some: where each
# value is in a `Settings`. Interned in LAYOUTS, so the settings of one structure share one.
Layout = tuple[tuple[str, tuple[str, ...]], ...]
LAYOUTS: dict[Layout, Layout] = {}


class ReadSettings:
  """The plain attributes (by path: `self_attn.layer_idx`) that the traces of a forward shared by
  modules of one structure have read (`_bridge.auto.SharedForward`): the only values its calls
  are keyed by, so modules differing in values their forward never reads share its traces.

  Example:
    >>> reads = ReadSettings()
    >>> reads.add({"scale"})
    >>> reads.positions((("", ("bias", "scale")),))
    ((0, 1),)
  """
  __slots__ = ("paths", "_positions")

  def __init__(self) -> None:
    self.paths: set[str] = set()
    self._positions: dict[int, tuple[tuple[int, int], ...]] = {}

  def add(self, paths: Iterable[str]) -> None:
    """Adds the paths a trace read (only ever grows: a call compares more values, never fewer)."""
    new = set(paths) - self.paths
    if new:
      self.paths |= new
      self._positions = {}

  def positions(self, layout: Layout) -> tuple[tuple[int, int], ...]:
    """(submodule index, attribute index) in a `StateWalk.settings()` of `layout` of each path
    read."""
    found = self._positions.get(id(layout))
    if found is None:
      found = self._positions[id(layout)] = tuple(
          (i, j) for i, (prefix, names) in enumerate(layout) for j, name in enumerate(names)
          if (f"{prefix}.{name}" if prefix else name) in self.paths)
    return found


class Settings:
  """A module's plain attribute values (`StateWalk.settings`) as a cache key: hashed once. With
  `reads`, two settings of one `layout` are equal when they agree on the values read.

  Example:
    >>> Settings(((2, 3.0),)) == Settings(((2, 3.0),)), Settings(((2, 3.0),)) == Settings(((2,),))
    (True, False)
  """
  __slots__ = ("values", "hash", "types", "reads", "layout", "host", "host_values")

  def __init__(self, values: tuple, reads: ReadSettings | None = None,
               layout: Layout = (), host: tuple = (), host_values: Any = None) -> None:
    self.values = values
    self.host = host  # the plain values read from outside the module (`host_values`): all count
    self.host_values = host_values  # their `host_values.HostValues`, naming them in reasons
    self.types = tuple(tuple(map(type, v)) if v is not None else None for v in values)
    self.reads = reads
    self.layout = layout
    # by `reads`: equal settings must hash alike whatever is read later (a shared forward's
    # keys differ in few values: the lowering cache's lookup compares those few)
    self.hash = hash(values) if reads is None else id(reads)

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if (not isinstance(other, Settings) or self.reads is not other.reads
        or self.host != other.host):
      return False
    if self.reads is None:
      return (self.hash == other.hash and self.values == other.values and
              self.types == other.types)
    if self.layout is not other.layout:
      return False
    for i, j in self.reads.positions(self.layout):
      mine, theirs = self.values[i], other.values[i]
      if mine is None or theirs is None:
        if mine is not theirs:
          return False
      elif mine[j] != theirs[j] or type(mine[j]) is not type(theirs[j]):
        return False
    return True

  def __hash__(self) -> int:
    return self.hash

  def describe_change(self, old: object) -> str | None:
    """The re-trace reason when these settings differ from `old`: each value that changed, by
    its attribute path (`classifier.dense.p`) or where it is read (`Model.config.problem_type`).

    Example:
      >>> layout = (("fc", ("scale",)),)
      >>> Settings(((3.0, True),), layout=layout).describe_change(
      ...     Settings(((2.0, True),), layout=layout))
      'fc.scale 2.0 -> 3.0'
    """
    if not isinstance(old, Settings):
      return None
    changes = []
    if old.layout == self.layout and len(old.values) == len(self.values):
      read = set(self.reads.positions(self.layout)) if self.reads is not None else None
      for i, ((prefix, names), before, after) in enumerate(zip(self.layout, old.values,
                                                                self.values)):
        paths = [f"{prefix}.{name}" if prefix else name for name in (*names, "training")]
        if before is None or after is None:
          if before is not after:
            changes.append(f"{prefix or 'the module'}'s attributes {before} -> {after}")
          continue
        changes += [f"{path} {b!r} -> {a!r}"
                    for j, (path, b, a) in enumerate(zip(paths, before, after))
                    if (read is None or (i, j) in read) and (b != a or type(b) is not type(a))]
    elif old.values != self.values:
      changes.append("its submodules' plain attributes")
    if old.host != self.host:
      named = (self.host_values.describe(old.host, self.host)
               if self.host_values is not None and len(old.host) == len(self.host) else [])
      changes += named or [f"values read from outside the module {old.host!r} -> {self.host!r}"]
    return "; ".join(changes) or None
