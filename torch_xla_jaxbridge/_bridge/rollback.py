"""A try at bridging that leaves the host as it found it.

Tracing a region runs its Python code. When the trace fails half-way and the region falls back,
the plain run executes that code again, so whatever the failed try did to the host would be done
twice. Around each try (`Attempt`), the first trace records the host state the region can reach
(`Snapshot`): the global random streams (Python's, NumPy's, torch's CPU and XLA generators), the
attributes of the region's modules and of the objects its code runs on, the globals and closure
cells its code names, and the contents of the lists, dicts and sets found there (one level deep).
A fallback restores it before the plain run; a trace run again within one call (a second trace
with a fresh random key) starts from it too. What the code does through anything else (files,
printing, logging, objects reached deeper) is not recorded: docs/bridge.md says so.

A trace that succeeds but drew from Python's or NumPy's global random stream cannot be replayed
(each call would draw new numbers): `tracing` raises `HostRandomnessError`, and the region falls
back as for any failed trace.
"""
from __future__ import annotations

import collections
import contextvars
import random
import types
from typing import Any, Callable, Iterable, Iterator, Literal

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import reach
from torch_xla_jaxbridge._core import code_names

_OPEN: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar("bridge_attempt",
                                                                    default=None)
_CONTAINERS = (list, dict, set, collections.deque)


class Snapshot:
  """What a region's code can change on the host, as it is now; `restore()` puts it back.

  Example:
    >>> import random
    >>> seen = []
    >>> def noisy():
    ...   seen.append(random.random())
    >>> snapshot = Snapshot([], [noisy])
    >>> noisy()
    >>> drawn = list(seen)
    >>> snapshot.restore()
    >>> len(seen)
    0
    >>> noisy()
    >>> seen == drawn  # the same draw again
    True
  """

  def __init__(self, modules: Iterable[torch.nn.Module], functions: Iterable[Callable]) -> None:
    self.streams = _random_streams()
    objects: dict[int, Any] = {id(sub): sub for module in modules for sub in module.modules()}
    forwards = {type(sub).forward for sub in objects.values()}
    bindings: dict[tuple[int, object], tuple[Any, Any]] = {}
    for fn in [*functions, *forwards]:
      target = reach.Target(fn)
      for obj in _objects_of(target):
        objects.setdefault(id(obj), obj)
      for place in _bindings_of(target.function):
        bindings.setdefault((id(place[0]), place[1]), place)
    self.attributes = [(obj, dict(vars(obj))) for obj in objects.values()]
    self.bindings = [(scope, name, scope.get(name, _ABSENT) if isinstance(scope, dict)
                      else _cell_value(scope)) for scope, name in bindings.values()]
    values = [v for _, attrs in self.attributes for v in attrs.values()]
    values += [v for _, _, v in self.bindings]
    self.contents = {id(v): (v, _copy(v)) for v in values if isinstance(v, _CONTAINERS)}
    self.generators = {id(v): (v, state) for v in values
                       if (state := _generator_state(v)) is not None}

  def restore(self) -> None:
    """Puts back every recorded value (it may be called more than once)."""
    _set_random_streams(self.streams)
    for obj, attrs in self.attributes:
      vars(obj).clear()
      vars(obj).update(attrs)
    for scope, name, value in self.bindings:
      if isinstance(scope, dict):
        if value is _ABSENT:
          scope.pop(name, None)
        else:
          scope[name] = value
      elif value is not _ABSENT:
        scope.cell_contents = value
    for container, saved in self.contents.values():
      _put_back(container, saved)
    for generator, state in self.generators.values():
      _set_generator_state(generator, state)


class Attempt:
  """The context of one try at running a region bridged: traces inside it start from the host
  state found at its first trace; `roll_back()` (when the region falls back) restores that state.
  `reach()` gives the region's `(modules, functions)`, asked for only when a trace runs.

  Example:
    >>> import random
    >>> with Attempt(lambda: ((), ())) as attempt:
    ...   try:
    ...     with tracing():
    ...       first = random.random()
    ...   except errors.HostRandomnessError:  # a trace that draws cannot be replayed
    ...     attempt.roll_back()
    >>> random.random() == first
    True
  """

  def __init__(self, reach_: Callable[[], tuple]) -> None:
    self.reach = reach_
    self.snapshot: Snapshot | None = None
    self.depth = 0
    self.token: contextvars.Token[Attempt | None] | None = None

  def __enter__(self) -> Attempt:
    outer = _OPEN.get()
    if outer is None or outer.depth == 0:  # inside a trace the enclosing try covers it
      self.token = _OPEN.set(self)
    return self

  def __exit__(self, *exc: object) -> Literal[False]:
    if self.token is not None:
      _OPEN.reset(self.token)
    return False

  def roll_back(self) -> None:
    """Restores the host state of the first trace (nothing when no trace ran)."""
    if self.snapshot is not None:
      self.snapshot.restore()


def attempt(run: Callable[[], object], region: Callable[[], tuple],
            fall_back: Callable[[Exception], None]) -> tuple:
  """`(True, run())`; or, when `run()` raises and `fall_back(exc)` returns (it re-raises what may
  not fall back), `(False, None)` with the host as the first trace found it. `region()`: what
  `Attempt` records.

  Example:
    >>> attempt(lambda: 1, lambda: ((), ()), print)
    (True, 1)
    >>> attempt(lambda: 1 / 0, lambda: ((), ()), print)
    division by zero
    (False, None)
  """
  with Attempt(region) as tried:
    try:
      return True, run()
    except Exception as e:  # noqa: BLE001  (`fall_back` re-raises what may not fall back)
      fall_back(e)
      tried.roll_back()  # the plain run starts where the failed try started
  return False, None


class tracing:  # noqa: N801  (a context manager, used as a function)
  """Around a trace of torch code: the first trace of the open `Attempt` records the host state,
  each later one starts from it. Traces inside traces are covered by the outermost. A trace that
  draws from Python's or NumPy's global random stream (its state differs after the trace) raises
  `HostRandomnessError`: a cached trace would replay its numbers at every call, where plain code
  draws new ones (`name`: the traced function's, for the message).

  Example:
    >>> import random
    >>> try:
    ...   with tracing("coin"):
    ...     _ = random.random()
    ... except errors.HostRandomnessError as e:
    ...   print(str(e)[:41])
    coin draws Python random numbers (random)
  """

  def __init__(self, name: str = "bridged code") -> None:
    self.name = name

  def __enter__(self) -> tracing:
    self.attempt = attempt = _OPEN.get()
    if attempt is not None:
      if attempt.depth == 0:
        if attempt.snapshot is None:
          attempt.snapshot = Snapshot(*attempt.reach())
        else:
          attempt.snapshot.restore()
      attempt.depth += 1
    self.streams = _host_streams()
    return self

  def __exit__(self, kind: type | None, *exc: object) -> Literal[False]:
    if self.attempt is not None:
      self.attempt.depth -= 1
    drawn = _drawn(self.streams, _host_streams()) if kind is None else []
    if drawn:
      raise errors.HostRandomnessError(
          f"{self.name} draws {' and '.join(drawn)} on the host: each call would need its own "
          f"trace (a cached trace would replay the same numbers). Draw them with torch inside "
          f"bridged code (torch.rand, torch.randint, torch.bernoulli: fresh at every call), or "
          f"pass them in as a tensor argument.")
    return False


def region_of(fn: Callable, args: tuple = (), kwargs: dict | None = None) -> tuple:
  """`(modules, functions)` of a call of the bridged function `fn`: the modules it reads (closure,
  globals, `self`, partial arguments) or is given (`args`, `kwargs`), and `fn`'s own code.

  Example:
    >>> layer = torch.nn.Linear(1, 1)
    >>> found, functions = region_of(lambda x: layer(x))
    >>> found == [layer], len(functions)
    (True, 1)
  """
  _, values = reach.find(fn)
  given = [*args, *(kwargs or {}).values()]
  return [v for v in [*values, *given] if isinstance(v, torch.nn.Module)], [fn]


_ABSENT = object()


def _cell_value(cell: types.CellType) -> object:
  try:
    return cell.cell_contents
  except ValueError:  # an empty cell
    return _ABSENT


def _objects_of(target: reach.Target) -> Iterator[object]:
  """The objects a callable runs on (`self` of a method or callable object, a partial's
  arguments), from its `reach.Target`."""
  for obj in (target.owner, *target.pargs, *target.pkw.values()):
    if obj is not None and hasattr(obj, "__dict__") and not isinstance(obj, type):
      yield obj


def _bindings_of(function: object) -> Iterator[tuple[Any, Any]]:
  """`(scope, name)` of every global (`scope` the globals dict) and closure cell (`scope` the
  cell, `name` its index) the code of `function` (and what it wraps) reads."""
  while isinstance(function, types.FunctionType):
    for name in code_names.global_names(function.__code__):
      yield function.__globals__, name
    for index, cell in enumerate(function.__closure__ or ()):
      yield cell, index
    function = getattr(function, "__wrapped__", None)


def _copy(container: Any) -> Any:
  return type(container).copy(container) if not isinstance(container, collections.deque) \
      else collections.deque(container)


def _put_back(container: Any, saved: Any) -> None:
  if isinstance(container, dict):
    container.clear()
    container.update(saved)
  elif isinstance(container, set):
    container.clear()
    container |= saved
  else:
    container.clear()
    container.extend(saved)


def _generator_state(value: Any) -> object:
  """The state of a random generator object (`random.Random`, NumPy's `Generator` and
  `RandomState`, `torch.Generator`), or None for other values."""
  if isinstance(value, random.Random):
    return value.getstate()
  if isinstance(value, torch.Generator):
    return value.get_state()
  kind = type(value).__name__
  if kind == "Generator" and type(value).__module__.startswith("numpy"):
    return value.bit_generator.state
  if kind == "RandomState" and type(value).__module__.startswith("numpy"):
    return value.get_state()
  return None


def _set_generator_state(value: Any, state: Any) -> None:
  if isinstance(value, random.Random):
    value.setstate(state)
  elif isinstance(value, torch.Generator):
    value.set_state(state)
  elif type(value).__name__ == "Generator":
    value.bit_generator.state = state
  else:
    value.set_state(state)


def _host_streams() -> tuple:
  """The states of Python's and NumPy's global random streams (what a trace must not draw from)."""
  import numpy

  return random.getstate(), numpy.random.get_state()


def _drawn(before: tuple, after: tuple) -> list[str]:
  """What was drawn between two `_host_streams()`: a phrase per stream whose state changed."""
  (python, numpy_before), (python_after, numpy_after) = before, after
  numpy_same = (numpy_before[0] == numpy_after[0] and (numpy_before[1] == numpy_after[1]).all()
                and numpy_before[2:] == numpy_after[2:])
  return ((["Python random numbers (random)"] if python != python_after else [])
          + ([] if numpy_same else ["NumPy random numbers (numpy.random)"]))


def _random_streams() -> tuple:
  """The global random streams: Python's, NumPy's, torch's CPU generator and the XLA device's."""
  import torch_xla.core.xla_model as xm

  return (*_host_streams(), torch.get_rng_state(), xm.get_rng_state())


def _set_random_streams(streams: tuple) -> None:
  import numpy
  import torch_xla.core.xla_model as xm

  python, numpy_state, torch_state, xla_seed = streams
  random.setstate(python)
  numpy.random.set_state(numpy_state)
  torch.set_rng_state(torch_state)
  # setting the XLA seed, even to its current value, drops the step's pending seed updates (the
  # draws made since the last sync) and so changes every later step's numbers: only a changed
  # seed is put back (a bridged trace draws no XLA numbers, so it normally is not)
  if xm.get_rng_state() != xla_seed:
    xm.set_rng_state(xla_seed)
