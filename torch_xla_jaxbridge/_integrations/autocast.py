"""`torch.autocast("xla", ...)` inside bridged code, as torch_xla applies it to LazyTensor code.

torch's autocast works in the dispatcher on XLA tensors; traced code runs on torchax tensors,
which it never sees. So the bridge applies torch_xla's policy itself: every op torchax converts
goes through `_dispatch`, which, while torch's `"xla"` autocast is on, casts the floating-point
tensor arguments (torchax's views of them too) of the ops in `XLA_POLICY` (matmul-like ops to the
autocast dtype, softmax, losses and linear algebra to float32, `cat`/`stack` to the widest input
dtype) and runs the op with autocast off for the ops it calls, as torch's autocast kernels do.
The state is read from torch at each op, so `with torch.autocast(...)` written inside the
bridged function works too.
The state at each bridged call is a trace key (`tracing.register_trace_key`): entering or leaving
autocast re-traces once. `torch.autocast("cpu")` does not touch XLA tensors, so it does not
touch bridged code either. Ops outside these lists (layer and group norm, GELU, SiLU) run in their
inputs' dtype under torch_xla's autocast too; their precision is `low_precision`'s.
"""
import dataclasses
import sys
import threading

import torch

from torch_xla_jaxbridge._compat import torch_dispatch_private, torchax_private
from torch_xla_jaxbridge._core import dtypes, runtime, threads, tracing

LOWER, FP32, PROMOTE = "lower_precision_fp", "fp32", "promote"

_LOWER_OPS = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm",
    "mm", "baddbmm", "addmm", "addbmm", "linear", "matmul", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "relu", "max_pool2d", "einsum")
_FP32_OPS = (
    "batch_norm", "_softmax", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "binary_cross_entropy", "prod", "prod.dim_int", "prod.dim_Dimname",
    "cdist", "trace", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "qr", "svd", "triangular_solve",
    "multilabel_margin_loss_forward", "linalg_svd", "linalg_inv_ex", "pow.Tensor_Scalar")
_PROMOTE_OPS = ("stack", "cat", "index_copy", "index_copy.dimname")

# torch_xla's AutocastXLA kernels (torch_xla/csrc/autocast_mode.cpp), by "aten::name.overload";
# test_autocast checks this names exactly the ops torch's dispatcher has AutocastXLA kernels for
XLA_POLICY = {f"aten::{op}": policy for ops, policy in
              ((_LOWER_OPS, LOWER), (_FP32_OPS, FP32), (_PROMOTE_OPS, PROMOTE)) for op in ops}


@dataclasses.dataclass(frozen=True)
class State:
  """torch's `"xla"` autocast state at a bridged call: part of its trace-cache key.

  Example:
    >>> str(State(False, torch.bfloat16, True))
    'off'
  """
  enabled: bool
  dtype: torch.dtype
  cache: bool

  def __str__(self):
    if not self.enabled:
      return "off"
    dtype = str(self.dtype).removeprefix("torch.")
    return f"xla {dtype} (weight cache {'on' if self.cache else 'off'})"


def current_state() -> State:
  """The `"xla"` autocast state now.

  Example:
    >>> with torch.autocast("xla", dtype=torch.bfloat16):
    ...   print(current_state())
    xla bfloat16 (weight cache on)
  """
  enabled = torch.is_autocast_enabled("xla")
  return State(enabled, torch.get_autocast_dtype("xla") if enabled else torch.float32,
               torch.is_autocast_cache_enabled() if enabled else True)


_LOCAL = threading.local()  # .tracing: inside run_torch; .inside: inside an op autocast cast for


def policy_for(func):
  """torch_xla's autocast policy for an op torchax converts (an aten op, or a torch function such
  as `F.linear` or `Tensor.softmax` named as its aten op), or None.

  Example:
    >>> policy_for(torch.ops.aten.mm.default), policy_for(torch.softmax), policy_for(torch.sin)
    ('lower_precision_fp', 'fp32', None)
  """
  if getattr(func, "overloadpacket", None) is not None:  # an aten op overload
    name = func.name()
    return XLA_POLICY.get(name, XLA_POLICY.get(_DECOMPOSED.get(name, "")))
  name = getattr(func, "__name__", None)
  return _function_policies().get(_FUNCTION_ALIASES.get(name, name))


# ops of the table whose torch decomposition reaches torchax instead of them (inside
# F.cross_entropy, log_softmax is aten::_log_softmax and nll_loss is aten::nll_loss_forward)
_DECOMPOSED = {"aten::_log_softmax": "aten::log_softmax.int",
               "aten::nll_loss_forward": "aten::nll_loss",
               "aten::nll_loss2d_forward": "aten::nll_loss2d"}
# torch functions named differently from their aten op
_FUNCTION_ALIASES = {"cross_entropy": "cross_entropy_loss"}
# overloads their torch function never reaches (torch.einsum, which torchax converts whole, parses
# its sublist form into an equation in Python)
_UNREACHED = frozenset(["einsum.sublist"])


@threads.once
def _function_policies():
  """Policies by torch function name: an aten op all of whose (non-`out`) overloads share one."""
  found = {}
  for name in {key.removeprefix("aten::").split(".")[0] for key in XLA_POLICY}:
    overloads = [o for o in getattr(torch.ops.aten, name).overloads()
                 if not o.endswith("out") and f"{name}.{o}" not in _UNREACHED]
    policies = {XLA_POLICY.get(f"aten::{name}" + ("" if o == "default" else f".{o}"))
                for o in overloads}
    if len(policies) == 1 and None not in policies:
      found[name] = policies.pop()
  return found


def _traced(value):
  """A torchax tensor, or torchax's view of one (`x[0]`, `x.chunk(2)`: its `View` class)."""
  view = getattr(sys.modules.get("torchax.tensor"), "View", None)
  return tracing.is_traced(value) or view is not None and isinstance(value, view)


def _eligible(value):
  return _traced(value) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value, dtype):
  if not _eligible(value) or value.dtype == dtype:
    return value
  array = (value if tracing.is_traced(value) else value.torch()).jax()
  return tracing.to_torchax(array.astype(dtypes.to_jax(dtype)))


def _apply(policy, args, kwargs, low):
  jax = runtime.jax_module()
  is_tensor = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
  if policy == LOWER:
    target = low
  elif policy == FP32:
    target = torch.float32
  else:  # PROMOTE: the widest floating dtype among the arguments, starting from the low one
    target = low
    for leaf in jax.tree.leaves((args, kwargs), is_leaf=is_tensor):
      if _traced(leaf) and leaf.is_floating_point():
        target = torch.promote_types(target, leaf.dtype)
  return jax.tree.map(lambda x: _cast(x, target), (args, kwargs), is_leaf=is_tensor)


def _live_state():
  enabled = torch.is_autocast_enabled("xla")
  return (enabled, torch.get_autocast_dtype("xla") if enabled else None)


def _dispatch(dispatch, func, types, args, kwargs):
  """torchax's conversion of one op, with torch_xla's autocast policy applied to its arguments.

  torch reads autocast as off at the aten level (below its autocast dispatch keys), so an aten op
  uses the state read at the innermost torch function it came from, or at the start of the trace.
  """
  if not getattr(_LOCAL, "tracing", 0) or _LOCAL.inside:
    return dispatch(func, types, args, kwargs)
  is_function = not torch_dispatch_private.is_op(func)
  saved = _LOCAL.state
  if is_function:
    _LOCAL.state = _live_state()
  enabled, low = _LOCAL.state
  policy = policy_for(func) if enabled else None
  try:
    if policy is not None:
      args, kwargs = _apply(policy, args, kwargs or {}, low)
      _LOCAL.inside = 1  # the op's own ops run without autocast, as under torch's autocast kernels
    try:
      return dispatch(func, types, args, kwargs)
    except torchax_private.operator_not_found():
      if not is_function or func.__name__ == "rot90":  # torchax special-cases rot90 itself
        raise
      # torchax would run a torch function it does not convert as torch's own code after this
      # returns, with the arguments it was given; run it here, with the cast ones and the state
      return func(*args, **(kwargs or {}))
  finally:
    _LOCAL.state, _LOCAL.inside = saved, 0


class _Tracing:
  """Entered around each traced torch call: autocast applies to the ops converted inside."""

  def __enter__(self):
    self.saved = (getattr(_LOCAL, "tracing", 0), getattr(_LOCAL, "inside", 0),
                  getattr(_LOCAL, "state", None))
    _LOCAL.tracing, _LOCAL.inside, _LOCAL.state = 1, 0, _live_state()
    return self

  def __exit__(self, *exc):
    _LOCAL.tracing, _LOCAL.inside, _LOCAL.state = self.saved
    return False


tracing.register_dispatch_wrapper(_dispatch)
tracing.register_trace_context(_Tracing)
tracing.register_trace_key("autocast", current_state)
