"""`scan`: a torch step function over the leading axis of tensors, as one `jax.lax.scan` in one
bridged call (one forward node, one backward node, whatever the length).

The step function is converted once (torchax) into the scan body; the tensors it reads from its
closure, globals or `self` are lifted into inputs of the call, so they get gradients too.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Hashable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import captures
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import Bridged
from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import grad_reads, runtime, tracing
from torch_xla_jaxbridge._core.runtime import PyTree

# fn -> {remat: Bridged}, the Bridged holds fn weakly
_BY_FUNCTION: weakref.WeakKeyDictionary[Callable, dict[Hashable, Bridged[_Scan]]] = (
    weakref.WeakKeyDictionary())


def scan(fn: Callable, init: Any, xs: Any, partition_fn: Any = None, is_fn_pure: bool = True, *,
         remat: remat_policies.RematArg = None) -> tuple:
  """Upstream `torch_xla.experimental.scan.scan`: `fn(carry, x) -> (new_carry, y)` over the
  leading axis of `xs`, returning `(final_carry, ys)` with the `y`s stacked along dim 0.

  `init`, `xs` and `y` are pytrees (tensors in tuples, lists, dicts). The whole loop is one
  `jax.lax.scan` in one bridged call; gradients reach `init`, `xs` and the tensors `fn` reads
  (a closure's, a module's parameters). Random numbers differ per step and per call. `fn` must
  not change its carry or `x` in place (`errors.InPlaceInputError`).

  Args:
    fn: torch code `(carry, x) -> (new_carry, y)`; `new_carry` has the structure, shapes and
      dtypes of `carry`; `y` may be None.
    init: the first carry.
    xs: tensors of one length along dim 0 (a pytree), sliced per step.
    partition_fn: upstream's AOTAutograd partitioner, mapped to a remat policy:
      `default_partition` keeps what `jax.vjp` keeps, `min_cut_rematerialization_partition`
      recomputes elementwise ops (`jb.remat.save_unfused`). Or give `remat=` (docs/remat.md);
      with neither, `save_unfused` (as `scan_layers`).
    is_fn_pure: accepted; changes nothing. The trace is always reused per signature (shapes,
      dtypes, static values; a closure's plain values), and tensors `fn` reads are read afresh.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> xs = torch.arange(6.0, device="xla").reshape(3, 2)
    >>> total, sums = jb.scan(lambda c, x: (c + x, c + x), torch.zeros(2, device="xla"), xs)
    >>> sums.cpu().tolist()
    [[0.0, 1.0], [2.0, 4.0], [6.0, 9.0]]
  """
  if not callable(fn):
    raise errors.BadValueError(
        f"scan: fn is a {type(fn).__name__} ({fn!r:.60}); expected the step function "
        f"fn(carry, x) -> (new_carry, y).")
  remat = remat_policies.from_partition_fn(partition_fn, remat, "scan")
  _length(xs)
  bridged = _bridged(fn, remat)
  return bridged(init, xs, captures.collect_for_call(fn, bridged.name, (init, xs)))


def _length(xs: PyTree) -> int | None:
  jax = runtime.jax_module()
  leaves, _ = jax.tree_util.tree_flatten_with_path(xs)
  tensors = [(path, x) for path, x in leaves if isinstance(x, torch.Tensor)]
  if not tensors:
    raise errors.BadValueError("scan: xs holds no tensor; give the tensors to scan over (their "
                               "dim 0 is the number of steps).")
  lengths = {x.shape[0] if x.dim() else None for _, x in tensors}
  if len(lengths) != 1 or None in lengths:
    found = ", ".join(f"xs{jax.tree_util.keystr(p)}: {tuple(x.shape)}" for p, x in tensors)
    raise errors.BadValueError(
        f"scan: every tensor of xs must have the same length along dim 0 (the number of steps); "
        f"got {found}.")
  return lengths.pop()


def _bridged(fn: Callable, remat: remat_policies.RematArg) -> Bridged[_Scan]:
  table = _BY_FUNCTION.setdefault(fn, {})
  bridged = table.get(remat)
  if bridged is None:
    policy = remat_policies.policy_for(remat) or remat_policies.save_unfused
    name = getattr(fn, "__name__", type(fn).__name__)
    bridged = table[remat] = Bridged(_Scan(weakref.ref(fn), policy), name=f"scan_{name}")
  return bridged


class _Scan:
  """The bridged torch function: runs under torchax on the traced `init`, `xs` and captures."""

  def __init__(self, ref: Callable[[], Callable | None], policy: Callable) -> None:
    self.ref, self.policy = ref, policy

  def __call__(self, init: PyTree, xs: PyTree, lifted: captures.Lifted | None) -> PyTree:
    jax = runtime.jax_module()
    env = tracing.environment()
    unwrap, wrap = tracing.to_jax, tracing.to_torchax
    found = self.ref()
    assert found is not None, "called by `scan`, which holds the function"
    fn: Callable = found  # (mypy keeps no narrowing into `step`)
    drew: list[bool] = []

    def step(carry: PyTree, x: PyTree, key: Any) -> tuple[PyTree, PyTree]:
      carry_in, x_in = wrap(carry), wrap(x)
      with env.override_property(prng=key) if key is not None else contextlib.nullcontext():
        before = torchax_private.current_key(env)
        out = captures.call_with(fn, lifted, (carry_in, x_in), {})
        drew.append(torchax_private.current_key(env) is not before)
      _check_untouched(jax, (carry_in, x_in), (carry, x), "its carry or x")
      _check_untouched(jax, lifted, outside, "a tensor it reads from outside")
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise errors.BadArgumentError(
            f"scan: fn returned {type(out).__name__}; it must return (new_carry, y) (y may be "
            f"None).")
      new_carry, y = unwrap(tuple(out))
      _check_carry(jax, carry, new_carry)
      return new_carry, y

    outside = [t.jax() for t in jax.tree.leaves(lifted)]
    carry0, xs0 = unwrap(init), unwrap(xs)
    length = jax.tree.leaves(xs0)[0].shape[0]
    first_x = jax.tree.map(lambda a: a[0], xs0)
    jax.eval_shape(lambda c, x: step(c, x, jax.random.key(0)), carry0, first_x)
    keys = jax.random.split(env.get_and_rotate_prng_key(), length) if drew[0] else None
    body = jax.checkpoint(lambda c, xk: step(c, *xk), policy=self.policy)
    final, ys = jax.lax.scan(body, carry0, (xs0, keys), length=length)
    return grad_reads.like(wrap((final, ys)), (init, xs, lifted))


def _check_untouched(jax: types.ModuleType, wrapped: PyTree, arrays: PyTree, what: str) -> None:
  """`fn` must not update its inputs in place: the scan cannot give the update back."""
  for w, a in zip(jax.tree.leaves(wrapped), jax.tree.leaves(arrays)):
    if w.jax() is not a:
      raise errors.InPlaceInputError(
          f"scan: fn changed {what} (shape {tuple(w.shape)}) by an in-place operation; a step "
          f"cannot update its inputs. Work on a copy (`carry = carry.clone()`) or carry the "
          f"value and return its new value.")


def _check_carry(jax: types.ModuleType, carry: PyTree, new_carry: PyTree) -> None:
  old = jax.tree.map(lambda a: (a.shape, a.dtype), carry)
  new = jax.tree.map(lambda a: (a.shape, a.dtype), new_carry)
  if jax.tree.structure(carry) != jax.tree.structure(new_carry) or old != new:
    raise errors.BadArgumentError(
        f"scan: fn returned a carry of {new} for a carry of {old}; the new carry must have the "
        f"carry's structure, shapes and dtypes.")
