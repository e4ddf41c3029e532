"""Traced tensors put where a callable reads its captures, for one traced call (`Scene`).

A place is a path (`reach`): a root, then attribute and item steps. At a closure cell or a global
the value goes into a fresh cell or a copy of the globals dict, and the callable is rebuilt over
them; at a partial's argument, into the argument list the call is made with; in an object's
`__dict__`, a dict or a list, it is swapped in for the call and swapped back after; in a tuple
(immutable), the tuple is rebuilt and put at its own place the same way. The modules passed as
the call's arguments are roots too (`ARG`, `KWARG`): their state is swapped in place.
"""
from __future__ import annotations

import types
from typing import Any, Callable

from torch_xla_jaxbridge._bridge import reach

ARG, KWARG = "argument", "keyword argument"  # roots: a module passed to the call
FRESH = object()  # a place made for the trace (a new cell, a copied globals dict): no restore
# `(name, table, key, old, value)`: a value put at `table[key]` (a dict, a list, a cell's
# `cell_contents`) for one call, and what was there (`FRESH`: nothing to restore)
Placed = tuple[str, Any, Any, object, object]


def swap(placed: list[Placed], name: str, table: Any, key: object, value: object) -> None:
  """Puts `value` at `table[key]` and records `(name, table, key, old, value)` in `placed`.

  Example:
    >>> placed, table = [], {"w": 1}
    >>> swap(placed, "w", table, "w", 2)
    >>> table, placed[0][3]
    ({'w': 2}, 1)
  """
  placed.append((name, table, key, table[key], value))
  table[key] = value


def read(fn: object, where: tuple) -> Any:
  """The value at the place `where` of `fn` (a root key, then steps), now.

  Example:
    >>> import torch
    >>> cfg = types.SimpleNamespace(w=torch.ones(1))
    >>> f = lambda: cfg.w
    >>> read(f, reach.find(f)[0][0][0]) is cfg.w
    True
  """
  return follow(reach.Target(fn).root(where[0]), where[1:])


def follow(value: Any, steps: tuple) -> Any:
  """The value `steps` (`(ATTR, name)`, `(ITEM, key)`, `(BOUND, "__self__")`) lead to from
  `value`.

  Example:
    >>> follow({"a": [5]}, ((reach.ITEM, "a"), (reach.ITEM, 0)))
    5
  """
  for kind, key in steps:
    value = (vars(value)[key] if kind == reach.ATTR else value[key] if kind == reach.ITEM else
             value.__self__)
  return value


class Scene:
  """Where one call of `fn` on `args` / `kwargs` reads its captures: `read` a place, `place`
  traced tensors, `run` the call, `restore` what was swapped.

  Example:
    >>> import torch
    >>> holder = types.SimpleNamespace(pair=(torch.ones(1), 2))
    >>> scene = Scene(lambda: holder.pair[0] * holder.pair[1], (), {})
    >>> scene.place({(("global", "holder"), ("attr", "pair"), ("item", 0)): ("holder.pair[0]",
    ...                                                                    torch.full((1,), 3.0))})
    >>> scene.run((), {}).tolist(), holder.pair[0].tolist()
    ([6.0], [3.0])
    >>> scene.restore(); holder.pair[0].tolist()
    [1.0]
  """

  def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
    self.target = reach.Target(fn)
    function = self.target.function
    self.cells = list(function.__closure__ or ()) if function is not None else []
    # a copy of the function's globals, once a global is placed
    self.scope: dict[str, Any] | None = None
    self.rebind = False  # a cell or global was placed: the function is rebuilt over them
    self.pargs, self.pkw = list(self.target.pargs), dict(self.target.pkw)
    self.args, self.kwargs = args, kwargs
    # (name, table, key, old, value): checked after the call, restored after
    self.placed: list[Placed] = []

  def root(self, key: tuple) -> Any:
    """The value at a root, as this call sees it."""
    kind = key[0]
    if kind == reach.CELL:
      return self.cells[key[1]].cell_contents
    if kind == reach.GLOBAL:
      return (self._function().__globals__ if self.scope is None else self.scope)[key[1]]
    if kind == reach.SELF:
      return self.target.owner
    table: Any = {reach.PARG: self.pargs, reach.PKW: self.pkw, ARG: self.args,
                  KWARG: self.kwargs}[kind]  # a list, a tuple or a dict
    return table[key[1]]

  def _function(self) -> types.FunctionType:
    """The function whose cells and globals are roots (where one is placed, there is one)."""
    function = self.target.function
    assert function is not None, "only a function has cells and globals"
    return function

  def read(self, where: tuple) -> Any:
    """The value at a place."""
    return follow(self.root(where[0]), where[1:])

  def place(self, pending: dict[tuple, tuple[str, Any]]) -> None:
    """Puts each `{where: (name, value)}` of `pending` at its place, the deepest first: a tuple
    with values to put is rebuilt, then put at its own place."""
    while pending:
      depth = max(map(len, pending))
      rebuilt: dict[tuple, tuple[str, Any]] = {}  # tuple's place -> (name, new tuple)
      for where in [w for w in pending if len(w) == depth]:
        name, value = pending.pop(where)
        if depth == 1:
          self._put_at_root(where[0], name, value)
          continue
        parent, (kind, key) = where[:-1], where[-1]
        container = rebuilt[parent][1] if parent in rebuilt else self.read(parent)
        if isinstance(container, tuple):
          items = list(container)
          items[key] = value
          new = type(container)(*items) if hasattr(container, "_fields") else tuple(items)
          rebuilt[parent] = (name[:-len(reach.step_name(where[-1]))], new)
        else:
          swap(self.placed, name, vars(container) if kind == reach.ATTR else container, key, value)
      pending.update(rebuilt)

  def _put_at_root(self, key: tuple, name: str, value: object) -> None:
    kind = key[0]
    if kind == reach.CELL:
      self.cells[key[1]] = types.CellType(value)
      self.placed.append((name, self.cells[key[1]], "cell_contents", FRESH, value))
      self.rebind = True
    elif kind == reach.GLOBAL:
      if self.scope is None:
        self.scope = dict(self._function().__globals__)
      self.scope[key[1]] = value
      self.placed.append((name, self.scope, key[1], FRESH, value))
      self.rebind = True
    else:  # a partial's argument (the call's own arguments are never tensors placed here)
      (self.pargs if kind == reach.PARG else self.pkw)[key[1]] = value

  def run(self, args: tuple, kwargs: dict) -> Any:
    """The call, on the placed values."""
    target = self.target
    args, kwargs = (*self.pargs, *args), {**self.pkw, **kwargs}
    if not self.rebind:
      return target.call(*args, **kwargs)
    function = self._function()
    rebuilt = types.FunctionType(function.__code__, self.scope or function.__globals__,
                                 function.__name__, function.__defaults__, tuple(self.cells))
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    return rebuilt(*args, **kwargs) if target.owner is None else rebuilt(target.owner, *args,
                                                                        **kwargs)

  def keep_assigned_globals(self) -> None:
    """The globals the code assigned in the copied dict (other than the placed ones) set in the
    real one, as the code would have without the copy."""
    if self.scope is None:
      return
    real = self._function().__globals__
    placed = {key for _, table, key, _, _ in self.placed if table is self.scope}
    for key, value in self.scope.items():
      if key not in placed and real.get(key, self.scope) is not value:
        real[key] = value

  def restore(self) -> None:
    """Puts back what was swapped, last first."""
    for _, table, key, old, _ in reversed(self.placed):
      if old is not FRESH:
        table[key] = old
