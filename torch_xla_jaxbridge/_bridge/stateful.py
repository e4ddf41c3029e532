"""Objects passed into bridged code whose tensors the code reads, appends to or writes: functionalized.

A Hugging Face `Cache` (DynamicCache, StaticCache, ...) or any other argument object holding
tensors enters a bridged call as a `Snapshot`: its tensors are inputs of the traced function, the
rest of its state (lists, dicts, nested objects, plain values) is part of the cache key. Inside
the trace the code works on a fresh copy of the object; after the call the copy's state comes out
as outputs and is written back into the caller's object, so the caller sees what eager code would
have done. A DynamicCache that grows re-traces per length (its tensors change shape); a
StaticCache, written in place, keeps one trace per input shape.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge.cache_slots import CacheSlot, SlotList
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import call, plain, runtime, threads
from torch_xla_jaxbridge._core.runtime import PyTree

_NOT_STATE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.ModuleType, torch.nn.Module)
_DEPTH = 8  # nesting of objects, lists and dicts followed inside one argument object


class _Value:
  """A plain value in a state description: compared by `plain.key`, kept for rebuilding."""
  __slots__ = ("key", "value")

  def __init__(self, value: object) -> None:
    self.key, self.value = plain.key(value), value

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Value) and self.key == other.key

  def __hash__(self) -> int:
    return hash(self.key)


class _Ref:
  """Any other value (a class, a config object, a function): compared by identity."""
  __slots__ = ("value",)

  def __init__(self, value: Any) -> None:
    self.value = value

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Ref) and self.value is other.value

  def __hash__(self) -> int:
    return id(self.value)


class Snapshot:
  """An object's state as a pytree: `tensors` are the children, `state` (hashable) the rest.

  Example:
    >>> import types
    >>> box = types.SimpleNamespace(keys=[torch.ones(2)], step=3)
    >>> snap = Snapshot.of(box)
    >>> len(snap.tensors), Snapshot.of(box).state == snap.state
    (1, True)
  """

  def __init__(self, state: Hashable, tensors: Sequence[Any]) -> None:
    self.state, self.tensors = state, list(tensors)

  @classmethod
  def of(cls, obj: object, inputs: Sequence[Any] | None = None) -> Snapshot:
    """The snapshot of `obj`; with `inputs` (the tensors of an earlier snapshot), a tensor that
    is one of them is recorded by its position instead of as a new child."""
    walk = _Walk({id(t): i for i, t in enumerate(inputs or ())})
    return cls(walk.describe(obj, 0), walk.tensors)


class _TooDeep(Exception):
  pass


class _Walk:
  """One description of an object's state: new tensors collected in order, tensors that are
  among `known` (an earlier snapshot's) recorded by position."""

  def __init__(self, known: dict[int, int]) -> None:
    self.known = known
    self.tensors: list[torch.Tensor] = []

  def describe(self, value: Any, depth: int) -> tuple:
    if isinstance(value, torch.Tensor):
      if id(value) in self.known:
        return ("input", self.known[id(value)])
      self.tensors.append(value)
      return ("tensor",)
    if isinstance(value, CacheSlot):  # the cache with only the layer's own slot in `layers`
      return ("cache slot", _Value(value.fingerprint), self.describe(value.view(), depth))
    if isinstance(value, SlotList):
      return ("slots", value.length, self.describe(value.own, depth + 1))
    if type(value) not in (list, tuple, dict) and plain.is_plain(value):
      return ("plain", _Value(value))
    if depth > _DEPTH:
      raise _TooDeep(type(value).__name__)
    if type(value) in (list, tuple):
      return (type(value).__name__, tuple(self.describe(v, depth + 1) for v in value))
    if type(value) is dict and all(plain.is_plain(k) for k in value):
      return ("dict", tuple((_Value(k), self.describe(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, _NOT_STATE) or not hasattr(value, "__dict__"):
      return ("ref", _Ref(value))
    # copied even when it holds no tensor yet: the traced code may give it some
    attrs = tuple((name, self.describe(v, depth + 1)) for name, v in sorted(vars(value).items()))
    return ("object", _Ref(type(value)), attrs)


def _build(desc: Any, inputs: Sequence[Any], tensors: Iterator[Any],
           device: torch.device | None = None) -> Any:
  """The value `desc` describes, with tensors taken in order from the iterator `tensors` (and
  `inputs[i]` for ("input", i)); torchax's device in plain values becomes `device`."""
  kind = desc[0]
  if kind == "tensor":
    return next(tensors)
  if kind == "input":
    return inputs[desc[1]]
  if kind == "plain":
    value = desc[1].value
    if device is not None and isinstance(value, torch.device) and value.type == "jax":
      return device
    return set(value) if type(value) is set else value  # the copy's own, as lists and dicts
  if kind == "ref":
    return desc[1].value
  if kind == "cache slot":
    return _build(desc[2], inputs, tensors, device)
  if kind == "slots":
    return SlotList(desc[1], _build(desc[2], inputs, tensors, device))
  if kind in ("list", "tuple"):
    items = [_build(d, inputs, tensors, device) for d in desc[1]]
    return items if kind == "list" else tuple(items)
  if kind == "dict":
    return {k.value: _build(d, inputs, tensors, device) for k, d in desc[1]}
  cls = desc[1].value
  obj = cls.__new__(cls)
  _fill(obj, desc, inputs, tensors, device)
  return obj


def _fill(obj: object, desc: Any, inputs: Sequence[Any], tensors: Iterator[Any],
          device: torch.device | None) -> None:
  state = {name: _build(d, inputs, tensors, device) for name, d in desc[2]}
  vars(obj).clear()
  vars(obj).update(state)


def materialize(snapshot: Snapshot) -> Any:
  """A new object with the snapshot's state (inside a trace: its tensors are traced ones).

  Example:
    >>> import types
    >>> copy = materialize(Snapshot.of(types.SimpleNamespace(keys=[torch.ones(2)])))
    >>> copy.keys[0].tolist()
    [1.0, 1.0]
  """
  return _build(snapshot.state, snapshot.tensors, iter(snapshot.tensors))


def may_hold_state(leaf: object) -> bool:
  """Whether an argument leaf is an object that `box` looks into (not a tensor, plain value,
  module, class or function).

  Example:
    >>> may_hold_state(3), may_hold_state(torch.nn.Linear(1, 1))
    (False, False)
  """
  return isinstance(leaf, CacheSlot) or not (
      isinstance(leaf, (torch.Tensor, Snapshot, Packed)) or type(leaf) in _FAST_PLAIN
      or callable(leaf) or isinstance(leaf, _NOT_STATE) or not hasattr(leaf, "__dict__")
      or plain.is_plain(leaf))


def is_cache(obj: object) -> bool:
  """A Hugging Face `Cache` (created empty, filled by the layers), when transformers is loaded.

  Example:
    >>> is_cache(torch.ones(1))
    False
  """
  cache_utils = sys.modules.get("transformers.cache_utils")
  return cache_utils is not None and isinstance(obj, cache_utils.Cache)


def box(tree: PyTree) -> tuple[PyTree, list[tuple[object, Snapshot]]]:
  """`(tree, boxed)`: `tree` with every argument object that holds tensors (or is a Hugging Face
  `Cache`) replaced by its `Snapshot`; `boxed` lists `(object, snapshot)`. Other objects stay
  static values.

  Example:
    >>> import types
    >>> cache = types.SimpleNamespace(keys=[torch.zeros(1)])
    >>> (args, kwargs), boxed = box(((torch.ones(1),), {"cache": cache}))
    >>> type(kwargs["cache"]).__name__, boxed[0][0] is cache
    ('Snapshot', True)
  """
  jax = runtime.jax_module()
  _register()
  leaves, treedef = jax.tree.flatten(tree)
  boxed: list[tuple[object, Snapshot]] = []
  for i, leaf in enumerate(leaves):
    if not may_hold_state(leaf):
      continue
    try:
      snapshot = Snapshot.of(leaf)
    except _TooDeep as e:
      path = call.path_name(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
      raise errors.BadArgumentError(
          f"argument {path}: a {type(leaf).__name__} holding a {e} that nests objects more than "
          f"{_DEPTH} deep (or refers to itself), so its tensors cannot be passed through the "
          f"trace. Pass the tensors themselves; for a Hugging Face model in training, "
          f"use_cache=False leaves the cache out.") from None
    # an object without tensors stays a static value
    if snapshot.tensors or is_cache(leaf) or isinstance(leaf, CacheSlot):
      leaves[i] = snapshot
      boxed.append((leaf, snapshot))
  return (treedef.unflatten(leaves) if boxed else tree), boxed


_FAST_PLAIN = (int, float, bool, str, type(None))


def summary(obj: object, snapshot: Snapshot) -> str:
  """How an argument object was passed, for re-trace reasons.

  Example:
    >>> import types
    >>> cache = types.SimpleNamespace(keys=[torch.ones(2, 3)])
    >>> summary(cache, Snapshot.of(cache))
    'SimpleNamespace passed as its state: 1 tensors [(2, 3)]'
  """
  shapes: list[object] = [tuple(t.shape) for t in snapshot.tensors]
  return (f"{type(obj).__name__} passed as its state: {len(shapes)} tensors "
          f"{shapes if len(shapes) <= 4 else shapes[:4] + ['...']}")


def has_snapshots(tree: PyTree) -> bool:
  """Whether `tree` holds a `Snapshot` (then the traced function must be `functionalized`).

  Example:
    >>> has_snapshots(((torch.ones(1),), {}))
    False
  """
  jax = runtime.jax_module()
  return any(isinstance(x, Snapshot) for x in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, Snapshot)))


def functionalized(fn: Callable) -> Callable[..., tuple[Any, list[Snapshot]]]:
  """`fn` on materialized copies of the snapshots in its arguments, returning `(outputs, after)`:
  `after` holds each copy's state after the call, new tensors as children.

  Example:
    >>> import types
    >>> def append(cache, x):
    ...   cache.keys.append(x * 2)
    >>> holder = types.SimpleNamespace(keys=[torch.zeros(1)])
    >>> ((cache, x), _), boxed = box(((holder, torch.ones(1)), {}))
    >>> out, after = functionalized(append)(cache, x)
    >>> after[0].tensors[0].tolist()
    [2.0]
  """
  jax = runtime.jax_module()
  is_snapshot = lambda x: isinstance(x, Snapshot)  # noqa: E731

  def run(*args: Any, **kwargs: Any) -> tuple[Any, list[Snapshot]]:
    pairs: list[tuple[Snapshot, Any]] = []

    def live(x: Any) -> Any:
      if not is_snapshot(x):
        return x
      pairs.append((x, materialize(x)))
      return pairs[-1][1]

    live_args, live_kwargs = jax.tree.map(live, (args, kwargs), is_leaf=is_snapshot)
    outputs = fn(*live_args, **live_kwargs)
    return outputs, [Snapshot.of(obj, inputs=snap.tensors) for snap, obj in pairs]

  return run


def write_back(boxed: Sequence[tuple[object, Snapshot]], after: Sequence[Snapshot],
               device: torch.device) -> None:
  """Sets each boxed object's state to its copy's state after the call (in place, so the caller's
  object is the one that changed); `after` holds the output snapshots with XLA tensors.

  Example:
    >>> import types
    >>> cache = types.SimpleNamespace(keys=[torch.zeros(1)])
    >>> _, boxed = box(((cache,), {}))
    >>> write_back(boxed, [Snapshot.of(types.SimpleNamespace(keys=[torch.ones(1)]))], None)
    >>> len(cache.keys)
    1
  """
  for (obj, before), snap in zip(boxed, after):
    if isinstance(obj, CacheSlot):  # the cache's attributes, and its layer's own slot
      obj.write(_build(snap.state, before.tensors, iter(snap.tensors), device))
      continue
    _fill(obj, snap.state, before.tensors, iter(snap.tensors), device)


class Packed:
  """Outputs in a structure only torch's pytrees know (a Hugging Face `ModelOutput`), as a JAX
  pytree: `leaves` are the children, objects among them (a cache) as `Snapshot`s."""

  def __init__(self, spec: _Ref, leaves: Sequence[Any]) -> None:
    self.spec, self.leaves = spec, list(leaves)


def pack_outputs(outputs: Any) -> Any:
  """`outputs` as JAX can flatten them: unchanged when JAX's pytrees see only tensors and plain
  values, else a `Packed` of torch's flattening with argument-like objects as snapshots.

  Example:
    >>> from collections import OrderedDict
    >>> pack_outputs((torch.ones(1), 2))[1]
    2
  """
  jax = runtime.jax_module()
  _register()
  if all(isinstance(x, torch.Tensor) or plain.is_plain(x) for x in jax.tree.leaves(outputs)):
    return outputs
  leaves, spec = torch_private.tree_flatten(outputs)
  return Packed(_Ref(spec), [Snapshot.of(x) if may_hold_state(x) else x for x in leaves])


def _flatten_packed(packed: Packed) -> tuple[list, tuple[_Ref, tuple]]:
  """Children: the tensors and snapshots; the other leaves (plain values, ...) are static."""
  children = [x for x in packed.leaves if isinstance(x, (torch.Tensor, Snapshot)) or
              hasattr(x, "dtype") and hasattr(x, "shape") and not plain.is_plain(x)]
  child_ids = {id(x) for x in children}
  static = tuple(None if id(x) in child_ids else _Value(x) if plain.is_plain(x) else _Ref(x)
                 for x in packed.leaves)
  return children, (packed.spec, static)


def _unflatten_packed(aux: tuple[_Ref, tuple], children: Sequence[Any]) -> Packed:
  spec, static = aux
  child_it = iter(children)
  return Packed(spec, [next(child_it) if s is None else s.value for s in static])


def packing(fn: Callable) -> Callable:
  """`fn` with its outputs passed through `pack_outputs`.

  Example:
    >>> packing(lambda: (torch.ones(1), 2))()[1]
    2
  """
  return lambda *args, **kwargs: pack_outputs(fn(*args, **kwargs))


def has_packed(tree: PyTree) -> bool:
  """Whether `tree` holds a `Packed` (then the call's outputs need `unpack_outputs`).

  Example:
    >>> has_packed((torch.ones(1),))
    False
  """
  jax = runtime.jax_module()
  _register()
  return any(isinstance(x, Packed) for x in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, Packed)))


def unpack_outputs(outputs: PyTree, device: torch.device) -> PyTree:
  """Undoes `pack_outputs` on the call's outputs (snapshots become objects again).

  Example:
    >>> unpack_outputs(Packed(_Ref(torch_private.tree_flatten([1])[1]), [1]), None)
    [1]
  """
  jax = runtime.jax_module()

  def unpack(x: Any) -> Any:
    if not isinstance(x, Packed):
      return x
    leaves = [_build(l.state, l.tensors, iter(l.tensors), device) if isinstance(l, Snapshot)
              else l for l in x.leaves]
    return torch_private.tree_unflatten(leaves, x.spec.value)

  return jax.tree.map(unpack, outputs, is_leaf=lambda x: isinstance(x, Packed))


@threads.once
def _register() -> None:
  jax = runtime.jax_module()
  jax.tree_util.register_pytree_node(Snapshot, lambda s: (s.tensors, s.state),
                                     lambda state, tensors: Snapshot(state, tensors))
  jax.tree_util.register_pytree_node(Packed, _flatten_packed, _unflatten_packed)
