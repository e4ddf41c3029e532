"""Results inside bridged code carry torch's dtypes.

torchax converts each aten op to JAX, whose dtype rules differ from torch's in places: `topk` and
`searchsorted` give int32 indices, `arange(4.0)` and `full((2,), 1.5)` float64 in 64-bit mode.
Library code checks dtypes (`one_hot` takes only int64), so every aten op's result is cast to
the dtype torch gives for the same arguments, read from torch's meta kernels (shapes and dtypes,
no data; once per op and argument dtypes), where the two differ in kind: integers, or 64-bit
floats on one side. Bridged code is traced in JAX's 64-bit mode, so int64 and float64 exist;
where a JAX function converts torch code in 32-bit mode (`jaxify` in the user's JAX), a 64-bit
dtype stays its 32-bit form, as JAX has it. An in-place op whose result torch's meta kernel
refuses to cast into its target (`int_tensor.sqrt_()`) raises torch's error: the region falls
back, and plain torch_xla raises it (torchax had written the result, truncated).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from torch_xla_jaxbridge._compat import torch_dispatch_private
from torch_xla_jaxbridge._core import dtypes, runtime
from torch_xla_jaxbridge._core.runtime import PyTree

if TYPE_CHECKING:
  from torchax.tensor import Environment

_META = torch.device("meta")
_EXPECTED: dict = {}  # (op, argument signature) -> torch's result dtypes, or None: not known
_UNKNOWN = object()
# torch functions that torchax converts whole (not through aten ops) and that take no tensor
_FACTORIES = frozenset([torch.arange, torch.empty, torch.eye, torch.full, torch.linspace,
                        torch.logspace, torch.ones, torch.rand, torch.randint, torch.randn,
                        torch.tensor, torch.zeros])

# matrix products that torch_xla computes on operands of two float dtypes (eager refuses): its
# result has the dtype of the first matrix operand (`aten.addmm`'s is its second argument)
_MATRIX_OPERAND = {"mm": 0, "bmm": 0, "mv": 0, "dot": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1,
                   "addmv": 1}


def dispatcher(env: Environment) -> Callable[..., Any]:
  """A dispatch wrapper for `env` (`torchax_private.wrap_dispatch`): torchax's conversion of each
  op; for an aten op or a tensor factory, each tensor result cast to the dtype torch gives.

  Example (the bridge's environment has it):
    >>> from torch_xla_jaxbridge import bridge
    >>> x = torch.tensor([[1.0, 3.0, 2.0]], device="xla")
    >>> bridge(lambda t: torch.topk(t, 2).indices)(x).dtype
    torch.int64
  """
  def dispatch_with_torch_dtypes(dispatch: Callable, func: Any, types: Any, args: Sequence,
                                 kwargs: dict | None) -> Any:
    out = dispatch(func, types, args, kwargs)
    if (mixed := _mixed_product_dtype(func, args)) is not None:
      return _cast(env, out, [mixed], exactly=True)
    if not (torch_dispatch_private.is_op(func) or func in _FACTORIES):
      return out
    key = (func, _signature(args), _signature(kwargs))
    try:
      expected = _EXPECTED.get(key, _UNKNOWN)
    except TypeError:  # an unhashable argument: ask torch each time
      expected = _meta_dtypes(func, args, kwargs)
    if expected is _UNKNOWN:
      expected = _EXPECTED[key] = _meta_dtypes(func, args, kwargs)
    if isinstance(expected, str):  # torchax wrote a result torch refuses to cast: torch's error
      raise RuntimeError(expected)
    return out if expected is None else _cast(env, out, expected)

  return dispatch_with_torch_dtypes


def _mixed_product_dtype(func: Any, args: Sequence) -> torch.dtype | None:
  """The dtype torch_xla gives a matrix product of two float dtypes (`x_bf16 @ w_f32`: bfloat16,
  the first matrix operand's), or None where the operands agree or `func` is no such product.

  Example:
    >>> a, b = torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2)
    >>> _mixed_product_dtype(torch.ops.aten.mm.default, (a, b))
    torch.bfloat16
  """
  if func is torch.nn.functional.linear or func is torch.einsum:
    operands = [a for a in runtime.jax_module().tree.leaves(tuple(args[:2] if func is
                torch.nn.functional.linear else args[1:])) if isinstance(a, torch.Tensor)]
  else:
    position = _MATRIX_OPERAND.get(getattr(func, "__name__", "").partition(".")[0])
    if position is None or not torch_dispatch_private.is_op(func):
      return None
    operands = [a for a in args[position:position + 2] if isinstance(a, torch.Tensor)]
  dtypes_ = {t.dtype for t in operands}
  if len(dtypes_) < 2 or not all(d.is_floating_point for d in dtypes_):
    return None
  return operands[0].dtype


def _signature(value: object) -> object:
  """What torch's result dtypes can depend on: each tensor's dtype and whether it is 0-d (type
  promotion treats those as scalars), each Python number's type, every other value itself."""
  if isinstance(value, torch.Tensor):
    return (value.dtype, value.dim() == 0)
  if isinstance(value, (list, tuple)):
    return (type(value), *[_signature(v) for v in value])
  if isinstance(value, dict):
    return tuple((k, _signature(v)) for k, v in value.items())
  if isinstance(value, (bool, int, float, complex)):
    return type(value)
  return value


def _meta_dtypes(func: Callable, args: Sequence, kwargs: dict | None) -> list | str | None:
  """The dtypes of torch's results of `func` for these arguments, or None where torch's meta
  kernel cannot say (data-dependent shapes, an op without one), or torch's message where it
  refuses to write a result into a tensor of another kind (`int_tensor.sqrt_()`,
  `int_tensor.add_(float_tensor)`, `int_tensor.mul_(float_tensor)`)."""
  jax = runtime.jax_module()
  is_tensor = lambda t: isinstance(t, torch.Tensor)  # noqa: E731
  meta_args, meta_kwargs = jax.tree.map(
      lambda t: _as_meta(t) if is_tensor(t) else t, (tuple(args), dict(kwargs or {})),
      is_leaf=is_tensor)
  if "device" in meta_kwargs:
    meta_kwargs["device"] = _META
  try:
    with torch_dispatch_private.modes_disabled():  # torch's kernels, not the trace's conversion
      result = func(*meta_args, **meta_kwargs)
  except RuntimeError as e:  # torch refuses a cast (`add_` on ints: in its own words)
    refused = ("can't be cast" in str(e)
               or _in_place_refusal(func, meta_args, meta_kwargs) is not None)
    return str(e) if refused else None
  except Exception:  # noqa: BLE001  (torch says nothing for this call: keep torchax's dtypes)
    return None
  return _in_place_refusal(func, meta_args, meta_kwargs) or [
      t.dtype if is_tensor(t) else None for t in jax.tree.leaves(result, is_leaf=is_tensor)]


def _in_place_refusal(func: Callable, meta_args: tuple, meta_kwargs: dict) -> str | None:
  """Torch's message where an in-place op's result type cannot be cast to its target's
  (`int_tensor.mul_(float_tensor)`: eager raises, while torch's meta kernel for `mul_` does not
  check), read from the result type of the op's functional form; None otherwise. Ops that cast
  what they write (`copy_`, `fill_`, `masked_fill_`) keep the target's dtype in their functional
  form, so they pass."""
  result = _functional_result(func, meta_args, meta_kwargs)
  if not isinstance(result, torch.Tensor):
    return None
  return cast_refusal(result.dtype, meta_args[0].dtype)


def cast_refusal(result: torch.dtype, target: torch.dtype) -> str | None:
  """Torch's message where an in-place op may not write a `result` dtype into a `target` one
  (`torch.can_cast`), else None.

  Example:
    >>> cast_refusal(torch.float32, torch.int64)
    "result type Float can't be cast to the desired output type Long"
    >>> cast_refusal(torch.int64, torch.float32) is None
    True
  """
  if torch.can_cast(result, target):
    return None
  return (f"result type {_type_name(result)} can't be cast to the desired output type "
          f"{_type_name(target)}")


def _functional_result(func: Callable, meta_args: tuple, meta_kwargs: dict) -> Any:
  """What the functional form of the in-place op `func` gives on these meta arguments; None
  where `func` is not in-place or its functional form fails."""
  functional = torch_dispatch_private.functional_of_in_place(func)
  if functional is None or not meta_args or not isinstance(meta_args[0], torch.Tensor):
    return None
  try:
    with torch_dispatch_private.modes_disabled():
      return functional(*meta_args, **meta_kwargs)
  except Exception:  # noqa: BLE001  (nothing to compare with)
    return None


def _type_name(dtype: torch.dtype) -> str:
  """Torch's name of a dtype in its cast errors: `Float`, `Long`."""
  return torch.empty((), dtype=dtype).type().rpartition(".")[2].removesuffix("Tensor")


def _as_meta(tensor: torch.Tensor) -> torch.Tensor:
  return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=_META)


def _differs_from_torch(got: torch.dtype, expected: torch.dtype) -> bool:
  """Whether a result of dtype `got` is one torch (`expected`) would not give: an integer or bool
  dtype other than torch's, or 64-bit floats on one side only. Between 16- and 32-bit floats
  torch_xla has rules of its own (a bfloat16 layer norm with float32 weights gives float32, as
  torchax's does), so those are left as they are."""
  if got == expected:
    return False
  wide = (torch.float64, torch.complex128)
  return not (expected.is_floating_point or expected.is_complex) or got in wide or expected in wide


def _cast(env: Environment, out: PyTree, expected: list, exactly: bool = False) -> PyTree:
  """`out`'s tensors in the `expected` dtypes, where they differ from torch's in kind (`exactly`:
  wherever they differ)."""
  jax = runtime.jax_module()
  is_tensor = lambda t: isinstance(t, torch.Tensor)  # noqa: E731
  leaves, treedef = jax.tree.flatten(out, is_leaf=is_tensor)
  if len(leaves) != len(expected):
    return out
  cast = [_to(env, leaf, dtype, exactly) if dtype is not None and is_tensor(leaf) else leaf
          for leaf, dtype in zip(leaves, expected)]
  return treedef.unflatten(cast)


def _to(env: Environment, tensor: Any, dtype: torch.dtype, exactly: bool = False) -> Any:
  if not hasattr(tensor, "jax") or not (
      tensor.dtype != dtype if exactly else _differs_from_torch(tensor.dtype, dtype)):
    return tensor  # a view keeps its base's dtype
  jax = runtime.jax_module()
  target = jax.dtypes.canonicalize_dtype(dtypes.to_jax(dtype))
  array = tensor.jax()
  if array.dtype == target:
    return tensor
  return type(tensor)(array.astype(target), env)
