"""Layers bridged by class that share one trace although each writes its own slot of a cache.

A Hugging Face decoder layer called with a cache reads its `layer_idx` to address its slot
(`cache.update(k, v, self.layer_idx)`): by what its trace reads, every layer differs, and each
would keep a trace of its own. `SlotSharing.prepare` passes such a layer its `CacheSlot` (only its
own slot goes through the trace, `cache_slots`) and leaves its `layer_idx` out of the key. What
makes that sound is the fingerprint: the layer's forward run once more, on the meta device, with
every op it dispatches recorded. Layers whose records are equal, each touching only its own slot,
trace into one program; a layer whose `layer_idx` changes an op, or that reads another layer's
slot, keeps its own trace (with the whole cache, as before).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Hashable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from torch_xla_jaxbridge._bridge import rollback, stateful
from torch_xla_jaxbridge._bridge.cache_slots import CacheSlot, addressing, violated
from torch_xla_jaxbridge._compat import torch_dispatch_private
from torch_xla_jaxbridge._core import modules, plain, runtime

INDEX = "layer_idx"  # the attribute by which a Hugging Face layer addresses its cache slot
# a fingerprint's records -> its number (the key holds the number), the latest `_PRINTS_KEPT`: a
# record dropped and met again gets a new number (its layers trace again, once)
_PRINTS: dict[tuple, int] = {}
_PRINTS_KEPT = 256
_NUMBERS = itertools.count()
_MEMO_SIZE = 8  # fingerprints a layer keeps, by call signature (a new batch shape adds one)


def slot_index(module: torch.nn.Module) -> tuple[int, frozenset[str]] | None:
  """`(index, paths)`: the value of the module's `layer_idx` attributes (`self_attn.layer_idx`)
  and their paths, when it holds some and they agree; else None.

  Example:
    >>> layer = torch.nn.Sequential(torch.nn.Linear(1, 1))
    >>> layer[0].layer_idx = 3
    >>> slot_index(layer)
    (3, frozenset({'0.layer_idx'}))
  """
  found = {f"{prefix}.{INDEX}" if prefix else INDEX: vars(sub)[INDEX]
           for prefix, sub in module.named_modules() if type(vars(sub).get(INDEX)) is int}
  values = set(found.values())
  return (values.pop(), frozenset(found)) if len(values) == 1 else None


class SlotSharing:
  """One layer's way of passing a Hugging Face cache: its own slot, keyed by the fingerprint of
  its forward (kept per call signature), or the whole cache where that is not sound.

  Example:
    >>> layer = torch.nn.Linear(1, 1)
    >>> SlotSharing(layer).prepare(dict(layer.named_parameters()), {}, (True,),
    ...                            (torch.ones(1),), {}, ()) is None  # no cache: nothing to do
    True
  """
  __slots__ = ("module", "memo")

  def __init__(self, module: torch.nn.Module) -> None:
    self.module = weakref.ref(module)
    self.memo: dict[tuple, int | None] = {}

  def prepare(self, params: dict, buffers: dict, training: tuple, args: tuple, kwargs: dict,
              key: Hashable, hooks: bool = False) -> tuple[tuple, dict, int] | None:
    """`(args, kwargs, index)` with the Hugging Face cache among them replaced by the layer's
    `CacheSlot` (its slot at `index`), when the cache is an argument itself, the layer holds one
    slot index and its fingerprint is known; None to call as given. `key`: the module's settings
    (all its plain values), part of what a fingerprint is kept by; `hooks`: the module's own
    hooks run in its bridged forward (`BridgeModule`)."""
    module = self.module()
    if module is None or not has_cache(args, kwargs):
      return None
    leaves, treedef = runtime.jax_module().tree.flatten((params, buffers, args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if stateful.is_cache(leaf)]
    found = slot_index(module) if len(at) == 1 else None
    if found is None:
      return None
    index, cache = found[0], leaves[at[0]]
    layers = vars(cache).get("layers") if hasattr(cache, "__dict__") else None
    if type(layers) is not list or not 0 <= index < len(layers):
      return None
    arguments = _signature(leaves, at[0])
    if arguments is None:
      return None
    view = stateful.Snapshot.of(CacheSlot(cache, index, None))
    signature = (key, training, index, torch.is_grad_enabled(), arguments, view.state,
                 tuple((tuple(t.shape), t.dtype) for t in view.tensors))
    if signature not in self.memo:
      if len(self.memo) >= _MEMO_SIZE:
        self.memo.pop(next(iter(self.memo)))
      self.memo[signature] = fingerprint(
          lambda p, b, a, k: modules.module_forward(module, p, b, training, a, k, hooks=hooks),
          leaves, treedef, at[0], index, rollback.Snapshot([module], []).restore)
    number = self.memo[signature]
    if number is None:
      return None
    leaves[at[0]] = CacheSlot(cache, index, number)
    _, _, args, kwargs = treedef.unflatten(leaves)
    return args, kwargs, index


def has_cache(args: tuple, kwargs: dict) -> bool:
  """Whether an argument is a Hugging Face cache itself, as Hugging Face passes it (no walk of
  the arguments: a call without one costs a look at each).

  Example:
    >>> has_cache((torch.ones(1),), {"past_key_values": None})
    False
  """
  return any(map(stateful.is_cache, (*args, *kwargs.values())))


def fingerprint(run: Callable[..., Any], leaves: list, treedef: Any, at: int,
                index: int, restore: Callable[[], Any] | None = None) -> int | None:
  """The number of the records of `run(*tree)` on meta copies of `leaves` (of `tree` by
  `treedef`; the cache at leaf `at`, if any, as the layer's `CacheSlot` at `index`), run in the
  current grad mode with each copy requiring grad as its leaf does: each op dispatched, its
  tensors named by where they came from, its other arguments by value (floats by their bits);
  the outputs, and the cache's state after the call. None where the forward cannot run on the
  meta device, or touches another slot (even where it catches the error). An output reached
  through a custom `torch.autograd.Function` (whose backward no op records) adds the Function's
  class, what its forward kept on `ctx` and the tensors it saved (`_functions`). `restore()`,
  given, runs after (what the run changed on the host put back).

  Example:
    >>> x, y = torch.ones(2), torch.ones(2)
    >>> tree = runtime.jax_module().tree.structure(((x, y),))
    >>> first = fingerprint(lambda a: a[0] * 2, [x, y], tree, -1, 0)
    >>> first == fingerprint(lambda a: a[0] * 2, [x, y], tree, -1, 0)
    True
    >>> first == fingerprint(lambda a: a[1] * 2, [x, y], tree, -1, 0)  # the other input
    False
    >>> first == fingerprint(lambda a: a[0] * -0.0 + 2, [x, y], tree, -1, 0) == (
    ...     fingerprint(lambda a: a[0] * 0.0 + 2, [x, y], tree, -1, 0))
    False
  """
  names: dict[int, int] = {}
  kept: list = []  # every tensor named, held until the end (an id is not reused meanwhile)
  metas = []
  with addressing(index):
    for i, leaf in enumerate(leaves):
      if i == at:
        snap = stateful.Snapshot.of(CacheSlot(leaf, index, None))
        leaf = stateful.materialize(stateful.Snapshot(snap.state, list(map(_meta, snap.tensors))))
      elif isinstance(leaf, torch.Tensor):
        leaf = _meta(leaf)
      metas.append(leaf)
    for leaf in runtime.jax_module().tree.leaves(metas) + _cache_tensors(metas, at):
      if isinstance(leaf, torch.Tensor):
        names.setdefault(id(leaf), len(names))
        kept.append(leaf)
    recorder = _Recorder(names, kept)
    try:
      with recorder, _Constants(recorder):
        out = run(*treedef.unflatten(metas))
      record = (tuple(recorder.log), recorder.key(out), _cache_after(recorder, metas, at),
                _functions((out, _cache_tensors(metas, at)), recorder))
      if violated():
        return None
    except Exception:  # noqa: BLE001  (another slot touched, no meta kernel, a value read,
      return None  # a tensor from elsewhere: the layer keeps a trace of its own)
    finally:
      if restore is not None:
        restore()
  number = _PRINTS.pop(record, None)
  _PRINTS[record] = next(_NUMBERS) if number is None else number  # the latest last
  if len(_PRINTS) > _PRINTS_KEPT:
    del _PRINTS[next(iter(_PRINTS))]
  return _PRINTS[record]


def _functions(tree: Any, recorder: _Recorder) -> tuple:
  """Each custom `torch.autograd.Function` a tensor of `tree` was computed through, whose
  `backward` no op records: its class, what its `forward` kept on `ctx` and the tensors it saved,
  by the recorder's keys, so that layers share a trace only where their backward is the same
  code on the same values (raises `_Unnamed` for a kept object that is not a plain value or a
  tensor the layer's ops made)."""
  found = []
  todo: list = [t.grad_fn for t in runtime.jax_module().tree.leaves(tree)
          if isinstance(t, torch.Tensor) and t.grad_fn is not None]
  seen: dict[int, Any] = {}  # each node held: its Python object is made per read, and an id
  while todo:                # is reused once one is gone
    node = todo.pop()
    if node is None or id(node) in seen:
      continue
    seen[id(node)] = node
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a class per Function
      found.append((type(node), recorder.key(vars(node)), recorder.key(node.saved_tensors)))
    todo.extend(next_node for next_node, _ in node.next_functions)
  return tuple(found)


class _Unnamed(Exception):
  """A tensor that is neither an input, made by a recorded op, nor a constant on the CPU."""


class _Recorder(torch_dispatch_private.dispatch_mode()):  # type: ignore[misc]
  """Records each op dispatched: `(op, arguments, outputs)`, tensors by number."""

  def __init__(self, names: dict[int, int], kept: list) -> None:
    super().__init__()
    self.names, self.kept = names, kept
    self.log: list[tuple] = []
    self.constructing = False  # inside a tensor made from Python data (`_Constants` logs it)

  def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                         kwargs: dict | None = None) -> Any:
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if not self.constructing:
      self.log.append((func, self.key((args, kwargs)), self.name(out)))
    return out

  def name(self, out: Any) -> Any:
    """`out`'s key, its new tensors numbered first."""
    for t in runtime.jax_module().tree.leaves(out):
      if isinstance(t, torch.Tensor) and id(t) not in self.names:
        self.names[id(t)] = len(self.names)
        self.kept.append(t)
    return self.key(out)

  def key(self, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
      number = self.names.get(id(value))
      if number is None and value.device.type == "cpu":  # made from Python values: by value
        return ("c", tuple(value.shape), value.dtype,
                bytes(value.detach().reshape(-1).contiguous().view(torch.uint8).tolist()))
      if number is None:
        raise _Unnamed(f"a {value.device.type} tensor the layer's inputs do not hold")
      return ("t", number, tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
      return tuple(self.key(v) for v in value)
    if isinstance(value, dict):
      return tuple((self.key(k), self.key(v)) for k, v in value.items())
    if type(value) is float:  # by its bits: -0.0 is not 0.0
      return (float, value.hex())
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
      return (type(value), str(value))
    if hasattr(value, "__array__") and not plain.is_plain(value):  # a NumPy array: by value
      array = np.asarray(value)
      return ("a", array.shape, str(array.dtype), array.tobytes())
    if not plain.is_plain(value):  # an object (a generator, a function): not by value
      raise _Unnamed(f"a {type(value).__name__} passed to an op")
    return plain.key(value)


class _Constants(TorchFunctionMode):
  """Logs each tensor made from Python data (`torch.tensor(...)`), its data by value: on the
  meta device the data is gone, and the ops it dispatches see a tensor from nowhere."""

  def __init__(self, recorder: _Recorder) -> None:
    super().__init__()
    self.recorder = recorder

  def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                         kwargs: dict | None = None) -> Any:
    kwargs = kwargs or {}
    if func not in _FROM_DATA:
      return func(*args, **kwargs)
    recorder = self.recorder
    before, recorder.constructing = recorder.constructing, True
    try:
      out = func(*args, **kwargs)
    finally:
      recorder.constructing = before
    recorder.log.append((func.__name__, recorder.key((args, kwargs)), recorder.name(out)))
    return out


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy,
              torch.Tensor.new_tensor}


def _cache_after(recorder: _Recorder, metas: list, at: int) -> Any:
  """The cache's state after the call (its attributes and the slot), its tensors by number."""
  if at < 0:
    return None
  snap = stateful.Snapshot.of(metas[at])
  return snap.state, recorder.key(snap.tensors)


def _cache_tensors(metas: list, at: int) -> list:
  return stateful.Snapshot.of(metas[at]).tensors if at >= 0 else []


def _signature(leaves: list, at: int) -> tuple | None:
  """The call's arguments but the cache: tensors by shape, dtype and whether they need grad,
  plain values by value; None where one is another object (not kept by identity: an id is
  reused once the object is gone)."""
  found: list = []
  for i, x in enumerate(leaves):
    if isinstance(x, torch.Tensor):
      found.append((tuple(x.shape), x.dtype, x.requires_grad))
    elif i != at:
      if not plain.is_plain(x):
        return None
      found.append(plain.key(x))
  return tuple(found)


def _meta(t: torch.Tensor) -> torch.Tensor:
  return torch.empty(t.shape, dtype=t.dtype, device="meta",
                     requires_grad=t.requires_grad and t.is_floating_point())
