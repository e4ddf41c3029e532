"""`checkpoint`: upstream `torch_xla.utils.checkpoint.checkpoint`'s call as one bridged call whose
backward computes the function again (`jax.checkpoint` under the "full" remat policy)."""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Hashable

from torch_xla_jaxbridge._bridge import captures
from torch_xla_jaxbridge._bridge.captures import Lifted
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import Bridged

# function (a method: its instance) -> {(method function or None, remat): Bridged}; the bridged
# function holds the function weakly, so a module dropped by the program takes its trace along
_BY_FUNCTION: weakref.WeakKeyDictionary[Any, dict[Hashable, Bridged[_Recompute]]] = (
    weakref.WeakKeyDictionary())
_UNREFERABLE: dict[Any, dict[Hashable, Bridged[_Recompute]]] = {}
# ^ functions that take no weak reference (builtins), kept for good


def checkpoint(function: Callable, *args: Any, use_reentrant: bool = True,
               preserve_rng_state: bool = True, remat: remat_policies.RematArg = "full",
               **kwargs: Any) -> Any:
  """`function(*args, **kwargs)` as one bridged call that keeps only its inputs for the backward
  and computes the rest again there: upstream `torch_xla.utils.checkpoint.checkpoint`'s call.

  Gradients reach the tensors that require grad among the arguments and those `function` reads
  (a module's parameters, a closure's tensors). The traced function is reused while the same
  `function` object (a module, a function defined once) is passed.

  Args:
    function: torch code: an `nn.Module`, a function or a method.
    use_reentrant: accepted, either value: the backward is `jax.vjp`'s, not torch's reentrant
      autograd (upstream refuses False).
    preserve_rng_state: accepted; the recomputation always draws the forward's random numbers
      (it reuses the call's key), so False changes nothing.
    remat: what the backward keeps (docs/remat.md); "full" keeps only the inputs.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to("xla")
    >>> x = torch.randn(2, 4, device="xla", requires_grad=True)
    >>> jb.checkpoint(block, x).sum().backward()
    >>> block[0].weight.grad.shape
    torch.Size([4, 4])
  """
  bridged = _bridged(function, remat)
  return bridged(args, kwargs, captures.collect_for_call(function, bridged.name, (args, kwargs)))


def _bridged(function: Callable, remat: remat_policies.RematArg) -> Bridged[_Recompute]:
  ref: Callable[[], Callable | None] | None
  key: tuple[Callable | None, remat_policies.RematArg]
  if inspect.ismethod(function):
    owner, key, ref = function.__self__, (function.__func__, remat), weakref.WeakMethod(function)
  else:
    owner, key, ref = function, (None, remat), None
  try:
    table = _BY_FUNCTION.setdefault(owner, {})
    ref = ref or weakref.ref(function)
  except TypeError:  # no weak reference to it
    table, ref = _UNREFERABLE.setdefault(function, {}), lambda: function
  bridged = table.get(key)
  if bridged is None:
    name = getattr(function, "__name__", type(function).__name__)
    bridged = table[key] = Bridged(_Recompute(ref), remat=remat, name=f"checkpoint_{name}")
  return bridged


class _Recompute:
  """The bridged torch function: the checkpointed function (held weakly) on the traced
  arguments, with its captured tensors (passed as `lifted`) put where it reads them."""

  def __init__(self, ref: Callable[[], Callable | None]) -> None:
    self.ref = ref

  def __call__(self, args: tuple, kwargs: dict, lifted: Lifted | None) -> Any:
    function = self.ref()
    assert function is not None, "called by `checkpoint`, which holds the function"
    return captures.call_with(function, lifted, args, kwargs)
