"""`jax_op`: a JAX function as a `torch.library` custom op, so torch code and `torch.compile`
call it like any torch operator.

The op takes a list of tensors and returns a list of tensors. Its fake (meta) kernel reads output
shapes and dtypes from `jax.eval_shape`, with symbolic sizes where JAX can follow them; its XLA
kernel is `call_jax`; its CPU kernel runs the jitted function on the CPU tensors' memory through
DLPack; its gradient is a second op, the `jax.vjp` of the function. Inside bridged torch code
(`bridge`, `BridgeModule`, the `jaxbridge` compile backend) the function is inlined into the
trace instead.
"""
import functools
from typing import Any, Callable

import numpy as np
import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import call, dtypes, runtime, tracing
from torch_xla_jaxbridge._interop import dlpack

# namespace -> torch.library.Library (kept alive: dropping one unregisters ops)
_LIBRARIES: dict[str, Any] = {}
_DEFAULT_NAMESPACE = "jaxbridge"


class JaxOp:
  """A JAX function registered as the torch op `torch.ops.<namespace>.<name>`; see `jax_op`."""

  def __init__(self, jax_func, name):
    namespace, _, short = name.rpartition("::")
    namespace = namespace or _DEFAULT_NAMESPACE
    if not short.isidentifier() or not namespace.isidentifier():
      raise errors.BadArgumentError(
          f"jax_op: name={name!r} is not a valid op name; use an identifier such as 'my_op' or "
          f"'my_namespace::my_op'.")
    self._fn = jax_func
    self.returns_tuple = None  # learnt from the first call: a tuple of arrays, or one array
    self.op = _define(namespace, short, self._flat_call)
    self._vjp = _define(namespace, short + "_vjp", self._flat_vjp)
    torch.library.register_autograd(self.op, self._backward, setup_context=_save_for_backward)
    tracing.register_op_override(self.op, self._inline)
    functools.update_wrapper(self, jax_func)

  def __call__(self, *tensors):
    for i, t in enumerate(tensors):
      if not isinstance(t, torch.Tensor):
        raise errors.BadArgumentError(
            f"{self.op}: argument {i} is a {type(t).__name__}; a jax_op takes tensors only. Bind "
            f"other values into the function first (functools.partial or a closure).")
    outputs = self.op(list(tensors))
    return tuple(outputs) if self.returns_tuple else outputs[0]

  def _flat_call(self, tensors):
    """The JAX function on a list of arrays, returning a list of arrays."""
    outputs = self._fn(*tensors)
    returns_tuple = isinstance(outputs, (tuple, list))
    if self.returns_tuple not in (None, returns_tuple):
      raise errors.BadArgumentError(
          f"{self.op}: the function returned {'a tuple' if returns_tuple else 'one array'} here "
          f"and {'one array' if returns_tuple else 'a tuple'} before; a jax_op must keep one "
          f"output structure.")
    self.returns_tuple = returns_tuple
    outputs = list(outputs) if returns_tuple else [outputs]
    jax = runtime.jax_module()
    for i, out in enumerate(outputs):
      if not isinstance(out, jax.Array):
        raise errors.BadArgumentError(
            f"{self.op}: output {i} is a {type(out).__name__}; a jax_op function returns an "
            f"array or a tuple of arrays.")
    return outputs

  def _flat_vjp(self, primals, cotangents):
    """Gradients of the floating-point inputs, given cotangents of the floating-point outputs."""
    jax = runtime.jax_module()
    wrt = [i for i, p in enumerate(primals) if _differentiable(p.dtype)]

    def of_wrt(*values):
      full = list(primals)
      for i, v in zip(wrt, values):
        full[i] = v
      return self._flat_call(full)

    outputs, pullback = jax.vjp(of_wrt, *[primals[i] for i in wrt])
    given = iter(cotangents)
    full_cts = [next(given) if _differentiable(o.dtype) else np.zeros(o.shape, jax.dtypes.float0)
                for o in outputs]
    return list(pullback(full_cts))

  def _backward(self, ctx, grads):
    outputs = [(g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device))
               for g, (shape, dtype) in zip(grads, ctx.outputs) if _differentiable(dtype)]
    inputs = ctx.saved_tensors
    if not outputs:
      return ([None] * len(inputs),)
    grads_in = iter(self._vjp(list(inputs), outputs))
    return ([next(grads_in) if _differentiable(t.dtype) else None for t in inputs],)

  def _inline(self, tensors):
    """The op inside a torchax trace: the JAX function runs on the traced arrays directly."""
    return tracing.to_torchax(self._flat_call(tracing.to_jax(list(tensors))))


def jax_op(jax_func: Callable, *, name: str) -> JaxOp:
  """Registers `jax_func` as a torch custom op and returns a callable that takes torch tensors.

  The callable takes the function's positional arguments as tensors (CPU or XLA) and returns a
  tensor, or a tuple of tensors when the function returns a tuple. On XLA tensors it adds one
  `call_jax` node to the LazyTensor graph; on CPU tensors it runs the jitted function on the
  tensors' own memory (DLPack, no copies). Gradients come from `jax.vjp` of the function (a second
  op, `<name>_vjp`). `torch.compile(fullgraph=True)` sees one op node and never traces into JAX;
  its fake kernel takes output shapes from `jax.eval_shape`, symbolic under `dynamic=True`.

  Args:
    jax_func: a pure, `jax.jit`-traceable function of arrays, returning an array or a tuple of
      arrays. Bind non-array arguments first (`functools.partial`).
    name: `"op"` (registered as `torch.ops.jaxbridge.op`) or `"namespace::op"`.

  Returns:
    A callable; its `.op` attribute is the registered `torch.ops` overload.

  Example:
    >>> import jax, torch, torch_xla_jaxbridge as jb
    >>> gelu = jb.jax_op(lambda x: x * jax.nn.sigmoid(1.702 * x), name="doc_gelu")
    >>> x = torch.randn(4, requires_grad=True)
    >>> torch.compile(lambda t: gelu(t).sum(), fullgraph=True)(x).backward()
  """
  if not callable(jax_func):
    raise errors.BadArgumentError(f"jax_op: expected a JAX function, got {type(jax_func)}.")
  return JaxOp(jax_func, name)


def _define(namespace, name, flat_fn):
  """Registers `namespace::name(Tensor[] ...) -> Tensor[]` running the JAX `flat_fn`, and
  returns its overload."""
  n_lists = flat_fn.__code__.co_argcount - 1  # bound method: minus self
  qualname = f"{namespace}::{name}"
  library = _LIBRARIES.get(namespace)
  if library is None:
    library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
  arguments = ", ".join(f"Tensor[] a{i}" for i in range(n_lists))
  try:
    library.define(f"{name}({arguments}) -> Tensor[]")
  except RuntimeError as e:
    if "already" not in str(e) and "multiple times" not in str(e):
      raise
    raise errors.BadArgumentError(
        f"jax_op: an op named {qualname} is already registered; choose another name.") from None
  library.impl(name, functools.partial(_run_on_xla, flat_fn, qualname), "XLA")
  library.impl(name, functools.partial(_run_on_cpu, flat_fn), "CPU")
  torch.library.register_fake(qualname, functools.partial(_fake, flat_fn), lib=library)
  return getattr(getattr(torch.ops, namespace), name).default


def _run_on_xla(flat_fn, qualname, *lists):
  return list(call.call_jax(flat_fn, lists, name=qualname.replace("::", ".")))


def _run_on_cpu(flat_fn, *lists):
  jax = runtime.jax_module()
  inputs = [[_cpu_to_jax(jax, t) for t in ts] for ts in lists]
  outputs = _jitted(flat_fn)(*inputs)
  given = {t.data_ptr() for ts in lists for t in ts}
  results = [torch.utils.dlpack.from_dlpack(o) for o in outputs]
  # JAX forwards an input array unchanged to an output; a custom op's outputs must not alias inputs
  return [r.clone() if r.numel() and r.data_ptr() in given else r for r in results]


@functools.lru_cache(maxsize=256)
def _jitted(flat_fn):
  return runtime.jax_module().jit(flat_fn)


def _cpu_to_jax(jax, tensor):
  return jax.dlpack.from_dlpack(dlpack.shareable(tensor))  # dense, aligned host memory only


def _fake(flat_fn, *lists):
  """Output tensors with the shapes and dtypes `jax.eval_shape` gives, symbolic where it can."""
  jax = runtime.jax_module()
  tensors = [t for ts in lists for t in ts]
  if not tensors:
    raise errors.BadArgumentError("jax_op: called with no tensors; pass at least one tensor.")
  try:
    specs, symbols = _symbolic_specs(jax, lists)
    outputs = _off_thread(jax.eval_shape, flat_fn, *specs)
  except Exception as e:  # shapes JAX cannot follow symbolically: specialize them
    if not _is_shape_polymorphism_error(e):
      raise
    specs, symbols = _concrete_specs(jax, lists), {}
    outputs = _off_thread(jax.eval_shape, flat_fn, *specs)
  return [tensors[0].new_empty([_to_torch_size(d, symbols) for d in o.shape],
                               dtype=dtypes.to_torch(o.dtype)) for o in outputs]


@functools.cache
def _helper_thread():
  import concurrent.futures

  return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxbridge-eval-shape")


def _off_thread(fn, *args):
  """`fn(*args)` on a helper thread. JAX's symbolic-shape evaluation, run on the thread that
  torch is tracing on, makes torch lose the Python state of a later FakeTensor (torch.compile then
  fails with "'FakeTensor' object has no attribute 'fake_mode'"); on another thread it does not."""
  return _helper_thread().submit(fn, *args).result()


def _symbolic_specs(jax, lists):
  """`ShapeDtypeStruct`s for the tensors, each non-constant size a JAX symbol; and the map from
  symbol name to torch size."""
  from jax import export

  scope = export.SymbolicScope()
  symbols: dict = {}
  names: dict = {}
  specs = []
  for ts in lists:
    row = []
    for t in ts:
      dims = []
      for d in t.shape:
        if isinstance(d, torch.SymInt) and not d.node.is_constant():
          key = str(d)
          if key not in names:
            names[key] = f"d{len(names)}"
            symbols[names[key]] = d
          dims.append(names[key])
        else:
          dims.append(str(int(d)))
      shape = export.symbolic_shape(", ".join(dims), scope=scope) if dims else ()
      row.append(jax.ShapeDtypeStruct(shape, dtypes.to_jax(t.dtype)))
    specs.append(row)
  return specs, symbols


def _concrete_specs(jax, lists):
  return [[jax.ShapeDtypeStruct(tuple(int(d) for d in t.shape), dtypes.to_jax(t.dtype))
           for t in ts] for ts in lists]


_SIZE_FUNCTIONS = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
                   "max": torch.sym_max, "min": torch.sym_min,
                   "non_negative": lambda a: torch.sym_max(a, 0)}


def _to_torch_size(dim, symbols):
  """A JAX output size (an int or a symbolic expression such as `2*d0 + 1`) as a torch size."""
  if isinstance(dim, int):
    return dim
  return eval(str(dim), {"__builtins__": {}}, {**_SIZE_FUNCTIONS, **symbols})  # noqa: S307


def _is_shape_polymorphism_error(e):
  """Whether `e` may come from symbolic sizes (a real error in the function recurs concretely)."""
  jax = runtime.jax_module()
  return isinstance(e, (jax.core.InconclusiveDimensionOperation, TypeError, ValueError))


def _differentiable(dtype):
  if isinstance(dtype, torch.dtype):
    return dtype.is_floating_point or dtype.is_complex
  return np.issubdtype(dtype, np.inexact) or str(dtype) == "bfloat16"


def _save_for_backward(ctx, inputs, output):
  (tensors,) = inputs
  ctx.save_for_backward(*tensors)
  ctx.outputs = [(o.shape, o.dtype) for o in output]
  ctx.device = output[0].device if output else None
