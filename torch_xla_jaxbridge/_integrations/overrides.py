"""Ops whose torchax conversion is replaced inside bridged code.

The user's (the package's own, always on, are in `torch_ops`): `register_lowering` gives a torch
op or function a JAX implementation for good (a custom op's lowering), and `override_ops` one
while bridged code in a `with` block is traced (the block's win). Both are trace keys, so a trace
is never reused under other lowerings.
"""
import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, Mapping

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime, threads, tracing

_SCOPES = threading.local()  # .active: the overrides in force on this thread (an `Active`)


@dataclasses.dataclass(frozen=True)
class Active:
  """The overrides in force: `(op, jax_fn)` pairs; part of every bridged call's trace key.

  Example:
    >>> str(Active(((torch.nn.functional.gelu, abs),)))
    '{gelu: abs}'
  """
  pairs: tuple = ()

  def __str__(self):
    if not self.pairs:
      return "none"
    return "{" + ", ".join(f"{_name(op)}: {_name(fn)}" for op, fn in self.pairs) + "}"

  def lookup(self, func):
    """The JAX function for `func` (an aten overload also matches by its packet), or None."""
    if not self.pairs:
      return None
    packet = getattr(func, "overloadpacket", None)
    for op, fn in self.pairs:
      if op is func or (packet is not None and op is packet) or getattr(
          op, "overloadpacket", None) is func:
        return fn
    return None


def _name(value):
  return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def active() -> Active:
  """The overrides in force on this thread.

  Example:
    >>> str(active())
    'none'
  """
  return getattr(_SCOPES, "active", Active())


def registered() -> Active:
  """The lowerings `register_lowering` gave.

  Example:
    >>> isinstance(registered(), Active)
    True
  """
  return _REGISTERED[0]


_REGISTERED = [Active()]  # `registered()`, replaced at each registration


_ATEN_OP_TYPES = (type(torch.ops.aten.mm), type(torch.ops.aten.mm.default))


@threads.once
def _torch_functions():
  return frozenset(f for fs in torch.overrides.get_overridable_functions().values() for f in fs)


def _check(overrides, caller="override_ops"):
  if not isinstance(overrides, Mapping):
    raise errors.BadArgumentError(
        f"{caller}: expected a dict from torch op or function to JAX function, got "
        f"{type(overrides).__name__}; e.g. {{F.scaled_dot_product_attention: my_attention}}.")
  for op, fn in overrides.items():
    if not (isinstance(op, _ATEN_OP_TYPES) or op in _torch_functions()):
      raise errors.BadArgumentError(
          f"{caller}: {_name(op)} is neither a torch function that dispatches on tensors "
          f"(such as F.scaled_dot_product_attention or torch.matmul) nor an aten op "
          f"(torch.ops.aten.mm.default), so bridged code would never reach the override. Key "
          f"the override by the torch function the code calls.")
    if not callable(fn):
      raise errors.BadArgumentError(
          f"{caller}: the override of {_name(op)} is a {type(fn).__name__}; expected a "
          f"function of JAX arrays returning JAX arrays.")
    try:
      hash(fn)
    except TypeError:
      raise errors.BadArgumentError(
          f"{caller}: the override of {_name(op)} is not hashable; it keys the trace cache. "
          f"Pass a function (or functools.partial of hashable values).") from None


@contextlib.contextmanager
def override_ops(overrides: Mapping[Callable, Callable]) -> Iterator[None]:
  """Inside the block, bridged code that is traced runs `overrides[op]` for each torch `op`.

  Keys are torch functions the code calls (`F.scaled_dot_product_attention`, `torch.matmul`,
  `torch.Tensor.softmax`) or aten ops (`torch.ops.aten.mm.default`). Each value is a JAX function
  with the op's signature: tensor arguments arrive as JAX arrays, the rest as given; it returns
  JAX arrays (or a pytree of them). Its gradient is JAX's: `jax.vjp` of it, or its own
  `custom_vjp`. Scopes nest (the inner one wins per op) and are per thread. Only bridged calls
  (`bridge`, `BridgeModule`, `scan_layers`, `StackedLayers`, `jaxify`'d functions) made inside
  the block see the overrides; LazyTensor code runs torch's op as always. The active overrides
  are part of each bridged call's trace key: a call traced under other overrides (or none) is
  traced again, once. Build the dict once: each new function object is a new key.

  Example:
    >>> import jax, torch, torch_xla_jaxbridge as jb
    >>> double_gelu = lambda x, approximate="none": 2 * jax.nn.gelu(x, approximate=False)
    >>> f = jb.bridge(torch.nn.functional.gelu)
    >>> x = torch.ones(2, device="xla")
    >>> with jb.override_ops({torch.nn.functional.gelu: double_gelu}):
    ...   inside = f(x)
    >>> (inside / f(x)).cpu().tolist()
    [2.0, 2.0]
  """
  _check(overrides)
  outer = active()
  merged = dict(outer.pairs)
  merged.update(overrides)
  _SCOPES.active = Active(tuple(merged.items()))
  try:
    yield
  finally:
    _SCOPES.active = outer


def register_lowering(op: Callable, jax_fn: Callable) -> None:
  """Bridged code runs `jax_fn` wherever it calls `op`, from now on (again: replaces).

  For ops torchax cannot convert, such as custom ops made with `torch.library` whose body is not
  torch code, or to replace a conversion for good. `op` is a torch op (`torch.ops.ns.op`, or one
  overload of it) or a torch function; `jax_fn` has the op's signature on JAX arrays, as for
  `override_ops` (whose blocks win over a registration), and its gradient is JAX's. Plain
  LazyTensor code keeps running the op's own kernels. The registrations are a trace key: calls
  traced before a registration are traced again, once.

  Example:
    >>> import jax, torch, torch_xla_jaxbridge as jb
    >>> lib = torch.library.Library("demo_lowering", "DEF")
    >>> _ = lib.define("twice(Tensor x) -> Tensor")
    >>> jb.register_lowering(torch.ops.demo_lowering.twice, lambda x: 2 * x)
    >>> jb.bridge(torch.ops.demo_lowering.twice)(torch.ones(2, device="xla")).cpu().tolist()
    [2.0, 2.0]
  """
  _check({op: jax_fn}, "register_lowering")
  with _REGISTRATION:
    pairs = dict(registered().pairs)
    pairs[op] = jax_fn
    _REGISTERED[0] = Active(tuple(pairs.items()))


_REGISTRATION = threading.Lock()


def _dispatch(dispatch, func, types, args, kwargs):
  """torchax's conversion of one op, unless an active override or a registration names it."""
  fn = active().lookup(func) or registered().lookup(func)
  if fn is None or not any(tracing.is_traced(leaf) for leaf in _leaves((args, kwargs))):
    return dispatch(func, types, args, kwargs)
  jax = runtime.jax_module()
  outputs = fn(*_arrays(tuple(args)), **_arrays(dict(kwargs or {})))
  for leaf in jax.tree.leaves(outputs):
    if not isinstance(leaf, jax.Array):
      raise errors.UsageError(
          f"the JAX lowering of {_name(func)} ({_name(fn)}) returned a {type(leaf).__name__}; "
          f"a lowering returns JAX arrays (or a pytree of them).")
  return tracing.to_torchax(outputs)


def _leaves(tree):
  return runtime.jax_module().tree.leaves(tree, is_leaf=lambda t: isinstance(t, torch.Tensor))


def _arrays(tree):
  """`tree` with torchax tensors (and views of them) as their JAX arrays."""
  import torchax.tensor

  return tracing.to_jax(runtime.jax_module().tree.map(
      lambda t: t.torch() if isinstance(t, torchax.tensor.View) else t, tree,
      is_leaf=lambda t: isinstance(t, torch.Tensor)))


tracing.register_dispatch_wrapper(_dispatch)
tracing.register_trace_key("op overrides", active)
tracing.register_trace_key("registered lowerings", registered)
