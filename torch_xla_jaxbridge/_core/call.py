"""`call_jax`: run a JAX function on XLA tensors as one node of the LazyTensor graph."""
from __future__ import annotations

import contextlib
import inspect
import re
import threading
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import jax_private, torch_xla_private
from torch_xla_jaxbridge._core import dtypes, grad_reads, lowering, plain, runtime, threads, tracing
from torch_xla_jaxbridge._core.runtime import PyTree

_TENSOR = object()  # marks a tensor leaf among the static leaves of a signature
_X64 = threading.local()  # .on: calls lower in 64-bit mode whatever their inputs (`in_x64`)
_jax: Any = None  # the jax module, once `_load` ran
_user_computation: Any = None  # torch_xla_private.user_computation, once `_load` ran


def _load() -> None:
  global _jax, _user_computation
  _jax = runtime.jax_module()
  _user_computation = torch_xla_private.user_computation


def call_jax(jax_func: Callable, args: tuple, kwargs: dict | None = None,
             name: str | None = None) -> Any:
  """Calls `jax_func(*args, **kwargs)` on XLA tensors, as one node of the LazyTensor graph.

  Tensors anywhere in the `args`/`kwargs` pytrees reach `jax_func` as `jax.Array`s; every other
  leaf (Python scalars, strings, `torch.dtype`s, NumPy arrays) is static: it is baked into the
  trace and is part of the cache key. The function is traced and lowered once per abstract
  signature; later calls only add the cached computation to the graph. Inside bridged code (the
  tensors are traced torchax tensors) the function runs directly in the enclosing trace: no node
  of its own, gradients through the enclosing call's `jax.vjp`.

  Args:
    jax_func: a pure, `jax.jit`-traceable function.
    args: tuple of positional arguments (pytrees of XLA tensors and static values).
    kwargs: dict of keyword arguments, or None.
    name: name of the IR node (`xla::<name>`); defaults to the function's name.

  Returns:
    The function's output pytree with every array replaced by an XLA tensor.

  Example:
    >>> import jax.numpy as jnp, torch, torch_xla
    >>> import torch_xla_jaxbridge as jb
    >>> a = torch.ones(3, 3, device="xla")
    >>> b = jb.call_jax(lambda x, y: x + jnp.sin(y), (a, a))
    >>> torch.testing.assert_close(b.cpu(), 1 + torch.sin(torch.ones(3, 3)))
  """
  if _jax is None:
    _load()
  if not callable(jax_func):
    raise errors.BadArgumentError(
        f"call_jax: jax_func is a {type(jax_func).__name__} ({jax_func!r:.60}); expected the JAX "
        f"function to call, e.g. jb.call_jax(lambda x: jnp.sin(x), (tensor,)).")
  leaves, treedef = _jax.tree.flatten((args, kwargs))
  traced_type = tracing.torchax_tensor_type() or ()
  tensors = []
  statics = []
  for leaf in leaves:  # one pass: the host time of a step grows with its tensors
    if isinstance(leaf, torch.Tensor):
      if isinstance(leaf, traced_type):
        return _inline(jax_func, leaves, treedef, (args, kwargs), name)
      tensors.append(leaf)
      statics.append(_TENSOR)
    else:
      statics.append(leaf)
  anchor, subkey, captured = _cache_anchor(jax_func)
  static_key = tuple([(type(s), s) for s in statics])
  try:
    hash(static_key)
  except TypeError:  # an unhashable static leaf: key it by value, or say which one
    static_key = static_keys(statics, (args, kwargs), function_name(jax_func, name))
  shapes = tuple([(t.shape, t.dtype, t.is_xla)  # type: ignore[attr-defined]  # not in stubs
                  for t in tensors])
  signature = (name, treedef, shapes, static_key,
               (jax_private.trace_context(), getattr(_X64, "on", False)), captured)
  entry = lowering.CACHE.lookup(anchor, subkey, signature)
  if entry is None:
    with threads.TRACING:  # one trace at a time; another thread may have made this one meanwhile
      entry = lowering.CACHE.lookup(anchor, subkey, signature) or _trace(
          jax_func, anchor, subkey, signature, (args, kwargs), tensors, statics, treedef, name)
  if entry.kept is not None:  # the inputs the program reads
    tensors = [tensors[i] for i in entry.kept]
  outputs = _user_computation(entry.op_name, tensors, entry.computation)
  return entry.out_tree.unflatten(outputs)


@contextlib.contextmanager
def in_x64(on: bool) -> Iterator[None]:
  """With `on`, `call_jax` calls in the block (this thread) lower in JAX's 64-bit mode even when
  no input is 64-bit: a backward node runs a vjp traced in that mode (its forward had int64
  inputs), whose weak-typed constants and index arithmetic are 64-bit.

  Example:
    >>> import jax.numpy as jnp, torch
    >>> x = torch.ones(2, device="xla")
    >>> call_jax(lambda a: jnp.arange(2.0) + a, (x,)).dtype
    torch.float32
    >>> with in_x64(True):
    ...   call_jax(lambda a: jnp.arange(2.0) + a, (x,)).dtype
    torch.float64
  """
  before = getattr(_X64, "on", False)
  _X64.on = bool(on)
  try:
    yield
  finally:
    _X64.on = before


def _inline(jax_func: Callable, leaves: list, treedef: Any, tree: PyTree,
            name: str | None) -> PyTree:
  """`call_jax` inside bridged code: `jax_func` on the traced arrays, outputs as torchax tensors."""
  values = []
  for path, leaf in zip(_leaf_paths(tree), leaves):
    if isinstance(leaf, torch.Tensor) and not tracing.is_traced(leaf):
      raise errors.CapturedTensorError(
          f"{function_name(jax_func, name)}: {path} is a tensor on {leaf.device} from outside "
          f"the bridged code that calls call_jax (its other tensors are traced). Pass it to the "
          f"bridged function as an argument, or read it from a variable it closes over.")
    values.append(leaf.jax() if tracing.is_traced(leaf) else
                  dtypes.to_jax(leaf) if isinstance(leaf, torch.dtype) else leaf)
  args, kwargs = treedef.unflatten(values)
  return grad_reads.like(tracing.to_torchax(jax_func(*args, **(kwargs or {}))), leaves)


def _cache_anchor(fn: Any) -> tuple[object, object, Hashable]:
  """What the cache keys `fn` by: (anchor held by the cache, subkey, captured values).

  A bound method is anchored (weakly) on its instance. A closure or lambda whose captured values
  and defaults are all plain values is anchored on its code object with those values in the
  signature, so a closure redefined every step finds the trace of its twin. Anything else is
  anchored (weakly) on the function object itself.
  """
  if inspect.ismethod(fn):
    return fn.__self__, fn.__func__, None
  code = getattr(fn, "__code__", None)
  if code is not None and (fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__):
    try:
      captured = plain.key(tuple(c.cell_contents for c in fn.__closure__ or ()))
      defaults = plain.key((fn.__defaults__, fn.__kwdefaults__ or {}))
    except (plain.NotPlain, ValueError):  # ValueError: an empty cell
      return fn, None, None
    return code, id(fn.__globals__), (captured, defaults)
  return fn, None, None


def static_keys(statics: Sequence, tree: PyTree, caller: str) -> tuple:
  """The cache keys of the leaves of `tree` (`statics`: a static value or the tensor marker at
  each position), by `plain.static_key`; an unhashable one is an error naming its path.

  Example:
    >>> static_keys([2, "a"], ((2, "a"), None), "f") == static_keys([2, "a"], ((2, "a"), None), "f")
    True
  """
  keys = []
  for i, s in enumerate(statics):
    try:
      keys.append((object, s) if s is _TENSOR else plain.static_key(s))
    except plain.NotPlain:
      raise plain.unhashable_error(caller, _leaf_paths(tree)[i], s) from None
  return tuple(keys)


def path_name(path: Sequence) -> str:
  """The readable name of a leaf of `(args, kwargs)` from its JAX key path: `args[0]`,
  `kwargs['x'][1]`, ...

  Example:
    >>> jax = runtime.jax_module()
    >>> [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(((1,), {"x": 2}))[0]]
    ['args[0]', "kwargs['x']"]
  """
  return ("args", "kwargs")[path[0].idx] + runtime.jax_module().tree_util.keystr(path[1:])


def _leaf_paths(tree: PyTree) -> tuple[str, ...]:
  """Readable names of the leaves of `(args, kwargs)`."""
  with_path, _ = runtime.jax_module().tree_util.tree_flatten_with_path(tree)
  return tuple(path_name(path) for path, _ in with_path)


def function_name(fn: object, name: str | None = None) -> str:
  """A node-name-safe name for `fn`: `name` if given, else its `__name__` or type name."""
  raw = name or getattr(fn, "__name__", None) or type(fn).__name__
  return re.sub(r"[^0-9A-Za-z_.]", "_", raw)


def _trace(jax_func: Callable, anchor: object, subkey: object, signature: tuple, tree: PyTree,
           tensors: list[torch.Tensor], statics: list, treedef: Any,
           name: str | None) -> lowering.Lowered:
  fn_name = function_name(jax_func, name)
  paths = _leaf_paths(tree)
  tensor_paths = [p for p, s in zip(paths, statics) if s is _TENSOR]
  for path, t in zip(tensor_paths, tensors):
    if t.device.type != "xla":
      raise errors.BadArgumentError(
          f"{fn_name}: {path} is a {t.device.type} tensor; call_jax takes XLA tensors. "
          f"Move it with `.to('xla')` (or `torch_xla.device()`) before the call.")
  avals = [_jax.ShapeDtypeStruct(tuple(t.shape), dtypes.to_jax(t.dtype, where=path))
           for path, t in zip(tensor_paths, tensors)]
  reason = _retrace_reason(fn_name, lowering.CACHE.previous(anchor, subkey), signature, paths)
  values = [dtypes.to_jax(s) if isinstance(s, torch.dtype) else s for s in statics]

  def flat_fn(*tensor_leaves: Any) -> tuple[list, Any]:
    it = iter(tensor_leaves)
    args, kwargs = treedef.unflatten([next(it) if s is _TENSOR else s for s in values])
    out_leaves, out_tree = _jax.tree.flatten(jax_func(*args, **(kwargs or {})))
    return [dtypes.torch_compatible(_jax, x) for x in out_leaves], out_tree

  enable_x64 = dtypes.needs_x64([t.dtype for t in tensors]) or getattr(_X64, "on", False)
  try:
    computation, out_tree, kept = lowering.lower(flat_fn, avals, op_name=f"xla::{fn_name}",
                                           enable_x64=enable_x64)
  except errors.BridgeError:
    raise
  except Exception as e:
    shapes = ", ".join(f"{p}: {tuple(t.shape)} {t.dtype}" for p, t in zip(tensor_paths, tensors))
    raise errors.JaxTracingError(
        f"{fn_name} raised while being traced for ({shapes}): {type(e).__name__}: {e}") from e
  entry = lowering.Lowered(f"xla::{fn_name}", computation, out_tree, paths, kept)
  lowering.CACHE.add(anchor, subkey, signature, entry, reason)
  return entry


def _retrace_reason(fn_name: str, previous: tuple | None, signature: tuple,
                    paths: Sequence[str]) -> str | None:
  """One line saying what changed since this function's last signature; None if first trace."""
  if previous is None:
    return None
  (old_name, old_tree, old_tensors, old_statics, old_config, old_captured), _ = previous
  name, tree, tensors, statics, config, captured = signature
  changes = []
  if old_tree != tree:
    changes.append(f"pytree structure {old_tree} -> {tree}")
    if old_statics and statics and old_statics[0] != statics[0] and statics[0][1] is not _TENSOR:
      changes.append(f"{paths[0]} static value {_show(old_statics[0])} -> {_show(statics[0])}")
  else:
    tensor_paths = [p for p, s in zip(paths, statics) if s[1] is _TENSOR]
    for path, (old_shape, old_dtype, _), (shape, dtype, _) in zip(tensor_paths, old_tensors,
                                                                  tensors):
      if old_shape != shape:
        changes.append(f"{path} shape {tuple(old_shape)} -> {tuple(shape)}")
      if old_dtype != dtype:
        changes.append(f"{path} dtype {old_dtype} -> {dtype}")
    for path, old, new in zip(paths, old_statics, statics):
      if old != new and new[1] is not _TENSOR:
        described = getattr(new[-1], "describe_change", lambda _: None)(old[-1])
        changes.append(described or f"{path} static value {_show(old)} -> {_show(new)}")
  if old_config != config:
    changes.append("JAX config changed (x64, matmul precision, ...)")
  if old_captured != captured:
    changes.append("closed-over values or defaults changed")
  if old_name != name:
    changes.append(f"name {old_name!r} -> {name!r}")
  return f"{fn_name}: " + ("; ".join(changes) or "new signature")


def _show(static_key: tuple) -> str:
  kind, value = static_key[0], static_key[-1]
  return f"{value!r} ({kind.__name__})" if kind in (int, float, bool) else repr(value)
