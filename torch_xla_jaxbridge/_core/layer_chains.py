"""Layers called one after another, found in a traced program.

A model's loop over identical layers (`for layer in self.layers: h = layer(h, ...)`) traces into
one copy of the layer's equations per layer. When each call ran in a JAX name scope of its own
(`layer_loops.marking`), `find` reads the program's equations by scope and finds runs of
consecutive calls whose equations are the same program (same primitives, parameters and
constants; each layer's own parameters are inputs), each call reading the previous one's output.
Layers are judged by the program they trace into, not by their attributes: Hugging Face's
`layer_idx` differs between layers and changes nothing in training.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from torch_xla_jaxbridge._compat import jaxpr_private
from torch_xla_jaxbridge._core import runtime

MARK = "jb_layer_call_"  # the name scope of a marked layer call starts with it


@dataclasses.dataclass
class Chain:
  """Consecutive calls traced into the same program: `segments[i]` holds the equation indices of
  call i; `carried[k]` is an input of call 0 whose next value is call 0's variable
  `carried_out[k]`; `stacked` are inputs that differ per call (`stacked_per_call[i]` call i's),
  `shared` those every call reads; `outputs` the variables of call 0 whose per-call values are
  read after the chain (`maps[i]` maps call 0's variables to call i's)."""
  segments: list
  maps: list
  carried: list
  carried_out: list
  stacked_per_call: list
  shared: list
  outputs: list = dataclasses.field(default_factory=list)
  arguments: list = dataclasses.field(default_factory=list)  # per stacked input, per call: the
  #                                      position of the traced function's argument, or None

  @property
  def start(self) -> int:
    return self.segments[0][0]


def find(jaxpr: Any, min_calls: int = 2) -> list:
  """The chains of `jaxpr` (an open jaxpr traced inside `marking`) with at least `min_calls`
  calls, in program order.

  Example:
    >>> jax = runtime.jax_module()
    >>> def two_layers(h, w0, w1):
    ...   for w in (w0, w1):
    ...     with jax.named_scope(f"{MARK}{w is w1}"):
    ...       h = jax.numpy.tanh(h @ w)
    ...   return h.sum()
    >>> x = jax.numpy.ones((2, 2))
    >>> chains = find(jax.make_jaxpr(two_layers)(x, x, x).jaxpr)
    >>> len(chains), len(chains[0].segments), len(chains[0].stacked_per_call)
    (1, 2, 1)
  """
  segments = _segments(jaxpr.eqns)
  defined_at = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  chains, i = [], 0
  while i < len(segments):
    chain = _grow(jaxpr.eqns, segments, i, defined_at)
    if chain is not None and len(chain.segments) >= min_calls:
      chains.append(chain)
      i += len(chain.segments)
    else:
      i += 1
  for chain in chains:
    _set_outputs(jaxpr, chain)
  return chains


def _segments(eqns: Sequence[Any]) -> list[list[int]]:
  """Each marked call's equation indices (by its outermost scope), in program order."""
  runs: list = []
  last = None
  for index, eqn in enumerate(eqns):
    call = jaxpr_private.outer_scope(eqn, MARK)
    if call is None:
      last = None
      continue
    if call != last:
      runs.append([])
      last = call
    runs[-1].append(index)
  return runs


def _grow(eqns: Sequence[Any], segments: list[list[int]], first: int,
          defined_at: dict[Any, int]) -> Chain | None:
  """The longest chain starting at `segments[first]`, or None."""
  base = segments[first]
  if any(eqns[k].effects for k in base):
    return None
  inputs0, map0 = _external_inputs(eqns, base)
  chain = Chain([base], [map0], [], [], [[] for _ in inputs0], [])
  kinds: list[tuple[str, Any]] | None = None
  start = base[0]
  for seg in segments[first + 1:]:
    mapped = _match(eqns, base, seg)
    if mapped is None:
      break
    mapping, inputs = mapped
    if len(inputs) != len(inputs0):
      break
    previous = chain.maps[-1]
    back = {v: k for k, v in previous.items()}  # previous call's variables -> call 0's
    these: Any = []  # each input's (kind, ...), or None: no chain
    for a0, a in zip(inputs0, inputs):
      if a is a0:
        these.append(("shared", None))
      elif a in back:
        these.append(("carried", back[a]))
      elif _defined_before(a, start, defined_at):
        these.append(("stacked", None))
      else:
        these = None
        break
    if these is None or (kinds is not None and these != kinds):
      break
    kinds = these
    chain.segments.append(seg)
    chain.maps.append(mapping)
    for j, a in enumerate(inputs):
      chain.stacked_per_call[j].append(a)
  if kinds is None:
    return chain
  for j, (kind, out) in enumerate(kinds):
    if kind == "carried":
      chain.carried.append(inputs0[j])
      chain.carried_out.append(out)
    elif kind == "shared":
      chain.shared.append(inputs0[j])
  stacked = [j for j, (kind, _) in enumerate(kinds) if kind == "stacked"]
  chain.stacked_per_call = [[inputs0[j]] + chain.stacked_per_call[j] for j in stacked]
  if any(_aval(a) != _aval(o) for a, o in zip(chain.carried, chain.carried_out)):
    chain.segments = chain.segments[:1]
  return chain


def _defined_before(var: Any, start: int, defined_at: dict[Any, int]) -> bool:
  return defined_at.get(var, -1) < start


def _external_inputs(eqns: Sequence[Any], seg: list[int]) -> tuple[list, dict]:
  """The variables a segment reads but does not define, in first-read order, and the identity
  map of the variables it defines."""
  defined, inputs, seen = {}, [], set()
  for k in seg:
    for a in eqns[k].invars:
      if not jaxpr_private.is_literal(a) and a not in defined and a not in seen:
        seen.add(a)
        inputs.append(a)
    for v in eqns[k].outvars:
      defined[v] = v
  return inputs, defined


def _match(eqns: Sequence[Any], base: list[int], seg: list[int]) -> tuple[dict, list] | None:
  """`(map of base's variables to seg's, seg's external inputs in base's order)` when `seg`
  computes what `base` does on other inputs, else None."""
  if len(seg) != len(base):
    return None
  mapping: dict = {}
  outside: dict = {}
  inputs: list = []
  here: set = set()  # the variables seg has defined so far
  for k0, k in zip(base, seg):
    e0, e = eqns[k0], eqns[k]
    if (e0.primitive is not e.primitive or len(e0.invars) != len(e.invars)
        or len(e0.outvars) != len(e.outvars) or e.effects or not _same_params(e0.params, e.params)):
      return None
    for a0, a in zip(e0.invars, e.invars):
      if jaxpr_private.is_literal(a0) or jaxpr_private.is_literal(a):
        if not (jaxpr_private.is_literal(a0) and jaxpr_private.is_literal(a) and _same_literal(a0, a)):
          return None
      elif a0 in mapping:
        if mapping[a0] is not a:
          return None
      elif a0 in outside:
        if outside[a0] is not a:
          return None
      else:  # base reads it from outside: seg must too
        if a in here or _aval(a0) != _aval(a):
          return None
        outside[a0] = a
        inputs.append(a)
    for v0, v in zip(e0.outvars, e.outvars):
      mapping[v0] = v
      here.add(v)
  if len(set(map(id, inputs))) != len(inputs):  # two inputs of base read one variable here
    return None
  return mapping, inputs


def _aval(var: Any) -> tuple[tuple[int, ...], str, bool]:
  aval = var.aval
  return (tuple(aval.shape), str(aval.dtype), getattr(aval, "weak_type", False))


def _same_literal(a: Any, b: Any) -> bool:
  return _aval(a) == _aval(b) and np.array_equal(np.asarray(a.val), np.asarray(b.val))


def _same_params(p0: dict[str, Any], p1: dict[str, Any]) -> bool:
  if p0.keys() != p1.keys():
    return False
  return all(_same_value(p0[k], p1[k]) for k in p0)


def _same_value(a: Any, b: Any) -> bool:
  """Equal equation parameters: by value, jaxprs by their text and constants, functions by
  their code and what they close over."""
  if a is b:
    return True
  if type(a) is not type(b):
    return False
  if isinstance(a, (tuple, list)):
    return len(a) == len(b) and all(map(_same_value, a, b))
  if jaxpr_private.is_jaxpr(a):
    consts_a, consts_b = jaxpr_private.jaxpr_consts(a), jaxpr_private.jaxpr_consts(b)
    return (str(a) == str(b) and len(consts_a) == len(consts_b)
            and all(_same_array(x, y) for x, y in zip(consts_a, consts_b)))
  code_a, code_b = jaxpr_private.function_code(a), jaxpr_private.function_code(b)
  if code_a is not None or code_b is not None:
    return code_a is not None and code_a == code_b
  try:
    return bool(a == b)
  except Exception:  # an array or an object without a truth value for ==
    return _same_array(a, b)


def _same_array(x: Any, y: Any) -> bool:
  if x is y:
    return True
  try:
    return (np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
            and bool(np.array_equal(np.asarray(x), np.asarray(y))))
  except Exception:  # a traced value: only the same one is known to be equal
    return False


def _set_outputs(jaxpr: Any, chain: Chain) -> None:
  """Call 0's variables whose value in some call is read outside the chain."""
  inside = {k for seg in chain.segments for k in seg}
  read_outside = set(v for v in jaxpr.outvars if not jaxpr_private.is_literal(v))
  for index, eqn in enumerate(jaxpr.eqns):
    if index not in inside:
      read_outside.update(a for a in eqn.invars if not jaxpr_private.is_literal(a))
  last = len(chain.segments) - 1
  outputs = []
  for v0 in chain.maps[0]:
    read = [i for i, m in enumerate(chain.maps) if m[v0] in read_outside]
    if read and not (read == [last] and v0 in chain.carried_out):
      outputs.append(v0)
  chain.outputs = outputs
