"""A recomputation that really happens in the backward: run in a conditional XLA cannot fold.

A bridged step is one XLA program. In line, XLA merges a remat policy's recomputation with the
forward it repeats (or runs it early) and keeps its values, so the policy saves nothing. A
conditional's branch is its own computation, run only once the cotangents exist, its values freed
when it returns. Bridged calls with a policy, bridged calls in bridged code and torch's
checkpoint inside bridged code all put their backward there. A scan over stacked layers reads
its saved residuals whole in the backward (`residuals_read_whole`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch_xla_jaxbridge._compat import jaxpr_private
from torch_xla_jaxbridge._core import runtime, threads

_DIFFERENTIATED = threads.Switch()  # on: the function being traced is under jax.vjp / grad


@contextlib.contextmanager
def differentiated() -> Iterator[None]:
  """While tracing in the block, code inside the traced function knows that it is being
  differentiated: a `jax.checkpoint` there then wraps itself in `sequenced`.

  Example:
    >>> with differentiated():
    ...   is_differentiated()
    True
    >>> is_differentiated()
    False
  """
  with _DIFFERENTIATED.on():
    yield


def is_differentiated() -> bool:
  """Whether the function being traced (in this thread) is under `differentiated()`.

  Example:
    >>> is_differentiated()
    False
  """
  return _DIFFERENTIATED.is_on()


def sequenced(fn: Callable) -> Callable:
  """`fn` (a `jax.checkpoint`ed function) whose backward runs in `in_conditional`: inside one
  enclosing trace (a bridged call in bridged code, `jb.train_step`) XLA would otherwise merge the
  recomputation with the forward, as it does across two nodes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = sequenced(jax.checkpoint(jnp.sin))
    >>> "cond" in str(jax.make_jaxpr(jax.grad(f))(1.0))
    True
  """
  jax = runtime.jax_module()

  @jax.custom_vjp
  def call(*arrays: Any) -> Any:
    return fn(*arrays)

  def forward(*arrays: Any) -> Any:
    return jax.vjp(fn, *arrays)

  def backward(vjp: Any, cotangent: Any) -> Any:
    leaves, tree = jax.tree.flatten(vjp)
    cts, ct_tree = jax.tree.flatten(cotangent)
    inexact = [i for i, c in enumerate(cts) if jax.numpy.issubdtype(c.dtype, jax.numpy.inexact)]

    # the float0 cotangents of integer outputs stay outside the conditional
    def run(r: list, c: list) -> Any:
      full = list(cts)
      for i, value in zip(inexact, c):
        full[i] = value
      return tree.unflatten(r)(ct_tree.unflatten(full))

    floats = [cts[i] for i in inexact]
    if not any(c.size for c in floats):
      return run(leaves, floats)
    return in_conditional(run, leaves, floats)

  call.defvjp(forward, backward)
  return call


def sequenced_call(fn: Callable, *arrays: Any) -> Any:
  """`sequenced(fn)(*arrays)` for a `fn` that closes over traced values (a torch function reading
  its module's parameters): a `custom_vjp` function must take every traced value it uses as an
  argument, so `fn` is traced to a jaxpr once and its closed-over values passed along.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> w = jnp.float32(2.0)
    >>> grad = jax.grad(lambda w: sequenced_call(jax.checkpoint(lambda x: jnp.sin(x * w)), 1.0))
    >>> round(float(grad(w)), 4)  # cos(2)
    -0.4161
  """
  jax = runtime.jax_module()
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*arrays)
  count, tree = len(arrays), jax.tree.structure(shapes)

  def evaluate(*values: Any) -> Any:
    inputs, consts = values[:count], list(values[count:])
    return jax.tree.unflatten(tree, jaxpr_private.jaxpr_function(closed.jaxpr, consts)(
        *jax.tree.leaves(inputs)))

  return sequenced(evaluate)(*arrays, *closed.consts)


def in_conditional(vjp: Callable, residuals: list, cotangents: list) -> Any:
  """`vjp(residuals, cotangents)` inside a conditional XLA cannot fold (its predicate is true for
  every value of the first cotangent, NaN included).

  Example:
    >>> import jax.numpy as jnp
    >>> float(in_conditional(lambda r, c: r[0] * c[0], [jnp.array(2.0)], [jnp.array(3.0)]))
    6.0
  """
  jax = runtime.jax_module()
  first = jax.numpy.real(next(c for c in cotangents if c.size).ravel()[0])
  always = ~((first < 0) & (first >= 0))  # true for every value, NaN included
  nothing = lambda r, c: jax.tree.map(jax.numpy.zeros_like, jax.eval_shape(vjp, r, c))  # noqa
  return jax.lax.cond(always, vjp, nothing, residuals, cotangents)


def residuals_read_whole(body: Callable) -> Callable:
  """`body` (a scan's body) with a backward that reads its saved residuals through an
  optimization barrier. Without it XLA:CPU fuses the slicing of the stacked residuals into the
  kernels that consume them, and those kernels (transposes feeding the weight-gradient matmuls)
  ran several times slower than on whole arrays (measured in docs/performance.md). Use it only
  where a backward follows: tracing the rule's primal without one keeps the tensors `body`
  closes over in JAX's trace cache past the trace (a `LeakedTensorError`).

  Example:
    >>> jax = runtime.jax_module()
    >>> body = residuals_read_whole(lambda c, x: (c * x, None))
    >>> float(jax.grad(lambda c: jax.lax.scan(body, c, jax.numpy.arange(1.0, 4.0))[0])(2.0))
    6.0
  """
  jax = runtime.jax_module()

  @jax.custom_vjp
  def scanned(carry: Any, xs: Any) -> Any:
    return body(carry, xs)

  def forward(carry: Any, xs: Any) -> Any:
    return jax.vjp(body, carry, xs)  # the backward function is a pytree of the residuals

  def backward(saved: Any, cotangent: Any) -> Any:
    return jax.lax.optimization_barrier(saved)(cotangent)

  scanned.defvjp(forward, backward)
  return scanned
