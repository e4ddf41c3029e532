"""Data-dependent control flow in bridged code: `torch.cond` becomes `jax.lax.cond`,
`torch._higher_order_ops.while_loop` becomes `jax.lax.while_loop`, and `fori_loop` gives a
differentiable loop with a fixed trip count.

Outside bridged code the same calls run torch's own implementations.
"""
import contextlib
import functools

import torch

from torch_xla_jaxbridge import errors, runtime


@functools.cache
def install():
  """Registers the lowering of torch's `cond` and `while_loop` for torchax tensors (once).

  Example:
    >>> install()
  """
  import torchax.tensor
  from torch._higher_order_ops.cond import cond_op
  from torch._higher_order_ops.while_loop import while_loop_op

  cond_op.py_impl(torchax.tensor.XLADispatchMode)(_cond)
  while_loop_op.py_impl(torchax.tensor.XLADispatchMode)(_while_loop)


@contextlib.contextmanager
def operators_direct():
  """Within this context `torch.cond` and `torch.while_loop` call their operators directly, as
  they do under torch.compile, instead of compiling themselves with Dynamo (which, run on torchax
  tensors, would leave Dynamo caches that break later eager calls).

  Example:
    >>> with operators_direct():
    ...   pass
  """
  before = torch.compiler.is_dynamo_compiling
  torch.compiler.is_dynamo_compiling = lambda: True
  try:
    yield
  finally:
    torch.compiler.is_dynamo_compiling = before


def _traced(fn, mode=None):
  """A torch function on torchax tensors as a function on JAX arrays."""
  from torch_xla_jaxbridge import convert

  def run(*arrays):
    # torch pops the dispatch mode while it runs a rule for it; put it back for the branch
    with mode if mode is not None else contextlib.nullcontext():
      return convert.to_jax(fn(*convert.to_torchax(arrays)))

  return run


def _cond(mode, pred, true_fn, false_fn, operands):
  from torch_xla_jaxbridge import convert

  jax = runtime.jax_module()
  predicate = convert.to_jax(pred)
  if hasattr(predicate, "shape") and predicate.shape not in ((), (1,)):
    raise errors.BadArgumentError(
        f"torch.cond: the predicate must be one boolean (a 0-d tensor), got shape "
        f"{tuple(predicate.shape)}; reduce it first, e.g. `(x > 0).all()`.")
  predicate = jax.numpy.reshape(predicate, ()).astype(bool)
  out = jax.lax.cond(predicate, _traced(true_fn, mode), _traced(false_fn, mode),
                     *convert.to_jax(tuple(operands)))
  return convert.to_torchax(out)


def _while_loop(mode, cond_fn, body_fn, carried_inputs, additional_inputs):
  from torch_xla_jaxbridge import convert

  jax = runtime.jax_module()
  extra = convert.to_jax(tuple(additional_inputs))
  test, step = _traced(cond_fn, mode), _traced(body_fn, mode)

  def keep_going(carry):
    return jax.numpy.reshape(test(*carry, *extra), ()).astype(bool)

  def advance(carry):
    return tuple(step(*carry, *extra))

  carried = tuple(convert.to_jax(tuple(carried_inputs)))
  return convert.to_torchax(jax.lax.while_loop(keep_going, advance, carried))


def fori_loop(lower, upper, body, init):
  """`for i in range(lower, upper): value = body(i, value)`, differentiable in bridged code.

  Inside bridged code the loop is one `jax.lax.fori_loop` (a scan: the trip count `upper -
  lower` must be a Python int), `i` is a 0-d tensor and gradients flow through it; outside, it is
  the plain Python loop with `i` an int. `init` is a tensor or a tuple of tensors.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> jb.fori_loop(0, 3, lambda i, x: x * 2, torch.ones(2)).tolist()
    [8.0, 8.0]
  """
  if not isinstance(lower, int) or not isinstance(upper, int):
    raise errors.BadArgumentError(
        f"fori_loop: lower and upper must be Python ints (got {type(lower).__name__}, "
        f"{type(upper).__name__}); for a trip count known only at run time use "
        f"torch._higher_order_ops.while_loop.while_loop (forward-only in bridged code).")
  from torch_xla_jaxbridge import convert

  leaves = init if isinstance(init, tuple) else (init,)
  torchax_tensor = convert.torchax_tensor_type()
  if torchax_tensor is None or not any(isinstance(t, torchax_tensor) for t in leaves):
    value = init
    for i in range(lower, upper):
      value = body(i, value)
    return value
  jax = runtime.jax_module()
  looped = jax.lax.fori_loop(lower, upper, _traced(body), convert.to_jax(init))
  return convert.to_torchax(looped)
