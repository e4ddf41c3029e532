"""A `torch.Generator` the traced code passes to an op makes the region fall back.

Plain torch_xla draws from the generator given (`torch.randn(3, generator=g)`): seeded, the
numbers are eager CPU torch's, and each call advances the generator. A trace cannot draw them:
JAX's random streams are the step's own, and a trace replays what it drew at every call. So an
op given a generator raises `HostRandomnessError` while traced, and the region runs as plain
torch_xla code (said once, listed in `jb.bridge_report()`), as for Python's `random`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import tracing


def _dispatch(dispatch: Callable, func: Any, types: Any, args: Any, kwargs: dict | None) -> Any:
  """torchax's conversion of one op, refused when it is given a `torch.Generator` (a keyword-only
  argument of torch's functions and aten ops).

  Example:
    >>> import torch_xla_jaxbridge as jb, warnings
    >>> g = torch.Generator().manual_seed(0)
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore")
    ...   drawn = jb.bridge(lambda x: x + torch.rand(2, generator=g).to(x.device))(
    ...       torch.zeros(2, device="xla"))
    >>> torch.equal(drawn.cpu(), torch.rand(2, generator=torch.Generator().manual_seed(0)))
    True
  """
  if kwargs and isinstance(kwargs.get("generator"), torch.Generator):
    name = getattr(func, "__name__", str(func))
    raise errors.HostRandomnessError(
        f"{name} draws from a torch.Generator the code holds: plain torch_xla draws from it (its "
        f"seed gives eager's numbers, each call new ones), and a trace would replay the same "
        f"numbers at every call. The region runs as plain torch_xla code. To bridge it, draw "
        f"without generator= (torch.rand, torch.randn: fresh at every call, seeded by "
        f"torch_xla.manual_seed) or pass the numbers in as a tensor argument.")
  return dispatch(func, types, args, kwargs)


tracing.register_dispatch_wrapper(_dispatch)
