"""torch function -> JAX function, via torchax.

`run_torch` runs torch code on JAX values while JAX traces: every tensor the code sees is a torchax
tensor wrapping a traced array, randomness draws from a key passed in, and in-place updates of
arguments are reported so the caller can write them back.
"""
import contextlib
import functools
import os
import re
import sys
import traceback
import weakref

import torch

from torch_xla_jaxbridge import control_flow, errors, remat, runtime, spmd

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
LIBRARY_MARKERS = (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}", f"{os.sep}torch{os.sep}",
                    f"{os.sep}torchax{os.sep}", f"{os.sep}torch_xla{os.sep}", _PACKAGE_DIR)
_RECIPES_DIR = os.path.join(_PACKAGE_DIR, "recipes")


def is_library_file(filename):
  """Whether a frame in `filename` is library code (JAX, torch, torchax, this package), not the
  user's model (the recipes count as user models)."""
  if filename.startswith(_RECIPES_DIR):
    return False
  return any(marker in filename for marker in LIBRARY_MARKERS)


_DATA_DEPENDENT = ("TracerBoolConversionError", "ConcretizationTypeError",
                   "TracerIntegerConversionError", "NonConcreteBooleanIndexError",
                   "TracerArrayConversionError")


@functools.cache
def environment():
  """The torchax environment bridged code runs in (created on first use).

  New tensors (`torch.zeros(3)`, `torch.arange(n, device=x.device)`) are JAX values whatever
  device they name, and math between a torchax tensor and an outside torch tensor is an error
  rather than a silent constant.

  Example:
    >>> env = environment()
  """
  jax = runtime.jax_module()
  import torchax.config
  import torchax.tensor

  class BridgeEnvironment(torchax.tensor.Environment):

    def _should_use_torchax_tensor(self, device):
      return True

    def _is_same_device(self, the_tensor, new_device):
      return True

  with jax.ensure_compile_time_eval():  # its default key must be a constant even mid-trace
    env = BridgeEnvironment(
        torchax.config.Configuration(allow_mixed_math_with_scalar_tensor=False))
  for op in (torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.native_batch_norm):
    env.override_op_definition(op, _batch_norm)
  env.override_op_definition(torch.nn.functional.linear, _linear)
  for op, impl in _OP_OVERRIDES.items():
    env.override_op_definition(op, impl)
  control_flow.install()
  return env


_OP_OVERRIDES = {}


def override_op(op, impl):
  """Makes bridged code run `impl` (on torchax tensors) for the torch op `op`.

  Example:
    >>> override_op(torch.ops.aten.relu.default, lambda x: x.clamp(min=0))
  """
  _OP_OVERRIDES[op] = impl
  if environment.cache_info().currsize:
    environment().override_op_definition(op, impl)


def torchax_tensor_type():
  """torchax's tensor class, or None while torchax is not imported (then no tensor is one).

  Example:
    >>> torchax_tensor_type() is None or torchax_tensor_type().__name__ == "Tensor"
    True
  """
  return getattr(sys.modules.get("torchax.tensor"), "Tensor", None)


def to_jax(tree):
  """`tree` with each torchax tensor replaced by its JAX array; other leaves unchanged.

  Example:
    >>> to_jax({"n": 1})
    {'n': 1}
  """
  jax = runtime.jax_module()
  tensor = torchax_tensor_type()
  return jax.tree.map(lambda t: t._elem if tensor is not None and isinstance(t, tensor) else t,
                      tree, is_leaf=lambda t: isinstance(t, torch.Tensor))


def to_torchax(tree):
  """`tree` with each JAX array wrapped as a torchax tensor of the bridge environment.

  Example:
    >>> to_torchax((runtime.jax_module().numpy.ones(2),))[0].shape
    torch.Size([2])
  """
  jax = runtime.jax_module()
  env = environment()
  import torchax.tensor

  return jax.tree.map(
      lambda a: torchax.tensor.Tensor(a, env) if isinstance(a, jax.Array) else a, tree)


def _linear(input, weight, bias=None):
  """`F.linear` whose weight gradient is one 2-D matmul over the input's leading dimensions folded
  together, as torch computes it. From torchax's einsum, JAX's weight gradient contracts two
  dimensions at once, and XLA:CPU copied the output gradient into a transposed layout for it (about
  a quarter of a decoder stack's training step, on one core). The forward is torchax's einsum."""
  tensor = torchax_tensor_type()
  if not all(isinstance(t, tensor) for t in (input, weight, bias) if t is not None):
    out = torch.matmul(input, weight.t())  # torchax says what is wrong with the others
    return out if bias is None else out + bias
  out = _folded_linear()(input._elem, _fold(input._elem), weight._elem)
  if bias is not None:
    out = out + bias._elem
  return tensor(out, input._env)


@functools.cache
def _folded_linear():
  jax = runtime.jax_module()
  einsum = lambda x, w: jax.numpy.einsum("...a,ba->...b", x, w)  # noqa: E731

  @jax.custom_jvp
  def linear(x, folded, w):  # `folded` is `x` as 2-D; only the weight's tangent reads it
    return einsum(x, w)

  @linear.defjvp
  def linear_jvp(primals, tangents):
    (x, folded, w), (dx, _, dw) = primals, tangents
    by_weight = jax.numpy.dot(folded, dw.T).reshape(*x.shape[:-1], w.shape[0])
    return einsum(x, w), einsum(dx, w) + by_weight

  return linear


def _fold(x):
  """`x` with its leading dimensions folded: the same array for the same `x` within one trace, so
  linears sharing an input (q, k, v) keep one copy of it for the backward. The folds are kept on
  the trace, so they end with it; on a jaxpr trace's frame only weakly (the frame keeps its
  values alive itself, and JAX reports any other holder as a leak)."""
  from jax._src import core

  if not isinstance(x, core.Tracer):
    return x.reshape(-1, x.shape[-1])
  trace = core.trace_ctx.trace
  frame = getattr(trace, "frame", None)
  holder, hold = (trace, lambda v: lambda: v) if frame is None else (frame, weakref.ref)
  folds = getattr(holder, "_bridge_folds", None)
  if folds is None:
    folds = {}
    try:
      holder._bridge_folds = folds
    except AttributeError:  # a trace kind with fixed attributes: fold without sharing
      pass
  cached = folds.get(id(x))
  if cached is not None and cached[0]() is x and cached[1]() is not None:
    return cached[1]()
  folded = x.reshape(-1, x.shape[-1])
  folds[id(x)] = (hold(x), hold(folded))
  return folded


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
  """Batch norm that updates the running statistics in place, as torch does (torchax's drops
  the update), with the unbiased batch variance for `running_var`."""
  jax = runtime.jax_module()
  import torchax.tensor
  from torchax.ops import jaten

  elem = lambda t: None if t is None else t._elem  # noqa: E731
  x = elem(input)
  out, mean, rstd = jaten._aten__native_batch_norm_legit(
      x, elem(weight), elem(bias), elem(running_mean), elem(running_var), training, momentum, eps)
  if training and running_mean is not None:
    axes = [0] + list(range(2, x.ndim))
    count = x.size // x.shape[1]
    unbiased = jax.numpy.var(x, axis=axes) * count / max(count - 1, 1)
    for stat, batch in ((running_mean, mean), (running_var, unbiased)):
      stat._elem = ((1 - momentum) * stat._elem + momentum * batch).astype(stat._elem.dtype)
  env = input._env
  return tuple(torchax.tensor.Tensor(a, env) for a in (out, mean, rstd))


def run_torch(fn, key_data, args, kwargs, *, fn_name):
  """Calls torch `fn(*args, **kwargs)` on the JAX arrays in `args`/`kwargs`, inside a JAX trace.

  Returns `(outputs, mutated, drew_random)`: outputs with JAX arrays for tensors; a dict from the
  position of each argument array (in `jax.tree.leaves((args, kwargs))` order) that the code
  updated in place to its new value; whether the code drew random numbers. `key_data` (int32[2])
  seeds every random op.

  Example:
    >>> jax = runtime.jax_module()
    >>> out, mutated, drew = run_torch(torch.sin, None, (jax.numpy.zeros(2),), {}, fn_name="sin")
  """
  jax = runtime.jax_module()
  import torchax.tensor

  env = environment()
  leaves, treedef = jax.tree.flatten((args, kwargs))
  wrapped = [torchax.tensor.Tensor(x, env) if isinstance(x, jax.Array) else x for x in leaves]
  t_args, t_kwargs = treedef.unflatten(wrapped)
  prng = _key(jax, key_data) if key_data is not None else None
  try:
    with (env.override_property(prng=prng) if prng is not None else contextlib.nullcontext(), env,
          remat.torch_checkpoint_as_jax(), control_flow.operators_direct(),
          spmd.mark_sharding_traced()):
      outputs = fn(*t_args, **(t_kwargs or {}))
      drew_random = prng is not None and env.param.prng is not prng  # the key was split
  except errors.BridgeError:
    raise
  except Exception as e:
    raise _translate(e, fn_name) from e
  mutated = {i: w._elem for i, (w, x) in enumerate(zip(wrapped, leaves))
             if isinstance(w, torchax.tensor.Tensor) and w._elem is not x}
  return _unwrap(jax, outputs, fn_name), mutated, drew_random


def _key(jax, key_data):
  bits = jax.lax.bitcast_convert_type(key_data, jax.numpy.uint32)
  return jax.random.wrap_key_data(bits)


def _unwrap(jax, outputs, fn_name):
  import torchax.tensor

  def unwrap(x):
    if isinstance(x, torchax.tensor.Tensor):
      return x._elem
    if isinstance(x, torchax.tensor.View):
      return x.torch()._elem
    if isinstance(x, torch.Tensor):
      raise errors.CapturedTensorError(
          f"{fn_name} returned a torch tensor that is not computed from its arguments (shape "
          f"{tuple(x.shape)}, device {x.device}). Tensors the function reads from an enclosing "
          f"scope, a global or an attribute must be passed in as arguments.")
    return x

  return jax.tree.map(unwrap, outputs, is_leaf=lambda x: isinstance(x, torch.Tensor))


def user_frame(exc):
  """`file:line: source` of the innermost frame of `exc`'s traceback that is user code."""
  for frame in reversed(traceback.extract_tb(exc.__traceback__)):
    if not is_library_file(frame.filename):
      return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
  return "<unknown line>"


def _rewrite_hint(source):
  """Two lines showing how to write the user's data-dependent line with tensors."""
  branch = re.match(r"\s*(?:el)?if (.+?):\s*$", source)
  loop = re.match(r"\s*while (.+?):\s*$", source)
  if branch:
    test = branch.group(1)
    return (f"  y = torch.cond({test}, lambda x: <value if true>, lambda x: <value if false>, (x,))\n"
            f"  y = torch.where({test}, <value if true>, <value if false>)  # element by element")
  if loop:
    return (f"  state = torch.while_loop(lambda s: {loop.group(1)}, lambda s: (<next s>,), (s,))\n"
            f"  state = jb.fori_loop(0, n, lambda i, s: <next s>, s)  # fixed count, differentiable")
  if ".item()" in source or ".tolist()" in source:
    return ("  s = x.max()          # keep the value a tensor (no .item())\n"
            "  y = x * s            # and use it in tensor math")
  return ("  y = torch.where(mask, x, 0)   # instead of x[mask]\n"
          "  y = (x * mask).sum()          # instead of x[mask].sum() or nonzero()")


def _translate(exc, fn_name):
  where = user_frame(exc)
  kind = type(exc).__name__
  if kind in _DATA_DEPENDENT or "nonzero" in str(exc) or "data-dependent" in str(exc):
    return errors.DataDependentError(
        f"{fn_name}: data-dependent Python control flow at {where}\n"
        f"The value of a tensor is not known while bridged code is traced ({kind}), so it "
        f"cannot steer Python (`if`, `while`, `.item()`, `nonzero`, boolean-mask indexing). "
        f"Write it with tensors, for example:\n{_rewrite_hint(where.split(': ', 1)[-1])}\n"
        f"See docs/control_flow.md (torch.cond, torch.while_loop, jb.fori_loop).")
  if isinstance(exc, AssertionError) and "mixed math" in str(exc):
    return errors.CapturedTensorError(
        f"{fn_name}: a torch tensor that is not an argument of the bridged function was used at "
        f"{where}. Tensors read from an enclosing scope, a global or an attribute are not part "
        f"of the traced program: pass them in as arguments (or register them as parameters or "
        f"buffers of the module).")
  return errors.JaxTracingError(f"{fn_name} failed while being traced, at {where}: "
                                f"{kind}: {exc}")
