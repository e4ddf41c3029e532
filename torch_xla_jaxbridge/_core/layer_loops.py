"""A model's own loop over identical layers, run as one `jax.lax.scan` (`jb.train_step`).

While torch code is traced, each call of a layer of a `ModuleList` runs in a JAX name scope of
its own (`marking`); the traced program's chains of equal layer calls (`layer_chains.find`) then
run as one `jax.lax.scan` over the layers' inputs stacked (`evaluate`), so differentiating it
gives one loop for the backward too: the program holds one layer body, whatever the depth.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from torch_xla_jaxbridge._compat import jaxpr_private
from torch_xla_jaxbridge._core import layer_chains, runtime

_MARKED_CLASSES: dict = {}  # a layer class -> its subclass whose calls run in a scope
_CALLS = itertools.count()


@contextlib.contextmanager
def marking(roots: Iterable[torch.nn.Module], min_calls: int = 2) -> Iterator[int]:
  """Inside the block, each call of a module held in a `ModuleList` or `Sequential` with at
  least `min_calls` modules of its class (the layers of a model) runs in a JAX name scope of its
  own, which `find` reads. Each such module is given, for the block, a subclass of its class
  whose `__call__` opens the scope; yields how many modules were marked.

  Example:
    >>> layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> with marking([layers]) as count:
    ...   marked = type(layers[0]) is not torch.nn.Linear
    >>> count, marked, type(layers[0]) is torch.nn.Linear
    (2, True, True)
  """
  swapped, seen = [], set()
  try:
    for children, classes in _layer_lists(roots):
      for child in children:
        if id(child) not in seen and classes.count(type(child)) >= max(min_calls, 2):
          seen.add(id(child))
          swapped.append((child, type(child)))
          child.__class__ = _marked_class(type(child))
    yield len(swapped)
  finally:
    for child, cls in reversed(swapped):
      child.__class__ = cls


def _marked_class(cls: type) -> type:
  found = _MARKED_CLASSES.get(cls)
  if found is None:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
      with runtime.jax_module().named_scope(f"{layer_chains.MARK}{next(_CALLS)}"):
        return cls.__call__(self, *args, **kwargs)

    found = _MARKED_CLASSES[cls] = type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__call__": __call__})
  return found


def evaluate(closed: Any, chains: list, args: list, indices: Sequence[Any] = ()) -> list:
  """What the closed jaxpr computes on `args`, with each chain run as one `jax.lax.scan` (its
  inputs stacked by `indexed_stack` where `indices` has a traced index for each call).

  Example:
    >>> jax = runtime.jax_module()
    >>> def three(h, ws):
    ...   for i, w in enumerate(ws):
    ...     with jax.named_scope(f"{layer_chains.MARK}{i}"):
    ...       h = jax.numpy.tanh(h @ w)
    ...   return h.sum()
    >>> ws = [jax.numpy.eye(2) * i for i in range(3)]
    >>> closed = jax.make_jaxpr(three)(jax.numpy.ones((2, 2)), ws)
    >>> chains = layer_chains.find(closed.jaxpr)
    >>> out = evaluate(closed, chains, [jax.numpy.ones((2, 2)), *ws])
    >>> bool(jax.numpy.allclose(out[0], three(jax.numpy.ones((2, 2)), ws)))
    True
  """
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  readers = _readers(jaxpr)
  done: set = set()
  position = 0
  for chain in chains:
    _run_equations(jaxpr, range(position, chain.start), done, env, readers)
    _run_chain(jaxpr, chain, env, indices)
    done.update(k for seg in chain.segments for k in seg)
    position = chain.start
  _run_equations(jaxpr, range(position, len(jaxpr.eqns)), done, env, readers)
  return [a.val if jaxpr_private.is_literal(a) else env[a] for a in jaxpr.outvars]


def _readers(jaxpr: Any) -> dict[Any, set[int]]:
  readers: dict = {}
  for index, eqn in enumerate(jaxpr.eqns):
    for a in eqn.invars:
      if not jaxpr_private.is_literal(a):
        readers.setdefault(a, set()).add(index)
  for a in jaxpr.outvars:
    if not jaxpr_private.is_literal(a):
      readers.setdefault(a, set()).add(len(jaxpr.eqns))
  return readers


def _run_equations(jaxpr: Any, indices: Iterable[int], done: set, env: dict,
                   readers: dict[Any, set[int]]) -> None:
  """Runs the equations at `indices` not in `done` as one function; adds them to `done`."""
  todo = [k for k in indices if k not in done]
  if not todo:
    return
  here = set(todo)
  eqns = [jaxpr.eqns[k] for k in todo]
  defined = {v for e in eqns for v in e.outvars}
  invars = list(dict.fromkeys(a for e in eqns for a in e.invars
                              if not jaxpr_private.is_literal(a) and a not in defined))
  outvars = [v for v in dict.fromkeys(v for e in eqns for v in e.outvars)
             if readers.get(v, set()) - here]
  values = jaxpr_private.equations_function(invars, outvars, eqns)(*[env[a] for a in invars])
  env.update(zip(outvars, values))
  done.update(todo)


def _run_chain(jaxpr: Any, chain: layer_chains.Chain, env: dict, indices: Sequence[Any]) -> None:
  jax = runtime.jax_module()
  base = [jaxpr.eqns[k] for k in chain.segments[0]]
  stacked0 = [per_call[0] for per_call in chain.stacked_per_call]
  body_fn = jaxpr_private.equations_function(
      [*chain.carried, *stacked0, *chain.shared], [*chain.carried_out, *chain.outputs], base)
  shared = [env[a] for a in chain.shared]
  n_carried = len(chain.carried)

  def body(carry: list, xs: list) -> tuple[list, list]:
    out = body_fn(*carry, *xs, *shared)
    return list(out[:n_carried]), list(out[n_carried:])

  calls = len(chain.maps)
  stack = ((lambda values: indexed_stack(values, indices[:calls])) if len(indices) >= calls
           else jax.numpy.stack)
  xs = [stack([env[a] for a in per_call]) for per_call in chain.stacked_per_call]
  carry, ys = jax.lax.scan(body, [env[a] for a in chain.carried], xs, length=calls)
  last = chain.maps[-1]
  for v0, value in zip(chain.carried_out, carry):
    env[last[v0]] = value
  for v0, stacked in zip(chain.outputs, ys):
    for i, m in enumerate(chain.maps):
      env[m[v0]] = stacked[i]


def indexed_stack(values: list, indices: Sequence[Any]) -> Any:
  """`jnp.stack(values)` whose gradient gives value i the stacked gradient at `indices[i]`, a
  traced integer scalar (an input of the step, not a constant). The per-layer kernels that read
  it are then the same kernel for every layer, and XLA:CPU compiles a kernel seen before at
  almost no cost: with constant indices each layer's slice is a kernel of its own, compiled
  anew, so the step's compile grows with depth (docs/performance.md).

  Example:
    >>> jax = runtime.jax_module()
    >>> f = lambda a, b, i: (indexed_stack([a, b], i) ** 2).sum()
    >>> i = [jax.numpy.int32(0), jax.numpy.int32(1)]
    >>> [g.tolist() for g in jax.grad(f, (0, 1))(jax.numpy.ones(2), jax.numpy.ones(2) * 2, i)]
    [[2.0, 2.0], [4.0, 4.0]]
  """
  jax = runtime.jax_module()

  @jax.custom_vjp
  def stack(values: list, indices: list) -> Any:
    return jax.numpy.stack(values)

  def forward(values: list, indices: list) -> tuple:
    return jax.numpy.stack(values), indices

  def backward(indices: list, cotangent: Any) -> tuple:
    return [jax.lax.dynamic_index_in_dim(cotangent, i, keepdims=False, allow_negative_indices=False)
            for i in indices], None

  stack.defvjp(forward, backward)
  return stack(list(values), list(indices))


def most_calls(roots: Iterable[torch.nn.Module]) -> int:
  """The most modules of one class that one `ModuleList` or `Sequential` under `roots` holds:
  the longest loop `marking` can find.

  Example:
    >>> linear = lambda: torch.nn.Linear(1, 1)
    >>> most_calls([torch.nn.Sequential(linear(), torch.nn.ReLU(), linear())])
    2
  """
  return max((classes.count(c) for _, classes in _layer_lists(roots) for c in classes), default=0)


def _layer_lists(roots: Iterable[torch.nn.Module]) -> Iterator[tuple[list, list]]:
  """`(children, their classes)` of each `ModuleList` and `Sequential` under `roots`."""
  for root in roots:
    for container in root.modules():
      if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
        children = list(container)
        yield children, [type(c) for c in children]


def traced(fn: Callable, args: list) -> tuple:
  """`(closed jaxpr, rebuild)`: `fn(*args)` traced (without equations whose results nothing
  reads: a first trace can hold some that later ones do not), its array leaves the jaxpr's
  outputs, and `rebuild(values)` its output with those leaves replaced by `values` (other leaves,
  such as Python values describing the output, kept from the trace)."""
  jax = runtime.jax_module()
  box: dict = {}

  def arrays_only(*a: Any) -> list:
    leaves, tree = jax.tree.flatten(fn(*a))
    arrays = [isinstance(x, jax.Array) for x in leaves]
    box.update(tree=tree, arrays=arrays,  # the traced values not kept: JAX checks for leaks
               leaves=[None if is_array else x for x, is_array in zip(leaves, arrays)])
    return [x for x, is_array in zip(leaves, arrays) if is_array]

  closed = jaxpr_private.without_dead_code(jax.make_jaxpr(arrays_only)(*args))

  def rebuild(values: Iterable[Any]) -> Any:
    it = iter(values)
    leaves = [next(it) if is_array else x for x, is_array in zip(box["leaves"], box["arrays"])]
    return jax.tree.unflatten(box["tree"], leaves)

  return closed, rebuild


def scanned(fn: Callable, args: list, roots: Iterable[torch.nn.Module], min_calls: int = 2,
            indices: Sequence[Any] = ()) -> tuple | None:
  """`(looped, chains)`: `fn` (JAX code running the torch code of the modules `roots`) traced once
  with their layers marked, as `looped(*args)` whose chains of at least `min_calls` layer calls
  run as loops (stacking their inputs by `indexed_stack` with `indices`, when there are enough);
  None when no container holds `min_calls` modules of one class (then call `fn` itself: nothing
  was traced). Each chain's `arguments` says which of `args` are its stacked inputs.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> layers = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
    >>> fn, params = jb.jaxify(layers)
    >>> x = runtime.jax_module().numpy.ones((1, 2))
    >>> looped, chains = scanned(lambda p: fn(p, x), [params], [layers])
    >>> [len(c.segments) for c in chains], looped(params).shape
    ([3], (1, 2))
  """
  with marking(roots, min_calls) as count:
    if not count:
      return None
    closed, rebuild = traced(fn, args)
  chains = layer_chains.find(closed.jaxpr, min_calls)
  position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
  for chain in chains:
    chain.arguments = [[position.get(a) for a in per_call] for per_call in chain.stacked_per_call]
  leaves = runtime.jax_module().tree.leaves
  return (lambda *a: rebuild(evaluate(closed, chains, leaves(a), indices))), chains
