"""Learning-rate factors for `torch.optim.lr_scheduler.LambdaLR`: warmup, then a decay."""
import math
from typing import Callable

from torch_xla_jaxbridge import errors


def warmup_cosine(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.0) -> Callable[[int], float]:
  """The learning-rate factor for `torch.optim.lr_scheduler.LambdaLR`: linear warmup over
  `warmup_steps` ((step + 1) / (warmup_steps + 1)), then cosine decay from 1 to `min_ratio` at
  `total_steps`.

  Example:
    >>> factor = warmup_cosine(3, 13)
    >>> [round(factor(step), 2) for step in (0, 1, 2, 3, 8, 13, 20)]
    [0.25, 0.5, 0.75, 1.0, 0.5, 0.0, 0.0]
  """
  return _warmup_then("warmup_cosine", warmup_steps, total_steps, min_ratio,
                      lambda progress: 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_linear(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.0) -> Callable[[int], float]:
  """The learning-rate factor for `LambdaLR`: linear warmup as `warmup_cosine`, then linear decay
  from 1 to `min_ratio` at `total_steps`.

  Example:
    >>> factor = warmup_linear(1, 5, min_ratio=0.2)
    >>> [round(factor(step), 2) for step in (0, 1, 3, 5)]
    [0.5, 1.0, 0.6, 0.2]
  """
  return _warmup_then("warmup_linear", warmup_steps, total_steps, min_ratio,
                      lambda progress: 1 - progress)


def warmup_constant(warmup_steps: int) -> Callable[[int], float]:
  """The learning-rate factor for `LambdaLR`: linear warmup as `warmup_cosine`, then 1.

  Example:
    >>> [warmup_constant(1)(step) for step in (0, 1, 100)]
    [0.5, 1.0, 1.0]
  """
  return _warmup_then("warmup_constant", warmup_steps, warmup_steps, 1.0, lambda progress: 1.0)


def _warmup_then(name, warmup_steps, total_steps, min_ratio, decay):
  if not 0 <= warmup_steps <= total_steps or not 0 <= min_ratio <= 1:
    raise errors.BadArgumentError(
        f"{name}: needs 0 <= warmup_steps <= total_steps and 0 <= min_ratio <= 1; got "
        f"warmup_steps={warmup_steps}, total_steps={total_steps}, min_ratio={min_ratio}.")

  def factor(step: int) -> float:
    if step < warmup_steps:
      return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * decay(progress)

  return factor
