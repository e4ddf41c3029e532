"""Module hooks a trace would freeze: which submodule of a walked module holds one now.

A forward, forward pre- or backward hook is a user callback that runs at every call of its
module. Traced, it would run once (when the trace is made) and its effect would be baked into the
cached program; so a bridged region whose modules hold hooks runs that call outside the trace,
where each hook runs on real tensors (`_bridge.auto`, `_bridge.captures`). Read per call from the
hook dicts of the submodules a `modules.StateWalk` already knows, and torch's global module
hooks: a few dictionary reads a submodule.
"""
from __future__ import annotations

from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import modules


_GLOBAL = torch_private.global_hook_tables()  # the live dicts: read, never replaced, by torch


def hooked(walk: modules.StateWalk, name: str, itself: bool = False) -> str | None:
  """Which of the walked module's strict descendants (`itself`: and the module too) holds a
  hook now, and of what kind, as a phrase for a fallback reason (the module called `name`);
  None when none does (hooks marked `traceable = True`, the package's own, aside). A global
  module hook is on every module. Read from `walk.entries`: call
  it after `walk.state()`.

  Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1))
    >>> walk = modules.StateWalk(net)
    >>> hooked(walk, "net") is None
    True
    >>> _ = net[0].register_forward_hook(lambda m, i, o: None)
    >>> hooked(walk, "net")
    '`net.0` holds a forward hook'
  """
  entries = walk.entries
  start = 0 if itself else 1
  if len(entries) <= start:
    return None
  has_hooks, tables = torch_private.has_hooks, torch_private.hook_tables
  for i in range(start, len(entries)):
    sub = entries[i][1]()
    if sub is not None and has_hooks(sub) and not _traceable(tables(sub)):
      path = entries[i][0][:-1]
      where = f"{name}.{path}" if path else name
      return f"`{where}` holds {_kinds(tables(sub))}"
  if any(_GLOBAL):
    return f"every module holds {_kinds(_GLOBAL)} (a global hook)"
  return None


def _traceable(tables: tuple[dict, ...]) -> bool:
  """Whether every hook of `tables` may run in a trace: the package's own, marked
  `traceable = True` (they set Python state before a call, no tensor work)."""
  return all(getattr(hook, "traceable", False) for table in tables for hook in table.values())


def _kinds(tables: tuple[dict, ...]) -> str:
  """`a forward hook`, `a forward pre-hook and a backward hook`: the kinds of the non-empty
  tables."""
  kinds = [kind for kind, table in zip(torch_private.HOOK_KINDS, tables) if table]
  return " and ".join(f"a {kind}" for kind in kinds)
