"""Custom ops (`torch.library`) inside bridged code: traced through their own implementation.

torchax converts aten ops; an op of another namespace reaches it with no lowering. While bridged
code is traced, such an op runs, first that applies:

1. the JAX function given for it by `register_lowering` or `override_ops` (`overrides`);
2. a lowering the package knows: torchprime's `xla::offload_name` is JAX's `checkpoint_name`;
3. its CompositeImplicitAutograd kernel, decomposed into the torch ops it calls;
4. a `torch.library.custom_op`'s implementation (its "xla" kernel, else its default one) traced,
   differentiated by its `register_autograd` formula when it has one;
5. a Python kernel registered for the XLA, CompositeExplicitAutograd or CPU key, traced and
   differentiated as the torch ops it calls, unless an autograd kernel is registered for the op
   (its formula cannot be read, and a gradient of the implementation could silently differ).

Otherwise `NoLoweringError` names the op and `jb.register_lowering`; the bridged region then runs as
LazyTensor code (or the error is raised where fallback is off).
"""
from typing import Any

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_dispatch_private, torch_private, torchax_private
from torch_xla_jaxbridge._core import runtime, tracing
from torch_xla_jaxbridge._integrations import autograd_function

_KERNEL_KEYS = ("XLA", "CompositeExplicitAutograd", "CPU")
_AUTOGRAD_KEYS = ("Autograd", "AutogradXLA", "AutogradCPU", "AutogradOther")


def _offload_name(t, name):
  """torchprime's `xla::offload_name(t, name)`: names `t` for remat and offload policies."""
  runtime.jax_module()
  from jax.ad_checkpoint import checkpoint_name

  return checkpoint_name(t, name)


_KNOWN = {"xla::offload_name": _offload_name}  # op name -> lowering on JAX arrays


def run_custom_op(op: Any, args: tuple, kwargs: dict) -> Any:
  """`op(*args, **kwargs)` on traced tensors, by the first rule of the module docstring.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> lib = torch.library.Library("demo_custom", "DEF")
    >>> _ = lib.define("shifted(Tensor x) -> Tensor")
    >>> lib.impl("shifted", lambda x: x + 1, "CompositeExplicitAutograd")
    >>> jb.bridge(torch.ops.demo_custom.shifted)(torch.zeros(2, device="xla")).cpu().tolist()
    [1.0, 1.0]
  """
  name = op.name()
  known = _KNOWN.get(name)
  if known is not None:
    return tracing.to_torchax(known(*tracing.to_jax(args), **tracing.to_jax(kwargs)))
  has = lambda key: torch_dispatch_private.has_kernel(name, key)  # noqa: E731
  with torchax_private.dispatch_mode(tracing.environment()):
    if has("CompositeImplicitAutograd"):
      return op.decompose(*args, **kwargs)
    definition = torch_dispatch_private.custom_op_definition(name)
    if definition is not None:
      return _run_definition(definition, name, args, kwargs)
    key = next((k for k in _KERNEL_KEYS if has(k)), None)
    if key is None:
      raise _no_lowering(name, "it has no implementation written in torch ops")
    autograd_key = next((k for k in _AUTOGRAD_KEYS if has(k)), None)
    if autograd_key is not None:
      raise _no_lowering(name, f"its gradient comes from a kernel registered for {autograd_key}, "
                               f"which the bridge cannot read")
    try:
      return op.redispatch(torch_dispatch_private.dispatch_key_set(key), *args, **kwargs)
    except errors.BridgeError:
      raise
    except Exception as e:
      raise _no_lowering(name, f"its {key} kernel did not trace ({type(e).__name__}: "
                               f"{str(e)[:200]})") from e


def _run_definition(definition: Any, name: str, args: tuple, kwargs: dict) -> Any:
  implementation, setup_context, backward = torch_dispatch_private.custom_op_parts(definition)
  if implementation is None:
    raise _no_lowering(name, "it has no default or XLA implementation")
  if backward is None:
    return implementation(*args, **kwargs)

  def forward(ctx, *inputs):
    output = implementation(*inputs, **kwargs)
    if setup_context is not None:
      if kwargs:
        setup_context(ctx=ctx, inputs=inputs, keyword_only_inputs=kwargs, output=output)
      else:
        setup_context(ctx=ctx, inputs=inputs, output=output)
    return output

  return autograd_function.custom_gradient(name, forward, backward, tuple(args))


def _no_lowering(name: str, why: str) -> errors.NoLoweringError:
  return errors.NoLoweringError(
      f"the custom op {name} cannot be converted to JAX: {why}. Give it a JAX implementation "
      f"with jb.register_lowering(torch.ops.{name.replace('::', '.')}, jax_fn).")


def _dispatch(dispatch, func, types, args, kwargs):
  """torchax's conversion of one op; an op it has no lowering for, if it is a custom op called on
  traced tensors, runs by `run_custom_op`."""
  if not torch_dispatch_private.is_op(func) or torch_dispatch_private.op_namespace(func) in ("aten", "prim",
                                                                          "prims"):
    return dispatch(func, types, args, kwargs)
  try:
    return dispatch(func, types, args, kwargs)
  except torchax_private.operator_not_found():
    if not any(tracing.is_traced(leaf) for leaf in torch_private.tree_leaves((args, kwargs))):
      raise
  op = torch_dispatch_private.overload_of(func, tuple(args), dict(kwargs or {}))
  return run_custom_op(op, tuple(args), dict(kwargs or {}))


tracing.register_dispatch_wrapper(_dispatch)
