"""Reading and rebuilding JAX's jaxprs (`jax.extend.core` and the `jax._src` parts it lacks), one
function each: how `_core.layer_chains` compares traced layer calls and runs a program in pieces.

`test/test_compat.py` checks each directly, so a JAX version bump fails there by name.
"""
from __future__ import annotations

from typing import Any, Callable

from torch_xla_jaxbridge._compat.jax_private import _jax


def outer_scope(eqn: Any, prefix: str) -> str | None:
  """The outermost name scope (`jax.named_scope`) starting with `prefix` that a jaxpr equation
  was traced in, or None. Reads `source_info.name_stack.stack`, JAX's internal record of scopes
  (public alternative: none; the printed name stack joins scopes with "/").

  Example:
    >>> jax = _jax()
    >>> def f(x):
    ...   with jax.named_scope("layer_3"):
    ...     return x * 2
    >>> outer_scope(jax.make_jaxpr(f)(1.0).jaxpr.eqns[0], "layer_")
    'layer_3'
  """
  for scope in eqn.source_info.name_stack.stack:
    name = getattr(scope, "name", None)
    if isinstance(name, str) and name.startswith(prefix):
      return name
  return None


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr equation's input is a literal (a constant written into the equation).

  Example:
    >>> jax = _jax()
    >>> is_literal(jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0].invars[1])
    True
  """
  _jax()
  from jax.extend import core

  return isinstance(atom, core.Literal)


def is_jaxpr(value: Any) -> bool:
  """Whether an equation parameter is a jaxpr (open or closed).

  Example:
    >>> jax = _jax()
    >>> is_jaxpr(jax.make_jaxpr(lambda x: x)(1.0))
    True
  """
  _jax()
  from jax.extend import core

  return isinstance(value, (core.Jaxpr, core.ClosedJaxpr))


def jaxpr_consts(value: Any) -> list:
  """A closed jaxpr's constants (none for an open one).

  Example:
    >>> jax = _jax()
    >>> jaxpr_consts(jax.make_jaxpr(lambda x: x)(1.0))
    []
  """
  return list(getattr(value, "consts", ()))


def function_code(value: Any) -> tuple | None:
  """The code of a function-valued equation parameter (a plain function, a partial, or JAX's
  wrapped function of a custom rule), with the code of the functions it closes over; None for
  other values. Two parameters with equal code compute alike where their jaxprs are equal.

  Example:
    >>> double = lambda x: x * 2
    >>> function_code(double) == function_code(double), function_code(3) is None
    (True, True)
  """
  import functools

  from jax._src import linear_util

  seen: list = []

  def walk(fn, depth):
    if isinstance(fn, linear_util.WrappedFun):
      return ("wrapped", walk(fn.f, depth))
    if isinstance(fn, functools.partial):
      return ("partial", walk(fn.func, depth))
    code = getattr(fn, "__code__", None)
    if code is None or depth > 4 or any(fn is s for s in seen):
      return code
    seen.append(fn)
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if _cell_full(c)]
    return (code, tuple(walk(c, depth + 1) for c in cells if callable(c)))

  if not (callable(value) or isinstance(value, linear_util.WrappedFun)):
    return None
  return walk(value, 0)


def _cell_full(cell) -> bool:
  try:
    cell.cell_contents
  except ValueError:
    return False
  return True


def equations_function(invars: list, outvars: list, eqns: list) -> Callable:
  """The function computing `outvars` from `invars` by the jaxpr equations `eqns` (taken from
  a traced program), as a list of values. Public alternative: `jax.extend.core.Jaxpr`, which
  JAX changes between versions: `test_compat` checks.

  Example:
    >>> jax = _jax()
    >>> jaxpr = jax.make_jaxpr(lambda x: (x * 2) + 1)(1.0).jaxpr
    >>> double = equations_function(jaxpr.invars, [jaxpr.eqns[0].outvars[0]], jaxpr.eqns[:1])
    >>> double(3.0)
    [Array(6., dtype=float32, weak_type=True)]
  """
  _jax()
  from jax.extend import core

  from jax._src.core import DebugInfo

  effects = frozenset().union(*(e.effects for e in eqns))
  names = DebugInfo("equations_function", "<equations>", tuple(f"in{i}" for i in range(len(invars))),
                    tuple(f"out{i}" for i in range(len(outvars))))
  jaxpr = core.Jaxpr([], list(invars), list(outvars), list(eqns), effects, names)
  return core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, []))


def without_dead_code(closed: Any) -> Any:
  """The closed jaxpr without the equations whose results nothing reads (JAX's dead-code pass;
  inputs and constants kept). Public alternative: none (`jax.jit` runs it when lowering).

  Example:
    >>> jax = _jax()
    >>> closed = jax.make_jaxpr(lambda x: (jax.numpy.sin(x), x * 2)[1])(1.0)
    >>> len(closed.jaxpr.eqns), len(without_dead_code(closed).jaxpr.eqns)
    (2, 1)
  """
  _jax()
  from jax.extend import core
  from jax._src.interpreters import partial_eval

  jaxpr, _ = partial_eval.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                                    instantiate=True)
  return core.ClosedJaxpr(jaxpr, closed.consts)


def jaxpr_function(jaxpr: Any, consts: list) -> Callable:
  """The function the open `jaxpr` computes with its constants bound to `consts` (traced values
  may stand for them). Public alternative: `jax.extend.core`'s `jaxpr_as_fun` and `ClosedJaxpr`,
  which JAX changes between versions: `test_compat` checks.

  Example:
    >>> jax = _jax()
    >>> closed = jax.make_jaxpr(lambda x: x * 2.0)(1.0)
    >>> jaxpr_function(closed.jaxpr, closed.consts)(3.0)
    [Array(6., dtype=float32, weak_type=True)]
  """
  _jax()
  from jax.extend import core

  return core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, consts))
