"""`torch.autograd.Function` inside bridged code: its own `backward`, through `jax.custom_vjp`.

Traced by torchax alone, a Function's `forward` becomes ordinary JAX code and `jax.vjp`
differentiates that, ignoring the hand-written `backward` (a straight-through estimator's gradient
became zero). While bridged code is traced, `Function.apply` on traced tensors runs `forward` (and
`setup_context`) as the primal of a `jax.custom_vjp` and `backward` as its backward rule, with a
`ctx` that carries what `forward` saved. `custom_gradient` is the same for any forward/backward pair
(custom ops use it). Other threads, and calls on plain tensors, get torch's own `apply`.
"""
import inspect
from typing import Any, Callable

import numpy as np
import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import grad_reads, patching, runtime, tracing


class Context:
  """The `ctx` a Function's `forward`, `setup_context` and `backward` see inside a trace.

  Example:
    >>> ctx = Context((True,))
    >>> ctx.save_for_backward(None); ctx.saved_tensors, ctx.needs_input_grad
    ((None,), (True,))
  """

  def __init__(self, needs_input_grad: tuple):
    self.needs_input_grad = needs_input_grad
    self.materialize_grads = True
    self.saved_tensors = ()

  def save_for_backward(self, *tensors: Any) -> None:
    self.saved_tensors = tensors

  def save_for_forward(self, *tensors: Any) -> None:
    pass  # forward-mode AD of a Function is not used inside bridged code

  def mark_non_differentiable(self, *tensors: Any) -> None:
    pass  # their gradients arrive as zeros, as torch materializes them

  def set_materialize_grads(self, value: bool) -> None:
    self.materialize_grads = value

  def mark_dirty(self, *tensors: Any) -> None:
    raise errors.NoLoweringError(
        "an autograd.Function that changes its inputs in place (ctx.mark_dirty) cannot be "
        "bridged; return a new tensor instead (without it, the module runs as LazyTensor code).")


def _is_tensor(value: Any) -> bool:
  return isinstance(value, torch.Tensor)


def _is_view(value: Any) -> bool:
  import torchax.tensor

  return isinstance(value, torchax.tensor.View)


def _holds_array(value: Any) -> bool:
  """Whether `value` is a traced tensor (or a view of one): what crosses a `custom_vjp` as an
  array; any other leaf, a plain tensor included, stays as it is."""
  return tracing.is_traced(value) or _is_view(value)


def _array(value: Any) -> Any:
  return value.torch().jax() if _is_view(value) else value.jax()


def _zeros_for(value: Any) -> Any:
  """A zero cotangent for the input array `value` (float0 for integer and boolean arrays)."""
  jax = runtime.jax_module()
  if jax.numpy.issubdtype(value.dtype, jax.numpy.inexact):
    return jax.numpy.zeros(value.shape, value.dtype)
  return np.zeros(value.shape, jax.dtypes.float0)


def _split(tree: Any) -> tuple:
  """`(arrays, layout)`: the arrays of the traced tensors in `tree`, and what `_join` needs to put
  new ones in their places (holding no traced value; other tensors, such as a saved CPU random
  state, stay as they are)."""
  jax = runtime.jax_module()
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_tensor)
  is_tensor = [_holds_array(leaf) for leaf in leaves]
  others = [None if t else leaf for leaf, t in zip(leaves, is_tensor)]
  return tuple(_array(leaf) for leaf, t in zip(leaves, is_tensor) if t), (treedef, is_tensor,
                                                                            others)


def _join(arrays: Any, layout: tuple) -> Any:
  """The tree `_split` took apart, with torchax tensors of `arrays` for its tensors."""
  treedef, is_tensor, others = layout
  tensors = iter(tracing.to_torchax(list(arrays)))
  return treedef.unflatten([next(tensors) if t else leaf for leaf, t in zip(others, is_tensor)])


def _input_grads(name: str, result: Any, grad_index: list, primals: tuple) -> tuple:
  """The cotangent of each traced input from `backward`'s `result` (one per argument)."""
  jax = runtime.jax_module()
  result = result if isinstance(result, tuple) else (result,)
  grads = []
  for i, value in zip(grad_index, primals):
    grad = result[i] if i is not None and i < len(result) else None
    if grad is None or not jax.numpy.issubdtype(value.dtype, jax.numpy.inexact):
      grads.append(_zeros_for(value))
      continue
    grad = _array(grad)
    if grad.shape != value.shape:
      raise errors.UsageError(
          f"{name}.backward returned a gradient of shape {tuple(grad.shape)} for an input of "
          f"shape {tuple(value.shape)}; each gradient has its input's shape.")
    grads.append(grad.astype(value.dtype))
  return tuple(grads)


def custom_gradient(name: str, forward: Callable, backward: Callable, args: tuple) -> Any:
  """`forward(ctx, *args)` on traced tensors, differentiated by `backward(ctx, *grads)` (one
  gradient per element of `args`, None for none), as `torch.autograd.Function` defines them.
  Tensors inside containers in `args` get no gradient, as in torch.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> double_grad = lambda x: custom_gradient("d", lambda ctx, t: t + 0, lambda ctx, g: 2 * g,
    ...                                         (x,))
    >>> x = torch.ones(2, device="xla", requires_grad=True)
    >>> jb.bridge(double_grad)(x).sum().backward(); x.grad.cpu().tolist()
    [2.0, 2.0]
  """
  jax = runtime.jax_module()
  top_level = {id(a): i for i, a in enumerate(args) if _is_tensor(a)}
  grad_index = [top_level.get(id(leaf)) for leaf in jax.tree.leaves(list(args), is_leaf=_is_tensor)
                if _holds_array(leaf)]  # the argument each of `_split`'s arrays is, for its grad
  inputs, input_layout = _split(list(args))
  needs_grad = tuple(_is_tensor(a) and a.dtype.is_floating_point for a in args)
  static: dict = {}  # the layouts the forward's trace learns

  def run_forward(arrays):
    ctx = Context(needs_grad)
    # JAX traces it again outside the bridged call under remat; grad mode off, as torch runs it
    with tracing.torch_code(), grad_reads.function_forward():
      outputs, static["outputs"] = _split(forward(ctx, *_join(arrays, input_layout)))
    return ctx, outputs

  @jax.custom_vjp
  def primal(*arrays):
    return run_forward(arrays)[1]

  def primal_fwd(*arrays):
    ctx, outputs = run_forward(arrays)
    residuals, static["ctx"] = _split(dict(vars(ctx)))
    return outputs, (residuals, outputs, arrays)

  def primal_bwd(saved, cotangents):
    residuals, outputs, primals = saved
    ctx = Context(needs_grad)
    vars(ctx).update(_join(residuals, static["ctx"]))
    grads = [c if c.dtype != jax.dtypes.float0 else jax.numpy.zeros(o.shape, o.dtype)
             for c, o in zip(cotangents, outputs)]
    grad_tree = _join(grads, static["outputs"])
    with tracing.torch_code():
      result = backward(ctx, *(grad_tree if isinstance(grad_tree, (tuple, list)) else
                               (grad_tree,)))
    return _input_grads(name, result, grad_index, primals)

  primal.defvjp(primal_fwd, primal_bwd)
  return grad_reads.like(_join(primal(*inputs), static["outputs"]), args)  # torch's rule


_RULES: dict = {}  # "module.Class" -> what its `apply` does inside a trace


def register_function_rule(name: str, rule: Callable) -> None:
  """Makes `Function.apply` of the autograd Function class `name` ("module.Class") call
  `rule(*args, **kwargs)` inside a trace, for Functions whose forward or backward calls torch's
  autograd itself (checkpointing), which traced tensors do not have.

  Example:
    >>> register_function_rule("mylib.Identity", lambda x: x)
    >>> del _RULES["mylib.Identity"]  # the doctest's own cleanup
  """
  _RULES[name] = rule


def _apply(cls, *args, **kwargs):
  """torch's `Function.apply`; on traced tensors in a thread that traces bridged code, the
  Function's forward and backward as a `jax.custom_vjp`."""
  jax = runtime.jax_module()
  tensors = [leaf for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_tensor)
             if _is_tensor(leaf)]
  if not (_FUNCTION_APPLY.active() and tensors and all(map(tracing.is_traced, tensors))) or (
      torch_private.functorch_transforms_active()):  # under torch.vmap: torch's own rules
    return _FUNCTION_APPLY.original("apply").__get__(None, cls)(*args, **kwargs)
  rule = _RULES.get(f"{cls.__module__}.{cls.__qualname__}")
  if rule is not None:
    return rule(*args, **kwargs)
  base = torch.autograd.function.Function
  backward = cls.vjp if cls.backward is base.backward and cls.vjp is not base.vjp else cls.backward
  if cls.setup_context is not base.setup_context:
    bound = inspect.signature(cls.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    args = bound.args

    def forward(ctx, *inputs):
      output = cls.forward(*inputs)
      cls.setup_context(ctx, inputs, output)
      return output
  elif kwargs:
    raise errors.UsageError(f"{cls.__name__}.apply takes positional arguments only (torch's "
                            f"rule for a Function without setup_context).")
  else:
    forward = cls.forward
  return custom_gradient(cls.__name__, forward, backward, args)


_FUNCTION_APPLY = patching.Patch(lambda: [torch.autograd.function.Function],
                                 {"apply": classmethod(_apply)})
tracing.register_trace_context(lambda: _FUNCTION_APPLY)
