"""Captured tensors lifted: what a bridged function reads besides its arguments becomes an input.

A bridged function may read tensors and modules from its enclosing scope (closure cells), from
its module's globals, from `self` (a bound method of any object, a module, a callable object), from
a `functools.partial`'s arguments, and from the plain objects, dicts, lists and tuples these hold
(`reach`: a trainer object's `model`, a dict of models); a module may also be passed as an
argument. At each call `collect` reads them where they are now and returns them as a `Lifted`
pytree, which the bridged call passes as one more argument: captured tensors are inputs of the
trace (a tensor that requires grad is differentiable, a tensor replaced or updated between calls is
read fresh), and where they were found is part of the signature. While the trace runs, `calling`
puts the traced tensors where the code reads the captured ones (`places`), and the traced
parameters and buffers in place of a captured module's own.

What is not lifted (a tensor read by a helper function's own closure, reached through an object
without `__dict__`, deeper than `reach.DEPTH`) is still refused with `CapturedTensorError`, which
`hint` completes with where the search stopped.
"""
from __future__ import annotations

import itertools
import types
import weakref
from typing import Any, Callable, Sequence

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import places, reach
from torch_xla_jaxbridge._bridge.places import ARG, KWARG
from torch_xla_jaxbridge._bridge.reach import SELF
from torch_xla_jaxbridge._core import host_values, hooks, modules, runtime, threads, tracing

# `(where, name, kind, params, buffers, extra)`: one captured value (see `Lifted`)
LayoutEntry = tuple[tuple, str, str, tuple[str, ...], tuple[str, ...], Any]


class CapturedKey:
  """A lifted tensor's key in the `Lifted` pytree: read as ` (captured <name>)` in paths."""
  __slots__ = ("name",)

  def __init__(self, name: str) -> None:
    self.name = name

  def __str__(self) -> str:
    return f" (captured {self.name})"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, CapturedKey) and other.name == self.name

  def __hash__(self) -> int:
    return hash(self.name)


class Lifted:
  """The captured tensors of one call, and where each was found (the static layout).

  `layout` holds one entry per captured value: `(where, name, kind, params, buffers, extra)`,
  `where` its place (`reach`: a root such as `(CELL, index)`, `(GLOBAL, name)`, `(SELF,)`, then
  `(ATTR, name)` / `(ITEM, key)` steps), `kind` "tensor", "module" or "value" (a plain value
  the code reads, its type and value as `extra`, so that a new value traces again); a module's
  `params`/`buffers` are its state names and `extra` its identity token, training modes and
  settings (`modules.StateWalk.settings`).
  Equal layouts (and tensor signatures) share a trace.

  Example:
    >>> lifted = Lifted((torch.ones(2),), ((((reach.GLOBAL, "w"),), "w", "tensor", (), (), None),))
    >>> lifted.names()
    ['w']
  """
  __slots__ = ("tensors", "layout")

  def __init__(self, tensors: Sequence[Any], layout: tuple[LayoutEntry, ...]) -> None:
    self.tensors = tuple(tensors)
    self.layout = layout

  def names(self) -> list[str]:
    """A readable name per tensor: `w`, `self.scale`, `model.fc.weight`."""
    names = []
    for _, name, kind, params, buffers, _ in self.layout:
      if kind == "tensor":
        names.append(name)
      elif kind == "module":
        names.extend(f"{name}.{n}" for n in params + buffers)
    return names

  def __repr__(self) -> str:
    return f"Lifted({', '.join(self.names())})"


def describe_change(old: tuple[LayoutEntry, ...], new: tuple[LayoutEntry, ...]) -> str | None:
  """The re-trace reason when a `Lifted`'s layout is `new` instead of `old`: which captured
  value, module or module setting differs (None: the same layouts).

  Example:
    >>> describe_change(((((reach.GLOBAL, "n"),), "n", "value", (), (), (int, 2)),),
    ...                 ((((reach.GLOBAL, "n"),), "n", "value", (), (), (int, 3)),))
    'n 2 -> 3'
  """
  if len(old) != len(new) or any(a[:3] != b[:3] for a, b in zip(old, new)):
    return (f"captured {', '.join(e[1] for e in old) or 'nothing'} -> "
            f"{', '.join(e[1] for e in new) or 'nothing'}")
  changes = []
  for (_, name, kind, params, buffers, extra), (*_, new_params, new_buffers, new_extra) in zip(
      old, new):
    if (params, buffers) != (new_params, new_buffers):
      changes.append(f"{name}'s parameters or buffers (their names)")
    if extra == new_extra:
      continue
    if kind != "module":
      changes.append(f"{name} {extra[1]!r} -> {new_extra[1]!r}" if extra and new_extra else
                     f"{name} changed")
      continue
    (token, training, settings), (new_token, new_training, new_settings) = extra, new_extra
    if token != new_token:
      changes.append(f"{name} is another module")
    if training != new_training:
      changes.append(f"{name}'s training modes")
    if settings != new_settings:
      described = new_settings.describe_change(settings)
      changes.append(f"{name}: {described}" if described else f"{name}'s settings")
  return "; ".join(changes) or None


@threads.once
def _register_pytree() -> None:
  jax = runtime.jax_module()
  jax.tree_util.register_pytree_with_keys(
      Lifted, lambda l: ([(CapturedKey(n), t) for n, t in zip(l.names(), l.tensors)], l.layout),
      lambda layout, tensors: Lifted(tensors, layout),
      flatten_func=lambda l: (l.tensors, l.layout))


# module -> (identity token, StateWalk)
_TOKENS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, modules.StateWalk]] = (
    weakref.WeakKeyDictionary())
_COUNTER = itertools.count()


def _module_state(module: torch.nn.Module, name: str, refuse_hooks: bool) -> tuple:
  entry = _TOKENS.get(module)
  if entry is None:
    entry = _TOKENS[module] = (next(_COUNTER), modules.StateWalk(module))
  token, walk = entry
  state = walk.state()
  if refuse_hooks and (hooked := hooks.hooked(walk, name, itself=True)) is not None:
    raise errors.HookError(
        f"{hooked}; hooks run at every call, so while it does, the code reading `{name}` runs "
        f"as plain LazyTensor code with its modules bridged one by one and the hooked ones "
        f"outside the bridged calls (a trace would run a hook once).")
  return (token,) + state + (walk.settings(),)


def _direct(where: tuple) -> bool:
  """Whether a place is one where captures were always read: a cell, a global, a partial's
  argument, `self` or an attribute of `self`."""
  return len(where) == 1 or (len(where) == 2 and where[0] == (SELF,))


def _with_module_arguments(places: Sequence[tuple], values: Sequence[object], args: tuple,
                           kwargs: dict | None) -> tuple[list[tuple], list[object]]:
  """`places`, `values` and the modules passed as arguments (not already among `values`)."""
  seen = {id(value) for value in values}
  given: list[tuple[tuple, str, object]] = [((ARG, i), f"args[{i}]", a) for i, a in enumerate(args)]
  given += [((KWARG, k), f"kwargs[{k!r}]", v) for k, v in (kwargs or {}).items()]
  pairs = [(((key,), name), value) for key, name, value in given
           if isinstance(value, torch.nn.Module) and id(value) not in seen]
  return list(places) + [p for p, _ in pairs], list(values) + [v for _, v in pairs]


def collect(fn: Callable, fn_name: str, *, xla: bool = True, args: tuple = (),
            kwargs: dict | None = None, refuse_hooks: bool = False) -> Lifted | None:
  """The tensors and modules `fn` reads from its closure, its globals, `self`, its partial's
  arguments and the objects they hold (`reach.find`), and the modules among `args` / `kwargs`,
  as they are now; None when there are none. With `xla`, a tensor found at a cell, global,
  partial argument or attribute of `self` that is not an XLA tensor is an error naming it (one
  found deeper is left out, and `hint` names it). With `refuse_hooks`, a module holding a hook
  (itself or a submodule, `_core.hooks`) is an `errors.HookError`: the caller falls back.

  Example:
    >>> w = torch.ones(3)
    >>> collect(lambda x: x * w, "f", xla=False)
    Lifted(w)
  """
  places, values, plain = reach.find_all(fn)
  if args or kwargs:
    places, values = _with_module_arguments(places, values, args, kwargs)
  function = reach.split(fn)[0]
  host = host_values.of_callable(function) if function is not None else None
  if not places and not plain and not (host and host.readers):
    return None
  _register_pytree()
  # the plain values the code reads, in the layout (so in the cache key): a new value retraces
  tensors: list[torch.Tensor] = []
  layout: list[LayoutEntry] = [((), name, "value", (), (), (kind, value))
                               for name, kind, value in plain]
  if host and host.readers:  # read by the helpers it calls, its environment variables
    layout.append(((), "host values", "value", (), (), (tuple, host.read())))
  for (where, name), value in zip(places, values):
    if isinstance(value, torch.Tensor):
      tensors.append(value)
      layout.append((where, name, "tensor", (), (), None))
    else:
      token, params, buffers, training, settings = _module_state(value, name, refuse_hooks)
      tensors.extend(params.values())
      tensors.extend(buffers.values())
      layout.append((where, name, "module", tuple(params), tuple(buffers),
                     (token, training, settings)))
  lifted = Lifted(tensors, tuple(layout))
  if xla and not all([t.is_xla for t in tensors]):  # type: ignore[attr-defined]  # stubs
    return _on_xla(lifted, fn_name)
  return lifted


def _on_xla(lifted: Lifted, fn_name: str) -> Lifted | None:
  """`lifted` less the tensors not on the XLA device found below a cell, global, partial
  argument or attribute of `self` (`hint` names them); one found there is an error naming it."""
  tensors: list[torch.Tensor] = []
  layout: list[LayoutEntry] = []
  at = 0
  for entry in lifted.layout:
    where, _, kind, params, buffers, _ = entry
    own = lifted.tensors[at:at + (1 if kind == "tensor" else len(params) + len(buffers))]
    at += len(own)
    if kind != "tensor" or own[0].is_xla or _direct(where):
      tensors.extend(own)
      layout.append(entry)
  kept = Lifted(tensors, tuple(layout)) if layout else None
  for name, tensor in zip(kept.names(), kept.tensors) if kept else ():
    if not tensor.is_xla:
      raise errors.BadArgumentError(
          f"{fn_name} reads `{name}` (a {tensor.device.type} tensor of shape "
          f"{tuple(tensor.shape)}) from outside its arguments; bridged code runs on XLA "
          f"tensors. Move it with `.to('xla')` (a module: `module.to('xla')`).")
  return kept


def hint(fn: Callable) -> str:
  """A sentence naming where the search for `fn`'s captures stopped (`reach.notes`) and the
  tensors it left out for not being on the XLA device; empty when there are none.

  Example:
    >>> import types
    >>> cfg = types.SimpleNamespace(w=torch.ones(2))
    >>> hint(lambda: cfg.w).split(" (")[0]
    ' The search for captured tensors stopped at `cfg.w`'
  """
  stops = reach.notes(fn) + [
      f"`{name}` (a {value.device.type} tensor, not lifted: move it with `.to('xla')`)"
      for (where, name), value in zip(*reach.find(fn))
      if isinstance(value, torch.Tensor)
      and not value.is_xla and not _direct(where)]  # type: ignore[attr-defined]  # stubs
  if not stops:
    return ""
  more = f"; and {len(stops) - 5} more" if len(stops) > 5 else ""
  return f" The search for captured tensors stopped at {'; '.join(stops[:5])}{more}."


def collect_for_call(fn: Callable, fn_name: str, arguments: object) -> Lifted | None:
  """`collect(fn, fn_name)` for a call of `fn` on `arguments`; None when the arguments are traced
  (a call inside bridged code: `fn` reads the enclosing trace's tensors where they are).

  Example:
    >>> w = torch.ones(3, device="xla")
    >>> collect_for_call(lambda x: x * w, "f", (torch.ones(3, device="xla"),))
    Lifted(w)
  """
  leaves = runtime.jax_module().tree.leaves(arguments)
  if any(isinstance(leaf, torch.Tensor) and tracing.is_traced(leaf) for leaf in leaves):
    return None
  return collect(fn, fn_name)


def with_captures(fn: Callable, fn_name: str, args: tuple, kwargs: dict | None = None, *,
                  xla: bool = True, refuse_hooks: bool = False) -> tuple:
  """`args` with what `fn` captures and the modules among its arguments (`collect`) put first, or
  `args` when there are none.

  Example:
    >>> with_captures(torch.sin, "sin", (1,))
    (1,)
  """
  lifted = collect(fn, fn_name, xla=xla, args=args, kwargs=kwargs, refuse_hooks=refuse_hooks)
  return args if lifted is None else (lifted, *args)


def calling(fn: Callable, args: tuple) -> Callable:
  """What runs `fn` on arguments made by `with_captures`: `fn` itself when `args` holds no
  captures, else a function that takes them off and runs `fn` with the (traced) captured tensors
  put where `fn` reads them.

  Example:
    >>> calling(torch.sin, (1,)) is torch.sin
    True
  """
  if not (args and isinstance(args[0], Lifted)):
    return fn
  return lambda lifted, *a, **k: _call_with(fn, lifted, a, k)


def call_with(fn: Callable, lifted: Lifted | None, args: tuple, kwargs: dict) -> object:
  """`fn(*args, **kwargs)` with `lifted` (what `collect(fn, ...)` returned, its tensors now
  traced) put where `fn` reads them; a plain call when `lifted` is None. For a bridged function
  that runs `fn` itself and passes `fn`'s captures as an argument of its own.

  Example:
    >>> w = torch.ones(2)
    >>> f = lambda x: x * w
    >>> call_with(f, Lifted((torch.full((2,), 3.0),), collect(f, "f", xla=False).layout),
    ...           (torch.ones(2),), {}).tolist()
    [3.0, 3.0]
  """
  return fn(*args, **kwargs) if lifted is None else _call_with(fn, lifted, args, kwargs)


def _call_with(fn: Callable, lifted: Lifted, args: tuple, kwargs: dict) -> object:
  scene = places.Scene(fn, args, kwargs)
  tensors = iter(lifted.tensors)
  pending: dict[tuple, tuple[str, Any]] = {}  # where -> (name, traced tensor)
  try:
    for where, name, kind, params, buffers, _ in lifted.layout:
      if kind == "tensor":
        pending[where] = (name, next(tensors))
        continue
      if kind == "value":  # read by the code where it is
        continue
      module = scene.read(where)
      for full in params + buffers:
        prefix, _, leaf = full.rpartition(".")
        places.swap(scene.placed, f"{name}.{full}",
                    modules.holding_table(module.get_submodule(prefix), leaf), leaf,
                    next(tensors))
    scene.place(pending)
    outputs = scene.run(args, kwargs)
    _check_not_reassigned(fn, scene.placed)
    scene.keep_assigned_globals()
    return outputs
  finally:
    scene.restore()


def _check_not_reassigned(fn: Callable, placed: list[places.Placed]) -> None:
  for name, table, key, _, value in placed:
    try:
      now = table.cell_contents if isinstance(table, types.CellType) else table[key]
    except (KeyError, IndexError):  # deleted
      now = None
    if now is not value:
      fn_name = getattr(fn, "__name__", type(fn).__name__)
      raise errors.MutationError(
          f"{fn_name}: the bridged code assigned a new value to the captured `{name}`; an "
          f"assignment inside a trace cannot reach the captured tensor. Update it in place "
          f"(`{name}.copy_(new)`) or return the new value and assign it after the call.")


def read_capture(fn: Callable, where: tuple) -> Any:
  """The value `fn` reads at the place `where` of a `Lifted` layout entry (a closure cell, a
  global, `self`, a partial's argument, and the attributes and items below it).

  Example:
    >>> w = torch.ones(1)
    >>> f = lambda: w
    >>> read_capture(f, collect(f, "f", xla=False).layout[0][0]) is w
    True
  """
  return places.read(fn, where)
