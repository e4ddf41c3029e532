"""Linear algebra lowered so that torch_xla's CPU runtime can run it.

On CPU, JAX lowers Cholesky, triangular solves, LU and QR to LAPACK custom calls that jaxlib
registers with JAX's own XLA runtime; torch_xla's runtime, which runs the package's nodes, has
no handler for them ("No FFI handler registered for lapack_spotrf_ffi"). While the package
lowers for CPU, these primitives use JAX's lowering for other platforms instead: HLO's
`cholesky` and `triangular-solve`, XLA's `Qr` expansion, LU written in JAX, which XLA:CPU
compiles. Linear algebra with no such lowering (eigenvalues, SVD, ...) is caught by
`lowering.refuse_foreign_custom_calls` and the region falls back.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch_xla_jaxbridge._compat import jax_lowering_private
from torch_xla_jaxbridge._core import threads

# Primitives whose lowering for other platforms XLA:CPU runs.
PORTABLE = ("cholesky", "triangular_solve", "lu", "geqrf", "householder_product")

_ACTIVE = threads.Switch()  # on: this thread is lowering for torch_xla's CPU runtime


@contextlib.contextmanager
def portable_linalg() -> Iterator[None]:
  """Within the block, the linear algebra this thread lowers for CPU needs no LAPACK call.

  Example:
    >>> import jax
    >>> spd = jax.ShapeDtypeStruct((3, 3), "float32")
    >>> with portable_linalg():
    ...   text = jax.jit(jax.numpy.linalg.cholesky).lower(spd).as_text()
    >>> "lapack" in text, "stablehlo.cholesky" in text
    (False, True)
  """
  _install()
  with _ACTIVE.on():
    yield


@threads.once
def _install() -> None:
  for primitive in jax_lowering_private.linalg_primitives(*PORTABLE):
    portable = jax_lowering_private.generic_lowering_rule(primitive)
    if portable is None:  # JAX has none: its LAPACK call stays, and lowering refuses it
      continue
    jax_lowering_private.wrap_cpu_lowering(primitive, _rule_over(portable))


def _rule_over(portable: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """The CPU rule: the LAPACK rule `original` outside `portable_linalg()`, else `portable`."""

  def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def rule(ctx: Any, *operands: Any, **params: Any) -> Any:
      chosen = portable if _ACTIVE.is_on() else original
      return chosen(ctx, *operands, **params)

    return rule

  return wrapper
