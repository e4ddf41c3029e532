"""torch's op dispatch: its ops, their overloads and kernels, `torch.library` custom ops, and the
mode that sees each op dispatched; one function each (as `torch_private`).

Each says why the package needs it, what breaks if it changes and the public alternative where
one exists; `test/test_compat.py` checks each directly.
"""
import functools
from typing import Any

import torch


# --- custom ops: how bridged code runs a `torch.library` op torchax has no lowering for ----------
# Public alternatives: `torch.library` registers kernels and autograd formulas but has no reader
# for them; if these change, custom ops inside bridged code fall back to LazyTensor code (each is
# checked in test_compat).

def is_op(value: Any) -> bool:
  """Whether `value` is a torch op (`torch.ops.ns.name`) or one overload of it, as torch's
  function and dispatch modes see them.

  Example:
    >>> is_op(torch.ops.aten.mm), is_op(torch.ops.aten.mm.default), is_op(torch.matmul)
    (True, True, False)
  """
  return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def overload_of(op: Any, args: tuple, kwargs: dict) -> Any:
  """The overload of the op `op` (itself when it is one) that a call with these arguments runs,
  by torch's schema matching.

  Example:
    >>> overload_of(torch.ops.aten.add, (torch.ones(1), torch.ones(1)), {})
    <OpOverload(op='aten.add', overload='Tensor')>
  """
  if isinstance(op, torch._ops.OpOverload):
    return op
  return getattr(op, torch._C._jit_resolve_packet(op._qualified_op_name, *args, **kwargs)
                 or "default")


def op_namespace(op: Any) -> str:
  """The namespace of a torch op or of its packet (`"aten"`, `"xla"`, a library's own).

  Example:
    >>> op_namespace(torch.ops.aten.mm), op_namespace(torch.ops.aten.mm.default)
    ('aten', 'aten')
  """
  name = op.name() if isinstance(op, torch._ops.OpOverload) else op._qualified_op_name
  return name.split("::")[0]


def has_kernel(op_name: str, dispatch_key: str) -> bool:
  """Whether the op `"ns::name"` (or `"ns::name.overload"`) has a kernel for `dispatch_key`.

  Example:
    >>> has_kernel("aten::mm", "CPU"), has_kernel("aten::mm", "CompositeImplicitAutograd")
    (True, False)
  """
  return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dispatch_key)


def dispatch_key_set(dispatch_key: str) -> Any:
  """The dispatch key set of the one key named, for `OpOverload.redispatch` to call that key's
  kernel directly.

  Example:
    >>> dispatch_key_set("CPU").has(torch._C.DispatchKey.CPU)
    True
  """
  return torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, dispatch_key))


def custom_op_definition(op_name: str) -> Any:
  """The `torch.library.custom_op` definition of `"ns::name"`, or None for another kind of op.

  Example:
    >>> custom_op_definition("aten::mm") is None
    True
  """
  from torch._library import custom_ops

  return custom_ops.OPDEFS.get(op_name)


def custom_op_parts(definition: Any) -> tuple:
  """`(implementation, setup_context, backward)` of a `custom_op` definition: its "xla" kernel
  (else its default implementation, else None) and its `register_autograd` formula (Nones when it
  has none).

  Example:
    >>> @torch.library.custom_op("demo_parts::cube", mutates_args=())
    ... def cube(x: torch.Tensor) -> torch.Tensor:
    ...   return x ** 3
    >>> impl, setup, backward = custom_op_parts(custom_op_definition("demo_parts::cube"))
    >>> impl(torch.tensor(2.0)).item(), setup, backward
    (8.0, None, None)
  """
  implementation = definition._backend_fns.get("xla") or definition._init_fn
  return implementation, definition._setup_context_fn, definition._backward_fn


def dispatch_mode() -> type:
  """torch's base class of a mode whose `__torch_dispatch__` sees every op dispatched below
  autograd (`_bridge.layer_slots` records a layer's ops on the meta device with it). Public
  alternative: none (`torch.utils._python_dispatch.TorchDispatchMode`, documented, in a private
  module).

  Example:
    >>> dispatch_mode().__name__
    'TorchDispatchMode'
  """
  from torch.utils._python_dispatch import TorchDispatchMode

  return TorchDispatchMode


@functools.cache
def functional_of_in_place(op: Any) -> Any:
  """The functional overload of an in-place aten op overload (`aten.neg_.default` ->
  `aten.neg.default`), or None: `op` is no in-place overload, or torch has no functional form.
  Reads `OpOverload.name()` and torch's op registry; kept per op (every traced op asks).

  Example:
    >>> functional_of_in_place(torch.ops.aten.fill_.Scalar) is torch.ops.aten.fill.Scalar
    True
    >>> functional_of_in_place(torch.ops.aten.neg.default) is None
    True
  """
  if not isinstance(op, torch._ops.OpOverload):
    return None
  qualified, _, overload = op.name().partition(".")
  namespace, _, name = qualified.partition("::")
  if not name.endswith("_") or name.startswith("_"):
    return None
  packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
  return getattr(packet, overload or "default", None) if packet is not None else None


def modes_disabled() -> Any:
  """A context in which no Python dispatch mode (torchax's included) sees the ops run: what
  `_core.torch_dtypes` asks torch's meta kernels runs on torch's own kernels, not back through
  the trace's conversion. Public alternative: none
  (`torch.utils._python_dispatch._disable_current_modes`).

  Example:
    >>> with modes_disabled():
    ...   torch.empty(2, device="meta").add_(1).device.type
    'meta'
  """
  from torch.utils._python_dispatch import _disable_current_modes

  return _disable_current_modes()
