"""The optimizer state of a step's parameters kept in a few flat buffers, seen in torch's layout.

A step's graph costs host time per tensor it updates (torch_xla's sync and data handles, about
10 us each), and AdamW keeps two state tensors per parameter. So the state of the parameters a
step updates lives in one 1-D buffer per (state name, dtype), which the step's node reads and
writes whole. `optimizer.state[p]` is a `FlatState`: its tensors are views of those buffers,
made when read, so they follow later steps and an in-place change of one reaches the buffer, as
with torch's own state tensors; `state[p][name] = tensor` (or a loaded state dict) makes the
next step build new buffers from the values.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import MutableMapping
from typing import Any, Iterator, Sequence

import torch

from torch_xla_jaxbridge._core import runtime


class FlatLayout:
  """Where each parameter's state lives: per parameter `(name, buffer, offset, shape)` entries
  into buffers named `(state name, dtype)`. A static argument of the step (hashable).

  Example:
    >>> layout = FlatLayout.of([{"m": torch.zeros(2, 3)}, {"m": torch.zeros(4)}])
    >>> layout.entries
    ((('m', 0, 0, (2, 3)),), (('m', 0, 6, (4,)),))
  """

  def __init__(self, names: tuple, entries: tuple):
    self.names, self.entries = names, entries
    self._hash = hash((names, entries))

  @classmethod
  def of(cls, states: list) -> "FlatLayout":
    """The layout of `states` (each parameter's `{name: tensor}`), in their order."""
    names: dict = {}
    sizes: list[int] = []
    entries = []
    for state in states:
      mine = []
      for name, tensor in state.items():
        buffer = names.setdefault((name, str(tensor.dtype)), len(names))
        if buffer == len(sizes):
          sizes.append(0)
        mine.append((name, buffer, sizes[buffer], tuple(tensor.shape)))
        sizes[buffer] += tensor.numel()
      entries.append(tuple(mine))
    return cls(tuple(names), tuple(entries))

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, FlatLayout) and self._hash == other._hash and
            (self.names, self.entries) == (other.names, other.entries))

  def __hash__(self) -> int:
    return self._hash

  def gather(self, states: list, device: Any) -> list:
    """The buffers holding `states` (torch tensors, laid out as `of(states)` lays them out)."""
    pieces: list[list] = [[] for _ in self.names]
    for state, entries in zip(states, self.entries):
      for name, buffer, _, _ in entries:
        pieces[buffer].append(state[name].detach().to(device).reshape(-1))
    return [torch.cat(p) if len(p) > 1 else p[0].clone() for p in pieces]

  def split(self, buffers: list, moved: dict | None = None) -> list:
    """Inside the step (JAX arrays): each parameter's state dict read from the buffers (at the
    traced offsets of `moved` where it has them)."""
    lax = runtime.jax_module().lax
    moved = moved or {}
    return [{name: (lax.dynamic_slice_in_dim(buffers[b], moved[j][name], math.prod(shape),
                                             allow_negative_indices=False)
                    if name in moved.get(j, ()) else
                    buffers[b][offset:offset + math.prod(shape)]).reshape(shape)
             for name, b, offset, shape in entries} for j, entries in enumerate(self.entries)]

  def join(self, states: list, buffers: list, jnp: Any) -> list:
    """Inside the step: new buffers holding `states` (each cast to its buffer's dtype)."""
    pieces: list[list] = [[] for _ in self.names]
    for state, entries in zip(states, self.entries):
      for name, b, _, _ in entries:
        pieces[b].append(state[name].astype(buffers[b].dtype).reshape(-1))
    return [jnp.concatenate(p) if len(p) > 1 else p[0] for p in pieces]

  def moved(self, runs: list, indices: Sequence[Any]) -> dict:
    """Traced offsets for the states of parameters of identical layers, for `split`:
    `runs` lists, per looped input of a layer, the index of that parameter in each layer
    (layer order); where their states lie `stride` apart in a buffer, parameter `runs[r][l]`'s
    offset is `offset of layer 0 + indices[l] * stride`, with `indices[l]` a traced scalar: the
    same kernel reads every layer's state (see `layer_loops.indexed_stack`). The new states are
    joined as before: written at traced offsets (`dynamic_update_slice`), XLA:CPU copied the
    whole buffer per parameter, a 32-layer step ran 2.7x slower.

    Example:
      >>> import torch
      >>> layout = FlatLayout.of([{"m": torch.zeros(n)} for n in (2, 3, 2, 3)])  # two layers
      >>> layout.moved([[0, 2], [1, 3]], [10, 20])  # offsets 0, 2, 5, 7: layers 5 apart
      {0: {'m': 50}, 2: {'m': 100}, 1: {'m': 52}, 3: {'m': 102}}
    """
    found: dict = {}
    scaled: dict = {}  # (layer, stride) -> indices[layer] * stride, traced once
    for run in runs:
      layers = [{n: (b, o, s) for n, b, o, s in self.entries[j]} for j in run]
      for name, (b, offset, shape) in layers[0].items():
        at = [layer.get(name) for layer in layers]
        stride = at[1][1] - offset if len(run) > 1 and at[1] is not None else 0
        if stride and all(a == (b, offset + l * stride, shape) for l, a in enumerate(at)):
          for l, j in enumerate(run):
            if (l, stride) not in scaled:
              scaled[l, stride] = indices[l] * stride
            found.setdefault(j, {})[name] = offset + scaled[l, stride]
    return found


class FlatBuffers:
  """The buffers of one layout and the parameters (by id, in order) whose state they hold."""

  def __init__(self, layout: FlatLayout, buffers: list, ids: tuple):
    self.layout, self.buffers, self.ids = layout, buffers, ids


class FlatState(MutableMapping):
  """One parameter's optimizer state: its `step` count and views of the flat buffers by name.

  A view read while another reader still holds it is the same tensor. Setting or deleting a
  name keeps the value given here and marks the state `changed` (the next step rebuilds the
  buffers from it).

  Example:
    >>> layout = FlatLayout.of([{"exp_avg": torch.zeros(2)}])
    >>> state = FlatState(FlatBuffers(layout, [torch.arange(2.0)], (0,)), 0, None)
    >>> state["exp_avg"].tolist(), list(state), state.changed
    ([0.0, 1.0], ['exp_avg'], False)
  """

  def __init__(self, owner: FlatBuffers, index: int, step: torch.Tensor | None):
    self.owner, self.index, self.step = owner, index, step
    self.given: dict = {}  # names set (or deleted: None) since the buffers were made
    self._views: dict = {}  # name -> weak reference to the view handed out last

  @property
  def changed(self) -> bool:
    return bool(self.given)

  def _entries(self) -> dict:
    return {name: (b, offset, shape) for name, b, offset, shape in
            self.owner.layout.entries[self.index]}

  def __getitem__(self, name: str) -> Any:
    if name == "step" and self.step is not None:
      return self.step
    if name in self.given:
      if self.given[name] is None:
        raise KeyError(name)
      return self.given[name]
    b, offset, shape = self._entries()[name]
    held = self._views.get(name)
    view = held() if held is not None else None
    if view is None:
      view = self.owner.buffers[b].narrow(0, offset, math.prod(shape)).view(shape)
      self._views[name] = weakref.ref(view)
    return view

  def __setitem__(self, name: str, value: Any) -> None:
    if name == "step":
      self.step = value
    else:
      self.given[name] = value

  def __delitem__(self, name: str) -> None:
    self[name]  # a KeyError for a name it does not hold
    if name == "step":
      self.step = None
    else:
      self.given[name] = None

  def __iter__(self) -> Iterator[str]:
    names = [] if self.step is None else ["step"]
    names += [n for n in self._entries() if self.given.get(n, True) is not None]
    names += [n for n, v in self.given.items() if v is not None and n not in names]
    return iter(names)

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __reduce__(self) -> tuple:
    return (dict, (dict(self.items()),))  # pickled or deep-copied as torch's plain dict
