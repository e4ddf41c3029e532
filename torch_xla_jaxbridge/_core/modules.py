"""What a module's forward depends on besides its inputs: its state, its structure, its modes.

Bridged modules, layer stacks and `jaxify` all read a module through these: `StateWalk` (the
current parameters and buffers by name, without walking the tree each call),
`attribute_differences` (when two layers may share a scan)
and `Calling` (which module a function shared by a structure runs, holding none of them).
"""
import functools
import operator
import threading
import weakref
from typing import Any, Callable, Iterable, TypeVar

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import host_values, plain
from torch_xla_jaxbridge._core.settings_key import LAYOUTS, ReadSettings, Settings

# set by torch.nn.Module itself; the forward reads none of them (hooks aside, see attributes)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"training"}
_T = TypeVar("_T")


def own_attributes(module: torch.nn.Module) -> list[tuple[str, Any]]:
  """`(name, value)` of a module's own attributes, sorted, without torch's bookkeeping (and the
  bridge's own `forward`).

  Example:
    >>> own_attributes(torch.nn.Linear(2, 3))
    [('in_features', 2), ('out_features', 3)]
  """
  return sorted((k, v) for k, v in vars(module).items()
                if k not in _MODULE_INTERNALS and not isinstance(v, BridgedForward))


# the plain values of a module's attributes that a trace reads as they are: a change retraces
SETTINGS = (bool, int, float, complex, str)
Tensors = dict[str, torch.Tensor]  # tensors by full name
ModuleState = tuple[Tensors, Tensors, tuple[bool, ...]]  # (params, buffers, training): `state()`


def _setting_names(module: torch.nn.Module) -> tuple[str, ...]:
  """The names of a module's own attributes holding plain values (numbers, strings), sorted."""
  return tuple(k for k, v in own_attributes(module) if type(v) in SETTINGS)


class BridgedForward(functools.partial):
  """A module's `forward` replaced by the bridge's (`jb.bridge_modules`): not an attribute that
  decides what the module computes (its class's forward does)."""


def module_forward(module: torch.nn.Module, params: Tensors, buffers: Tensors,
                   training: Iterable[bool], args: tuple, kwargs: dict | None,
                   hooks: bool = True) -> Any:
  """Runs `module(*args, **kwargs)` with the given parameters, buffers and per-submodule training
  modes (in `module.modules()` order), restoring the modes after. Without `hooks`, the module's
  class `forward` is called directly (no hooks, not a `forward` set on the instance).

  Example:
    >>> lin = torch.nn.Linear(2, 3)
    >>> params, buffers, training = module_state(lin)
    >>> module_forward(lin, params, buffers, training, (torch.ones(2),), {}).shape
    torch.Size([3])
  """
  subs = list(module.modules())
  before = [sub.training for sub in subs]
  try:
    for sub, mode in zip(subs, training):
      sub.training = mode
    with torch_private.reparametrized(module, {**params, **buffers}):
      if hooks:
        out = module(*args, **(kwargs or {}))
      else:
        out = type(module).forward(module, *args, **(kwargs or {}))
      _check_attributes_kept(module, buffers)
      return out
  finally:
    for sub, mode in zip(subs, before):
      sub.training = mode


def _check_attributes_kept(module: torch.nn.Module, buffers: Tensors) -> None:
  """A forward that assigned a new tensor to a plain tensor attribute it was given: the
  assignment would be undone with the module's state, so it is an error (the region falls back,
  and the plain run keeps it)."""
  for full, given in buffers.items():
    prefix, _, leaf = full.rpartition(".")
    sub = module.get_submodule(prefix)
    table = holding_table(sub, leaf)
    if table is vars(sub) and table.get(leaf) is not given:
      raise errors.MutationError(
          f"{type(module).__name__}: its forward assigned a new value to the tensor attribute "
          f"`{full}`, which the bridged call reads as an input; the assignment cannot leave the "
          f"trace. Update it in place (`.copy_(new)`), register it as a buffer, or return it.")


class Calling:
  """Which module a function shared by structurally identical modules runs: the caller names it
  for each call (`shared.run_for(module, fn, ...)`, per thread), so the shared function, and the
  traces cached for it, hold none of the modules; each call runs its own module.

  Example:
    >>> shared, layer = Calling(), torch.nn.Linear(2, 2)
    >>> shared.run_for(layer, lambda: shared.module() is layer)
    True
  """
  __slots__ = ("_local",)

  def __init__(self) -> None:
    self._local = threading.local()

  def run_for(self, module: torch.nn.Module, fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)`, with `module()` giving `module` meanwhile (in this thread)."""
    local = self._local
    before = getattr(local, "module", None)
    local.module = module
    try:
      return fn(*args)
    finally:
      local.module = before

  def module(self) -> torch.nn.Module:
    """The module of the innermost `run_for` of this thread."""
    found = getattr(self._local, "module", None)
    if found is None:
      raise RuntimeError("a forward shared by a module structure ran outside `run_for(module)`")
    return found


class StateWalk:
  """Where a module's parameters and buffers live, so each call reads the current tensors without
  walking the module tree (a large share of a bridged call's host time, docs/performance.md). The
  walk is redone when any submodule's parameter, buffer or submodule entries change.

  Example:
    >>> layer = torch.nn.Linear(2, 3)  # held weakly by the walk: keep a reference
    >>> params, buffers, training = StateWalk(layer).state()
    >>> sorted(params)
    ['bias', 'weight']
  """

  def __init__(self, module: torch.nn.Module) -> None:
    self.module = weakref.ref(module)  # weak: a cache of walks keyed by module lets it go
    self.walks = 0  # how many times the module was walked (a new walk: its layout changed)
    self._walk()

  def _walk(self) -> None:
    self.walks += 1
    # a submodule used at two paths is one place: its tensors go in once, under its first path
    module = self.module()
    assert module is not None, "walked after its module died"
    named = list(module.named_modules())
    # everything weak (submodules, and children by id: a dead one's own entry says it changed),
    # so a walk kept as a weak dictionary's value never keeps its key alive
    self.entries = [(f"{prefix}." if prefix else "", weakref.ref(sub),
                     tuple(torch_private.parameters_table(sub)),
                     tuple(torch_private.buffers_table(sub)), _tensor_attributes(sub),
                     *_children(sub))
                    for prefix, sub in named]
    # the submodules holding plain values, and a reader of them (with `training`, always there,
    # so that it reads a tuple): `settings()`
    with_settings = [(prefix, sub, names) for prefix, sub in named
                     if (names := _setting_names(sub))]
    self.setting_readers = [(weakref.ref(sub), operator.itemgetter(*names, "training"))
                            for _, sub, names in with_settings]
    layout = tuple((prefix, names) for prefix, _, names in with_settings)
    self.layout = LAYOUTS.setdefault(layout, layout)
    # globals, class attributes and environment variables the forwards read: in `settings()`
    self.host = host_values.of_modules(sub for _, sub in named)
    self.last_settings = Settings(())  # replaced at the first `settings()`
    self.last_values: list | None = None
    self.last_host: tuple | None = None

  def settings(self, reads: ReadSettings | None = None) -> Settings:
    """The plain values (numbers, strings) the module's submodules hold as attributes now: what
    a trace read as constants, so a call whose settings differ traces again (`self.scale = 3.0`
    after a call with 2.0), with the globals, class attributes and environment variables their
    forwards read (`host_values`). Unchanged values give the same object (its hash kept), so a call
    costs one read per submodule. Attributes set after the walk are not in it (`state()` walks
    again when parameters, buffers or submodules change), nor a change of type alone (`1` to
    `1.0`). With `reads`, only the values read count (`ReadSettings`).

    Example:
      >>> layer = torch.nn.Linear(2, 3)
      >>> walk = StateWalk(layer)
      >>> walk.settings().values, walk.settings() is walk.settings()
      (((2, 3, True),), True)
    """
    values = []
    for ref, read in self.setting_readers:
      sub = ref()
      try:
        values.append(read(vars(sub)) if sub is not None else None)
      except KeyError:  # an attribute deleted
        values.append(None)
    host = self.host.read()
    if (values != self.last_values or host != self.last_host
        or reads is not self.last_settings.reads):
      self.last_values, self.last_host = values, host
      self.last_settings = Settings(tuple(values), reads, self.layout, host, self.host)
    return self.last_settings

  def state(self) -> ModuleState:
    """`(params, buffers, training)`: tensors by full name and each submodule's mode. A parameter
    tied between two submodules is passed under both names (its gradient sums over the uses in
    torch's backward)."""
    found = self._read()
    if found is None:  # a parameter, buffer or submodule entry changed: walk again
      self._walk()
      found = self._read()
      assert found is not None, "a fresh walk reads its module"
    return found

  def _read(self) -> ModuleState | None:
    """`state()` from the walk, or None where a submodule's entries are not the walk's (read in
    the same pass: a step's host time grows with the submodules)."""
    params, buffers, training = {}, {}, []
    parameters_table, buffers_table = torch_private.parameters_table, torch_private.buffers_table
    children_table = torch_private.children_table
    for prefix, ref, param_keys, buffer_keys, attributes, child_keys, child_ids in self.entries:
      sub = ref()
      if sub is None:  # a submodule replaced and freed
        return None
      table, held, children = parameters_table(sub), buffers_table(sub), children_table(sub)
      if (tuple(table) != param_keys or tuple(held) != buffer_keys or
          (children or child_keys) and (tuple(children) != child_keys or
                                        tuple(map(id, children.values())) != child_ids)):
        return None
      training.append(sub.training)
      for key, value in table.items():
        if value is not None:
          params[prefix + key] = value
      for key, value in held.items():
        if value is not None:
          buffers[prefix + key] = value
      for key in attributes:
        value = vars(sub).get(key)
        if not isinstance(value, torch.Tensor):  # no longer a tensor: walk again
          return None
        buffers[prefix + key] = (value if value.is_xla  # type: ignore[attr-defined]  # stubs
                                 else _on_device(value, params))
    return params, buffers, tuple(training)


def _tensor_attributes(module: torch.nn.Module) -> tuple[str, ...]:
  """The names of the tensors a module holds as plain attributes (not parameters or buffers),
  such as GPT-J's rotary table: read with its buffers, by name (`holding_table`)."""
  return tuple(k for k, v in vars(module).items() if isinstance(v, torch.Tensor))


_DEVICE_COPIES: dict = {}  # id of a CPU tensor -> (weak reference to it, its version, XLA copy)


def _on_device(tensor: torch.Tensor, params: Tensors) -> torch.Tensor:
  """The XLA copy of a CPU tensor attribute, made once per version of it (a forward that moves
  it, as GPT-J's does, finds it moved; plain torch_xla moves it on the first call). The copy
  goes with the tensor."""
  version = torch_private.tensor_version(tensor)
  found = _DEVICE_COPIES.get(id(tensor))
  if found is None or found[0]() is not tensor or found[1] != version:
    device = next((p.device for p in params.values()
                   if p.is_xla), None)  # type: ignore[attr-defined]  # not in stubs
    if device is None:
      import torch_xla
      device = torch_xla.device()
    key = id(tensor)
    gone = lambda _, key=key: _DEVICE_COPIES.pop(key, None)  # noqa: E731
    found = _DEVICE_COPIES[key] = (weakref.ref(tensor, gone), version,
                                   tensor.detach().to(device))
  return found[2]


def holding_table(module: torch.nn.Module, name: str) -> dict[str, Any]:
  """The table a tensor of `module` named `name` (no dots) lives in: its parameters, its buffers,
  or, for a plain tensor attribute, its `__dict__`.

  Example:
    >>> lin = torch.nn.Linear(1, 1)
    >>> lin.table = torch.ones(2)
    >>> holding_table(lin, "table") is vars(lin), holding_table(lin, "weight") is vars(lin)
    (True, False)
  """
  for table in (torch_private.parameters_table(module), torch_private.buffers_table(module)):
    if name in table:
      return table
  return vars(module)


def _children(module: torch.nn.Module) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """A module's children as a walk compares them: their names, and their ids (holding none)."""
  table = torch_private.children_table(module)
  return tuple(table), tuple(map(id, table.values()))


def module_state(module: torch.nn.Module) -> ModuleState:
  """`(params, buffers, training)` of `module`, as `StateWalk(module).state()` reads them.

  Example:
    >>> params, buffers, training = module_state(torch.nn.BatchNorm1d(2))
    >>> sorted(buffers), training
    (['num_batches_tracked', 'running_mean', 'running_var'], (True,))
  """
  return StateWalk(module).state()


def attribute_differences(first: torch.nn.Module, other: torch.nn.Module) -> list[str]:
  """Names of the attributes of module `other` (and of its submodules, by path) whose values
  could change the computation from `first`'s, public names first: plain values compared by
  `plain.key`, anything else by identity. `first` and `other` must have the same submodule paths.

  Example:
    >>> conv = lambda d: torch.nn.Conv1d(2, 2, 3, padding=d, dilation=d)
    >>> attribute_differences(conv(1), conv(2))
    ['dilation', 'padding', '_reversed_padding_repeated_twice']
  """
  differ = []
  subs = dict(other.named_modules())
  for path, sub in first.named_modules():
    mine, theirs = dict(own_attributes(sub)), dict(own_attributes(subs[path]))
    for name in sorted(set(mine) | set(theirs), key=lambda n: (n.startswith("_"), n)):
      if name not in mine or name not in theirs or not _same(mine[name], theirs[name]):
        differ.append(f"{path}.{name}" if path else name)
  return differ


def _same(a: Any, b: Any) -> bool:
  if type(a) is functools.partial and type(b) is functools.partial:  # each layer's own partial
    return (_same(a.func, b.func) and len(a.args) == len(b.args) and
            all(map(_same, a.args, b.args)) and a.keywords.keys() == b.keywords.keys() and
            all(_same(v, b.keywords[k]) for k, v in a.keywords.items()))
  try:
    return plain.key(a, contents=True) == plain.key(b, contents=True)
  except plain.NotPlain:
    return a is b
