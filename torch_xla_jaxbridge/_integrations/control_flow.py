"""Data-dependent control flow in bridged code: `torch.cond` becomes `jax.lax.cond`,
`torch._higher_order_ops.while_loop` becomes `jax.lax.while_loop`, and `fori_loop` gives a
differentiable loop with a fixed trip count.

Outside bridged code the same calls run torch's own implementations.
"""
import contextlib
from typing import Any, Callable


from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_private, torchax_private
from torch_xla_jaxbridge._core import grad_reads, runtime, threads, tracing


@threads.once
def _install():
  """Registers the lowering of torch's `cond` and `while_loop` for torchax tensors (once)."""
  operators = torch_private.higher_order_operators()
  torchax_private.register_higher_order_rule(operators["cond"], _cond)
  torchax_private.register_higher_order_rule(operators["while_loop"], _while_loop)


@contextlib.contextmanager
def traced_control_flow():
  """Around traced torch code: torch's control-flow operators run as JAX's (`torch.cond` calls its
  operator directly there, as under torch.compile: `trace_signals`).

  Example:
    >>> with traced_control_flow():
    ...   pass
  """
  _install()
  yield


tracing.register_trace_context(traced_control_flow)


def _traced(fn, mode=None):
  """A torch function on torchax tensors as a function on JAX arrays."""

  def run(*arrays):
    # torch pops the dispatch mode while it runs a rule for it; put it back for the branch
    with mode if mode is not None else contextlib.nullcontext():
      return tracing.to_jax(fn(*tracing.to_torchax(arrays)))

  return run


def _cond(mode, pred, true_fn, false_fn, operands):
  jax = runtime.jax_module()
  predicate = tracing.to_jax(pred)
  if hasattr(predicate, "shape") and predicate.shape not in ((), (1,)):
    raise errors.BadArgumentError(
        f"torch.cond: the predicate must be one boolean (a 0-d tensor), got shape "
        f"{tuple(predicate.shape)}; reduce it first, e.g. `(x > 0).all()`.")
  predicate = jax.numpy.reshape(predicate, ()).astype(bool)
  out = jax.lax.cond(predicate, _traced(true_fn, mode), _traced(false_fn, mode),
                     *tracing.to_jax(tuple(operands)))
  return grad_reads.like(tracing.to_torchax(out), operands)


def _while_loop(mode, cond_fn, body_fn, carried_inputs, additional_inputs):
  jax = runtime.jax_module()
  extra = tracing.to_jax(tuple(additional_inputs))
  test, step = _traced(cond_fn, mode), _traced(body_fn, mode)

  def keep_going(carry):
    return jax.numpy.reshape(test(*carry, *extra), ()).astype(bool)

  def advance(carry):
    return tuple(step(*carry, *extra))

  carried = tuple(tracing.to_jax(tuple(carried_inputs)))
  return grad_reads.like(tracing.to_torchax(jax.lax.while_loop(keep_going, advance, carried)),
                         (carried_inputs, additional_inputs))


def fori_loop(lower: int, upper: int, body: Callable, init: Any) -> Any:
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
  leaves = init if isinstance(init, tuple) else (init,)
  if not any(tracing.is_traced(t) for t in leaves):
    value = init
    for i in range(lower, upper):
      value = body(i, value)
    return value
  jax = runtime.jax_module()
  looped = jax.lax.fori_loop(lower, upper, _traced(body), tracing.to_jax(init))
  return grad_reads.like(tracing.to_torchax(looped), init)
