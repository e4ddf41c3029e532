"""What torch code reads of autograd while it is traced: torch's grad mode and `requires_grad`.

A bridged call's forward is traced inside its `torch.autograd.Function` (and `jb.train_step`'s
inside the optimizer's step), both with grad mode off, on torchax tensors made with
`requires_grad=False`: code that branches on either (a train-only term, a path chosen by
`requires_grad`) would take its no-grad path where plain torch takes the other. So a trace runs
in the grad mode of the call it stands for (`Caller`); the tensors standing for the caller's
tensors that require grad answer `requires_grad` True, and so do the floating-point results of
an op on one of them while grad mode is on (`dispatcher`), as torch's autograd would record
them; the outputs of a region traced as a function of arrays (a remat, a conditional, a
checkpoint) answer as its inputs do (`like`). Only the answer is torch's: its autograd records
nothing (the gradients are JAX's). A tensor answers from an attribute (`MARK`), to all code but
torch's and torchax's own, which read torch's flag (`torchax_private.report_requires_grad`).
Where the traced code turns grad mode off itself (`torch.no_grad()`, `set_grad_enabled(False)`,
`inference_mode()`) inside a call made with it on, what ops compute there is cut from JAX's
gradients (`jax.lax.stop_gradient`), as torch's autograd records none of it, views taken there
read cut, and a tensor written in place there keeps its gradient path (`dispatcher`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator

import torch

from torch_xla_jaxbridge._compat import torch_private, torchax_private
from torch_xla_jaxbridge._core import runtime

MARK = "bridge_requires_grad"  # the attribute a traced tensor answers `requires_grad` from
# ops whose results never require grad in torch, whatever their inputs
_NOT_DIFFERENTIABLE = frozenset(
    ["detach", "detach_", "requires_grad_", "zeros_like", "ones_like", "empty_like", "full_like",
     "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
     "new_tensor"])
_TRACE = threading.local()  # grad_on: the grad mode of the call the running trace stands for


@dataclasses.dataclass(frozen=True)
class Caller:
  """The autograd state of the call a trace stands for: torch's grad mode at the call, and the
  ids of the arrays that stand for the caller's tensors that require grad.

  Example:
    >>> Caller(True, frozenset()).grad_enabled
    True
  """
  grad_enabled: bool
  requiring: frozenset[int] = frozenset()


def mark(tensor: torch.Tensor, requires_grad: bool = True) -> None:
  """Makes a traced tensor answer `requires_grad` with `requires_grad` (or torch's own flag).

  Example:
    >>> t = torch.ones(2)
    >>> mark(t); marked(t)
    True
  """
  tensor.__dict__[MARK] = requires_grad


def marked(value: object) -> bool:
  """Whether `value` is a tensor marked as requiring grad.

  Example:
    >>> marked(torch.ones(2)), marked(3)
    (False, False)
  """
  return isinstance(value, torch.Tensor) and bool(value.__dict__.get(MARK, False))


@contextlib.contextmanager
def entered(caller: Caller, tensors: dict[int, torch.Tensor]) -> Iterator[None]:
  """Inside the block torch's grad mode is the caller's, and the tensors of `tensors` (array id
  -> the traced tensor made for it) that stand for tensors requiring grad are marked.

  Example:
    >>> with torch.no_grad(), entered(Caller(True), {}):
    ...   torch.is_grad_enabled()
    True
  """
  for array_id in caller.requiring:
    if array_id in tensors:
      mark(tensors[array_id])
  with _trace_grad_on(caller.grad_enabled), torch.set_grad_enabled(caller.grad_enabled):
    yield


@contextlib.contextmanager
def function_forward() -> Iterator[None]:
  """Grad mode off, as torch runs an autograd Function's forward; what the forward computes is
  not cut from JAX's gradients (`dispatcher`): the Function's backward gives its gradient, and
  code inside may differentiate itself (upstream's `assume_pure` runs `jax.vjp` there).

  Example:
    >>> with entered(Caller(True), {}), function_forward():
    ...   torch.is_grad_enabled(), _TRACE.grad_on
    (False, False)
  """
  with _trace_grad_on(False), torch.no_grad():
    yield


@contextlib.contextmanager
def _trace_grad_on(grad_on: bool) -> Iterator[None]:
  """Inside the block the running trace stands for a call made with grad mode `grad_on`."""
  outer = getattr(_TRACE, "grad_on", False)
  _TRACE.grad_on = grad_on
  try:
    yield
  finally:
    _TRACE.grad_on = outer


def like(outputs: Any, inputs: Any) -> Any:
  """`outputs` (a pytree), with its floating-point tensors marked as requiring grad when grad
  mode is on and one of the tensors of `inputs` is: a region's results as torch's autograd would
  give them (an autograd Function, a conditional, a checkpoint).

  Example:
    >>> x, y = torch.ones(2), torch.ones(2)
    >>> mark(x); marked(like(y, [x]))
    True
  """
  if differentiable(inputs):
    _mark_floats(torch_private.tree_leaves(outputs))
  return outputs


def differentiable(inputs: Any) -> bool:
  """Whether torch's autograd would record what traced code computes from `inputs` (a pytree):
  grad mode is on and one of its tensors stands for a tensor requiring grad.

  Example:
    >>> x = torch.ones(2)
    >>> mark(x); differentiable({"x": x}), differentiable([torch.ones(2)])
    (True, False)
  """
  return torch.is_grad_enabled() and any(map(marked, torch_private.tree_leaves(inputs)))


def _mark_floats(values: Any) -> None:
  for value in values:
    if isinstance(value, torch.Tensor) and _is_float(value):
      mark(value)


def _is_float(tensor: torch.Tensor) -> bool:
  """Whether `tensor` can carry a gradient: floating-point or complex."""
  return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _any_marked(args: Any, kwargs: dict | None) -> bool:
  """Whether a tensor among an op's arguments (and the lists and tuples there) is marked."""
  for value in (*args, *(kwargs or {}).values()):
    if marked(value) or isinstance(value, (list, tuple)) and any(map(marked, value)):
      return True
  return False


def dispatcher(dispatch: Callable, func: Any, types: Any, args: Any, kwargs: dict | None) -> Any:
  """A dispatch wrapper: torchax's conversion of one op, its floating-point results marked as
  requiring grad when grad mode is on and one of its tensors is (not for an op whose results
  never require grad in torch: `detach`, `zeros_like`, ...); with grad mode turned off inside a
  trace of a call made with it on, its new floating-point results cut from JAX's gradients and
  an argument it writes in place given the new value with the old one's gradient path.

  Example (the bridge's environment has it):
    >>> import jax
    >>> from torch_xla_jaxbridge._core import tracing
    >>> with tracing.torch_code():
    ...   x = tracing.to_torchax(jax.numpy.ones(2))
    ...   mark(x)
    ...   (x * 2).requires_grad, x.detach().requires_grad, (x > 0).requires_grad
    (True, False, False)
  """
  if cutting():  # new results are cut; an argument written in place keeps its gradient path
    before = arrays_of((args, kwargs))
    out = dispatch(func, types, args, kwargs)
    _stop_floats(out if isinstance(out, (list, tuple)) else (out,), args, kwargs)
    keep_gradient_path(before)
    return _cut_view(out)
  out = dispatch(func, types, args, kwargs)
  if (torch.is_grad_enabled() and _any_marked(args, kwargs)
        and getattr(func, "__name__", "").split(".")[0] not in _NOT_DIFFERENTIABLE):
    _mark_floats(out if isinstance(out, (list, tuple)) else (out,))
  return out


def _stop_floats(values: Any, args: Any, kwargs: dict | None) -> None:
  """The floating-point torchax tensors among `values` that are none of the op's arguments (an
  in-place op's result is left as it is), their arrays wrapped in `jax.lax.stop_gradient`."""
  import torchax.tensor

  jax = runtime.jax_module()
  given = {id(a) for a in torch_private.tree_leaves((args, kwargs or {}))}
  for value in values:
    if type(value) is torchax.tensor.Tensor and id(value) not in given and _is_float(value):
      torchax_private.set_array(value, jax.lax.stop_gradient(value.jax()))


def _cut_view(out: Any) -> Any:
  """`out`, or where it is a view (`x[0]`) of a torchax tensor, a view of it whose reads are cut
  from JAX's gradients (writes through it still reach the viewed tensor, as in torch)."""
  if torchax_private.view_source(out) is None or not _is_float(out):
    return out
  return torchax_private.view_reading_through(out, runtime.jax_module().lax.stop_gradient)


def cutting() -> bool:
  """Whether the traced code turned grad mode off (`torch.no_grad()`) inside a trace of a call
  made with it on: what ops compute now is cut from JAX's gradients.

  Example:
    >>> cutting()  # outside any trace
    False
  """
  return not torch.is_grad_enabled() and getattr(_TRACE, "grad_on", False)


def arrays_of(values: Any) -> list:
  """`(tensor, its array)` for the floating-point torchax tensors among `values` (a pytree: an
  op's arguments) and those that the views among them (`x[0]`) write through to, for
  `keep_gradient_path` after an op that may write them in place.

  Example:
    >>> arrays_of((torch.ones(2), 3))  # no torchax tensor
    []
  """
  import torchax.tensor

  found: dict = {}
  for leaf in torch_private.tree_leaves(values):
    source = torchax_private.view_source(leaf)
    tensor = leaf if source is None else source
    if type(tensor) is torchax.tensor.Tensor and _is_float(tensor):
      found[id(tensor)] = (tensor, tensor.jax())
  return list(found.values())


def keep_gradient_path(before: list) -> None:
  """Each tensor of `before` (`arrays_of`'s) whose array was replaced since (written in place)
  holds the new value with the old value's gradient path: torch's autograd does not see a write
  made under `no_grad` (`y.mul_(3)`, `y[0] = 1`), so gradients reach what `y` was computed from
  as before it. A write that changed the shape or dtype stays cut.

  Example:
    >>> keep_gradient_path([])  # nothing written
  """
  for tensor, old in before:
    new = tensor.jax()
    if new is not old and new.shape == old.shape and new.dtype == old.dtype:
      torchax_private.set_array(tensor, _value_with_gradient_of()(new, old))


@functools.cache
def _value_with_gradient_of() -> Callable:
  """`f(new, old)`: `new`'s value, whose derivative is `old`'s.

  Example:
    >>> jax = runtime.jax_module()
    >>> jax.grad(lambda x: _value_with_gradient_of()(x * 0 + 5.0, x * 3))(1.0).item()
    3.0
  """
  jax = runtime.jax_module()

  @jax.custom_jvp
  def value_with_gradient_of(new: Any, old: Any) -> Any:
    return new

  @value_with_gradient_of.defjvp
  def _jvp(primals: tuple, tangents: tuple) -> tuple:
    return primals[0], tangents[1]

  return value_with_gradient_of
