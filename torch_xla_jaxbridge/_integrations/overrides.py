"""Ops whose torchax conversion is replaced inside bridged code.

The package's own, always on: `F.linear` (for the form of its weight gradient) and
`F.scaled_dot_product_attention` (torch's values for fully masked rows), registered with `tracing`
on import (batch norm has its own module, `batch_norm`). The user's: `register_lowering`
gives a torch op or function a JAX implementation for good (a custom op's lowering), and
`override_ops` one while bridged code in a `with` block is traced (the block's win). Both are
trace keys, so a trace is never reused under other lowerings.
"""
import contextlib
import dataclasses
import math
import threading
import weakref
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


def linear(input, weight, bias=None):
  """`F.linear` whose weight gradient is one 2-D matmul over the input's leading dimensions folded
  together, as torch computes it. From torchax's einsum, JAX's weight gradient contracts two
  dimensions at once, and XLA:CPU copied the output gradient into a transposed layout for it
  (docs/performance.md has the measurement). The forward is torchax's einsum.

  Example:
    >>> import torch.nn.functional as F
    >>> from torch_xla_jaxbridge import bridge
    >>> bridge(F.linear)(torch.ones(2, 3, device="xla"), torch.ones(4, 3, device="xla")).shape
    torch.Size([2, 4])
  """
  tensor = tracing.torchax_tensor_type()
  if not all(isinstance(t, tensor) for t in (input, weight, bias) if t is not None):
    out = torch.matmul(input, weight.t())  # torchax says what is wrong with the others
    return out if bias is None else out + bias
  out = _folded_linear()(input.jax(), weight.jax())
  if bias is not None:
    out = out + bias.jax()
  return tensor(out, tracing.environment())


@threads.once
def _folded_linear():
  jax = runtime.jax_module()
  einsum = lambda x, w: jax.numpy.einsum("...a,ba->...b", x, w)  # noqa: E731

  @jax.custom_jvp
  def linear(x, w):
    return einsum(x, w)

  @linear.defjvp
  def linear_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    by_weight = jax.numpy.dot(_fold(x), dw.T).reshape(*x.shape[:-1], w.shape[0])
    return einsum(x, w), einsum(dx, w) + by_weight

  return linear


def _fold(x):
  """`x` with its leading dimensions folded: the same array for the same `x` within one
  `run_torch` call, so linears sharing an input (q, k, v) keep one copy of it for the backward.
  Held weakly: a traced value lives as long as the jaxpr trace that made it (which reports any
  other holder as a leak); where nothing keeps the fold alive, the next linear folds again."""
  folds = tracing.scoped_cache("linear_folds")
  cached = folds.get(id(x))
  if cached is not None and cached[0]() is x:
    folded = cached[1]()
    if folded is not None:
      return folded
  folded = x.reshape(-1, x.shape[-1])
  try:
    folds[id(x)] = (weakref.ref(x), weakref.ref(folded))
  except TypeError:  # a concrete array: nothing to share
    pass
  return folded


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
  """`F.scaled_dot_product_attention` in its math form, as torch computes it: a query whose
  every key is masked (the padding rows of a left-padded batch) gets zeros, as from torch's
  `_safe_softmax`, where torchax's form gives NaN that then spreads through the whole row.

  Example:
    >>> from torch_xla_jaxbridge import bridge
    >>> q = torch.ones(1, 1, 2, 4, device="xla")
    >>> mask = torch.tensor([[False, False], [True, True]], device="xla")
    >>> out = bridge(torch.nn.functional.scaled_dot_product_attention)(q, q, q, attn_mask=mask)
    >>> out[0, 0, :, 0].cpu().tolist()
    [0.0, 1.0]
  """
  length, keys = query.shape[-2], key.shape[-2]
  scores = query @ key.transpose(-2, -1)
  if enable_gqa:
    repeat = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scores = query @ key.transpose(-2, -1)
  scores = scores * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
  allowed = None
  if is_causal:
    allowed = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril()
  if attn_mask is not None and attn_mask.dtype == torch.bool:
    allowed = attn_mask if allowed is None else allowed & attn_mask
  elif attn_mask is not None:
    scores = scores + attn_mask
  if allowed is not None:
    scores = scores.masked_fill(~allowed, float("-inf"))
  dead = None
  if attn_mask is not None:  # a query with no key to attend to gets zeros; its softmax is kept
    dead = torch.isneginf(scores).all(-1, keepdim=True)  # finite (for the backward) and its
    scores = torch.where(dead, 0.0, scores)                # output zeroed after the matmul
  weights = torch.softmax(scores, dim=-1)
  if dropout_p > 0:
    weights = torch.dropout(weights, dropout_p, train=True)
  out = weights @ value
  return out if dead is None else torch.where(dead, 0.0, out)


tracing.register_op_override(torch.nn.functional.linear, linear)
tracing.register_op_override(torch.nn.functional.scaled_dot_product_attention,
                             scaled_dot_product_attention)
tracing.register_dispatch_wrapper(_dispatch)
tracing.register_trace_key("op overrides", active)
tracing.register_trace_key("registered lowerings", registered)
