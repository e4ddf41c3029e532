"""The static part of a bridged call (`Spec`), and a call's arguments prepared for the trace.

`prepare` lifts the tensors a function reads from its closure, globals, `self` and partial
arguments (and the objects held there) into a first argument, passes argument objects holding
tensors as their state, and splits the tensors into those that need gradients and the rest; the
`Spec` that merges them back (structure, static values, markers) keys the trace cache. `Layout`
and `Residuals` are what a trace learns about its outputs and its backward; they travel through
`call_jax` as static output structure.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Sequence

import torch

from torch_xla_jaxbridge._bridge import captures, stateful
from torch_xla_jaxbridge._core import call, grad_reads, plain, runtime, threads, tracing
from torch_xla_jaxbridge._core.runtime import PyTree

if TYPE_CHECKING:
  from jax.tree_util import PyTreeDef

DIFF, OTHER = "<diff tensor>", "<tensor>"  # markers of tensor leaves in a `Spec`


class _Same(int):
  """Marks a tensor leaf that is the same tensor as the leaf at this earlier position."""
  __slots__ = ()
_ATOMS = (bool, int, float, str, type(None))


class Static:
  """An output leaf that is not an array (an int, a string, an object), kept as it is; compared
  by value where it is hashable, else by identity."""
  __slots__ = ("value",)

  def __init__(self, value: object) -> None:
    self.value = value

  def _key(self) -> tuple:
    try:
      return (type(self.value), hash(self.value), self.value)
    except TypeError:
      return (type(self.value), id(self.value))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Static) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key()[:2])


@dataclasses.dataclass(frozen=True)
class Alias:
  """An output leaf that is the very tensor of an argument leaf (`source` "argument": returned as
  it came, or after an in-place update) or of an earlier output leaf ("output": returned twice),
  given back as that tensor, as torch code gives it: an in-place update of the output later
  shows in the other (not a view: `x.chunk(2)` returns new tensors)."""
  source: str
  index: int


def output_kinds(leaves: Sequence[Any], aliases: Sequence[tuple[str, int] | None]) -> tuple:
  """A `Layout`'s kinds of output `leaves`, given `run_torch`'s `aliases` of them.

  Example:
    >>> import jax.numpy as jnp
    >>> output_kinds([jnp.ones(2), jnp.ones(2, int), "a", jnp.ones(2)],
    ...              [None, None, None, ("argument", 0)])[:2]
    (True, False)
  """
  jax = runtime.jax_module()
  if len(aliases) != len(leaves):  # (a structure flattened otherwise: none found)
    aliases = [None] * len(leaves)
  return tuple(Alias(*alias) if alias is not None else
               bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
               if isinstance(x, jax.Array) else Static(x) for x, alias in zip(leaves, aliases))


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a trace learned about its outputs; travels as static data through `call_jax`. `kinds`
  has one entry per output leaf: True (a floating-point array, differentiable), False (another
  array), a `Static` (a value that is not an array, returned as it is) or an `Alias`."""
  out_tree: PyTreeDef
  kinds: tuple[bool | Static | Alias, ...]
  mutated: tuple  # positions (among all argument leaves) updated in place
  packed: bool  # outputs in a structure only torch's pytrees know (stateful.pack_outputs)

  def rebuild(self, floats: Iterable[Any], others: Iterable[Any],
              arguments: PyTree = None) -> PyTree:
    """The outputs' pytree from the call's floating-point and other arrays (and, for an
    `Alias`, the call's `arguments`: `(args, kwargs)`)."""
    float_it, other_it = iter(floats), iter(others)
    leaves: list = []
    argument_leaves: list | None = None
    for kind in self.kinds:
      if kind is True or kind is False:
        leaves.append(next(float_it) if kind else next(other_it))
      elif isinstance(kind, Alias):
        if kind.source == "output":
          leaves.append(leaves[kind.index])
          continue
        if argument_leaves is None:
          argument_leaves = runtime.jax_module().tree.leaves(arguments)
        leaves.append(argument_leaves[kind.index])
      else:
        leaves.append(kind.value)
    return self.out_tree.unflatten(leaves)


@dataclasses.dataclass(frozen=True)
class Residuals:
  """How to rebuild the `vjp` function from the residual tensors it was flattened to: each
  residual is either a differentiable input, passed to the backward as it is (`sources[i]`
  indexes `inputs`), or a value the forward computed and returned (`sources[i]` is None)."""
  tree: PyTreeDef
  sources: tuple[int | None, ...]
  inputs: tuple  # positions, among the differentiable inputs, of those the backward reads
  dtypes: tuple  # of the computed residuals
  on_host: tuple  # offloaded computed residuals
  sequenced: bool = False  # a remat policy recomputes: only once the cotangents have arrived
  x64: bool = False  # the forward was traced in 64-bit mode: so is the backward lowered
  no_gradient: tuple = ()  # positions of the differentiable inputs no output depends on


class Spec:
  """The static part of a bridged call: argument structure, non-tensor values, which tensors
  need gradients. Equal specs (same structure, markers and static keys) share a trace.

  Example:
    >>> spec, diff, other = Spec.split(((torch.ones(2, requires_grad=True), 3), {}),
    ...                                lambda t: t.requires_grad, "f")
    >>> spec, len(diff), len(other)
    (<tensors needing grad: g>, 1, 0)
  """

  def __init__(self, treedef: PyTreeDef, leaves: tuple, keys: Hashable,
               objects: str = "", requiring: tuple[int, ...] = ()) -> None:
    self.treedef = treedef
    self.leaves = leaves  # DIFF / OTHER markers at tensor positions, static values elsewhere
    self.objects = objects  # the argument objects passed as their state, for re-trace reasons
    # the grad mode at this call, which the trace runs in (code may branch on it)
    self.grad_enabled = torch.is_grad_enabled()
    # e.g. the autocast state at this call
    self.context = (*tracing.trace_keys(), ("grad mode", "on" if self.grad_enabled else "off"))
    self.requiring = requiring  # positions in `other` of tensors that require grad all the same
    self.keyed = keys is not None  # False: an unhashable static, until `stateful.box` takes it
    self._key = (treedef, keys, requiring, self.context)
    self.has_objects = False  # set by `split`: an argument object may hold tensors

  @classmethod
  def split(cls, tree: PyTree, needs_grad: Callable[[torch.Tensor], bool],
            caller: str) -> tuple[Spec, list[torch.Tensor], list[torch.Tensor]]:
    """`(spec, diff, other)` for a pytree of arguments: the tensors for which `needs_grad(t)`
    holds, the other tensors, and the spec that merges them back. A static leaf that cannot key
    the trace cache is an error naming it."""
    jax = runtime.jax_module()
    leaves, treedef = jax.tree.flatten(tree)
    markers: list = []
    diff: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    first: dict[int, int] = {}
    for position, leaf in enumerate(leaves):
      if isinstance(leaf, torch.Tensor):
        if id(leaf) in first:  # the same tensor again: one input, so the trace sees one tensor
          markers.append(_Same(first[id(leaf)]))
          continue
        first[id(leaf)] = position
        needs = needs_grad(leaf)
        (diff if needs else other).append(leaf)
        markers.append(DIFF if needs else OTHER)
      else:
        markers.append(leaf)
    requiring = tuple(i for i, t in enumerate(other) if t.requires_grad)
    statics = [m for m in markers if m is not DIFF and m is not OTHER]
    objects = any(type(m) not in _ATOMS and stateful.may_hold_state(m) for m in statics)
    try:  # the common statics (flags, sizes, None) keyed by type and value without plain.key
      keys: tuple | None = tuple([_static_key(m) for m in statics])
    except plain.NotPlain:
      if not objects:  # an object may yet be passed as its state (`stateful.box`)
        call.static_keys(markers, tree, caller)  # raises, naming the leaf
      keys = None
    spec = cls(treedef, tuple(markers), keys, requiring=requiring)
    spec.has_objects = objects
    return spec, diff, other

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Spec) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __repr__(self) -> str:  # read in re-trace reasons
    marks = "".join("g" if v is DIFF else "-" for v in self.leaves if v is DIFF or v is OTHER)
    return f"<tensors needing grad: {marks}{self.objects}>"

  def describe_change(self, old: object) -> str | None:
    """The re-trace reason when this spec differs from `old`: the part of the key that does
    (the two print alike: a spec shows only which tensors need gradients)."""
    if not isinstance(old, Spec):
      return None
    changes = []
    if old.treedef != self.treedef:
      changes.append(_tree_change(old.treedef, self.treedef) or "the arguments' structure")
    if old._key[1] != self._key[1]:
      changes.append(_statics_change(old.leaves, self.leaves) or "a static argument")
    if old.requiring != self.requiring:
      changes.append("which tensors not trained require grad")
    if old.context != self.context:
      changes.append(tracing.describe_key_change(old.context, self.context))
    return "; ".join(changes) or None

  def autograd(self, diff: Sequence[Any], other: Sequence[Any]) -> grad_reads.Caller:
    """What the trace of a call with `diff` and `other` (arrays) reads of autograd: the call's
    grad mode, and `requires_grad` True for the arrays standing for tensors that require it."""
    requiring = [*diff, *(other[i] for i in self.requiring)]
    return grad_reads.Caller(self.grad_enabled, frozenset(map(id, requiring)))

  def merge(self, diff: Iterable[Any], other: Iterable[Any]) -> PyTree:
    """The arguments' pytree with `diff` and `other` put back at their positions (a tensor that
    was passed twice at each of its places)."""
    diff_it, other_it = iter(diff), iter(other)
    full: list = []
    for v in self.leaves:
      full.append(next(diff_it) if v is DIFF else next(other_it) if v is OTHER else
                  full[v] if type(v) is _Same else v)
    return self.treedef.unflatten(full)


def _tree_change(old: PyTreeDef, new: PyTreeDef) -> str | None:
  """What differs first between two argument structures: a captured value's or module's
  (`captures.describe_change`), or a node's type or keys; None if nothing says more."""
  before, after = old.node_data(), new.node_data()
  if before != after:
    if before is not None and after is not None and before[0] is after[0] is captures.Lifted:
      return captures.describe_change(before[1], after[1])
    shown = [f"{d[0].__name__} {d[1]!r:.80}" if d is not None else "a leaf"
             for d in (before, after)]
    return f"an argument node {shown[0]} -> {shown[1]}"
  for a, b in zip(old.children(), new.children()):
    if a != b:
      return _tree_change(a, b)
  return None


def _static_key(value: object) -> object:
  """A static leaf's part of a spec's key: the common ones (flags, sizes, None) by type and
  value without `plain.key`; raises `plain.NotPlain` for a value it cannot key."""
  return (type(value), value) if type(value) in _ATOMS else plain.static_key(value)


def _statics_change(old: tuple, new: tuple) -> str | None:
  """The static leaves (not tensors) that differ between two specs' leaves."""
  changes = []
  for before, after in zip(old, new):
    if before is DIFF or before is OTHER or before is after:
      continue
    try:  # as `Spec.split` keys them
      same = type(before) is type(after) and _static_key(before) == _static_key(after)
    except plain.NotPlain:  # an object keyed otherwise (`stateful.box`)
      same = False
    if not same:
      described = getattr(after, "describe_change", lambda _: None)(before)
      changes.append(described or f"{before!r:.80} -> {after!r:.80}")
  return "; ".join(changes) or None


@threads.once
def register_static_pytree() -> None:
  """Lets `Layout` and `Residuals` travel through `call_jax` as static output structure (once)."""
  jax = runtime.jax_module()
  for static in (Layout, Residuals):
    jax.tree_util.register_pytree_node(static, lambda x: ((), x), lambda aux, _: aux)


@dataclasses.dataclass
class Prepared:
  """A call's arguments ready for the trace (see `prepare`)."""
  args: tuple
  kwargs: dict
  spec: Spec
  diff: list  # the tensors that need gradients
  other: list  # the other tensors
  boxed: tuple  # (argument object, its Snapshot) for objects passed as their state


def prepare(fn: Callable, name: str, args: tuple, kwargs: dict,
            needs_grad: Callable[[torch.Tensor], bool], *, lift: bool = True,
            refuse_hooks: bool = False) -> Prepared:
  """`fn(*args, **kwargs)`'s arguments for a bridged call: the tensors and modules `fn` reads from
  its closure, globals, `self` and partial arguments (and the objects held there), and the
  modules among the arguments, lifted into a first argument (unless `lift` is False), argument
  objects that hold tensors (a Hugging Face cache) replaced by their `Snapshot`, and the tensors
  split by `needs_grad(t)` into `diff` and `other`. `refuse_hooks`: a lifted module holding a
  hook is an `errors.HookError` (`captures.collect`).

  Example:
    >>> w = torch.ones(2, device="xla", requires_grad=True)
    >>> x = torch.ones(2, device="xla")
    >>> prepared = prepare(lambda x: x * w, "f", (x,), {}, lambda t: t.requires_grad)
    >>> len(prepared.diff), len(prepared.other)
    (1, 1)
  """
  if lift:
    args = captures.with_captures(fn, name, args, kwargs, refuse_hooks=refuse_hooks)
  spec, diff, other = Spec.split((args, kwargs), needs_grad, name)
  boxed: tuple | list = ()
  if spec.has_objects:  # argument objects holding tensors: passed as their state
    (args, kwargs), boxed = stateful.box((args, kwargs))
    spec, diff, other = Spec.split((args, kwargs), needs_grad, name)
    if not spec.keyed:  # an unhashable object that holds no tensor: name it
      call.static_keys(spec.leaves, (args, kwargs), name)
  if boxed:
    spec.objects = "".join(f"; {stateful.summary(obj, snap)}" for obj, snap in boxed)
  return Prepared(args, kwargs, spec, diff, other, tuple(boxed))
