"""Convolutions lowered channels-last for XLA:CPU.

XLA:CPU runs a convolution through its fast kernel only in channels-last form (batch, spatial...,
feature; kernel spatial..., in, out), and rewrites other forms into it only in the program's entry
computation. In a conditional's branch or a loop's body (a remat policy's backward, `jb.scan`)
a channels-first convolution stays a naive loop: 20-37x slower here (docs/performance.md).
While the package lowers for CPU, every convolution is emitted channels-last between transposes,
which XLA folds into layouts where it can; the values are the same.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch_xla_jaxbridge._compat import jax_lowering_private
from torch_xla_jaxbridge._core import threads

_ACTIVE = threads.Switch()  # on: this thread is lowering for CPU


@contextlib.contextmanager
def channels_last() -> Iterator[None]:
  """Within the block, convolutions this thread lowers are emitted channels-last.

  Example:
    >>> import jax
    >>> with channels_last():
    ...   text = jax.jit(lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")).lower(
    ...       jax.ShapeDtypeStruct((1, 2, 4, 4), "float32"),
    ...       jax.ShapeDtypeStruct((3, 2, 1, 1), "float32")).as_text()
    >>> "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]" in text
    True
  """
  _install()
  with _ACTIVE.on():
    yield


@threads.once
def _install() -> None:
  jax_lowering_private.wrap_cpu_lowering(
      jax_lowering_private.conv_general_dilated_primitive(), _rule_over)


def _channels_last_specs(rank: int) -> tuple[tuple[int, ...], ...]:
  spatial = tuple(range(1, rank - 1))
  return ((0, rank - 1, *spatial), (rank - 1, rank - 2, *range(rank - 2)), (0, rank - 1, *spatial))


def _rule_over(original: Callable[..., Any]) -> Callable[..., Any]:
  """The CPU rule: `original` for channels-last convolutions and outside `channels_last()`;
  otherwise the same convolution between transposes."""

  def rule(ctx: Any, lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> Any:
    specs = tuple(tuple(s) for s in dimension_numbers)
    target = _channels_last_specs(len(specs[0]))
    if not _ACTIVE.is_on() or specs == target:
      return original(ctx, lhs, rhs, dimension_numbers=dimension_numbers, **params)
    (lhs_spec, rhs_spec, out_spec) = specs
    primitive = jax_lowering_private.conv_general_dilated_primitive()

    def transposed(x: Any, w: Any) -> Any:
      x = x.transpose((lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
      w = w.transpose((*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
      y = primitive.bind(x, w, dimension_numbers=type(dimension_numbers)(*target), **params)
      back = [0] * len(out_spec)  # y is (batch, spatial..., feature): where each axis goes
      for axis, dim in enumerate((out_spec[0], *out_spec[2:], out_spec[1])):
        back[dim] = axis
      return y.transpose(back)

    return jax_lowering_private.lower_fun(transposed)(ctx, lhs, rhs)

  return rule
