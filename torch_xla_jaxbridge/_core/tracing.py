"""torch code run on JAX values while JAX traces: the torchax environment and its two registries.

`run_torch` runs a torch function with every tensor a torchax tensor wrapping a traced array,
randomness drawn from a key passed in, and in-place updates of arguments reported so the caller
can write them back. Features plug in without this module knowing them:

- `register_op_override(op, impl)`: bridged code runs `impl` for a torch op, always (performance
  overrides, `jax_op`; the user's scoped `override_ops` is a trace context and a trace key).
- `register_trace_context(factory)`: a context entered around every traced torch call (control
  flow, torch's checkpoint as `jax.checkpoint`, `xs.mark_sharding` on traced tensors).
- `register_trace_key(name, read)`: state outside the arguments that decides what traced code
  computes (the autocast state, the active `override_ops`), part of every bridged call's
  trace-cache key.

This module imports no feature module; features import it and register themselves.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeGuard

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import diagnostics, grad_reads, rng, runtime, threads, torch_dtypes
from torch_xla_jaxbridge._core.runtime import PyTree

if TYPE_CHECKING:
  import jax as jax_types
  import torchax

_OP_OVERRIDES: dict[Any, Callable] = {}
_DISPATCH_WRAPPERS: list[Callable] = []
_TRACE_CONTEXTS: list[Callable[[], contextlib.AbstractContextManager]] = []
_TRACE_KEYS: dict[str, Callable[[], object]] = {}
_SCOPE = threading.local()
# `traced_arrays`'s rebuild: new arrays -> (the pytree with them as torchax tensors, those tensors)
Rebuild = Callable[[Sequence[Any]], tuple[PyTree, list]]


def register_op_override(op: object, impl: Callable) -> None:
  """Makes bridged code run `impl` (on torchax tensors) for the torch op or function `op`.

  Example (what `overrides` does at import; registering it again changes nothing):
    >>> from torch_xla_jaxbridge._integrations import torch_ops
    >>> register_op_override(torch.nn.functional.linear, torch_ops.linear)
  """
  _OP_OVERRIDES[op] = impl
  if environment.done():
    environment().override_op_definition(op, impl)


def register_dispatch_wrapper(wrapper: Callable) -> None:
  """Makes every op torchax converts in bridged code go through `wrapper(dispatch, func, types,
  args, kwargs)`, where `dispatch` converts it as before (the last registered runs first).

  Example (`overrides`, `autocast` and `custom_ops` register theirs at import; a registration
  lasts for the process):
    >>> from torch_xla_jaxbridge._integrations import custom_ops
    >>> custom_ops._dispatch in _DISPATCH_WRAPPERS
    True
  """
  _DISPATCH_WRAPPERS.append(wrapper)
  if environment.done():
    torchax_private.wrap_dispatch(environment(), wrapper)


def register_trace_context(factory: Callable[[], contextlib.AbstractContextManager]) -> None:
  """Enters `factory()` around every traced torch call, in registration order.

  Example:
    >>> register_trace_context(contextlib.nullcontext)
    >>> _TRACE_CONTEXTS.remove(contextlib.nullcontext)  # the doctest's own cleanup
  """
  _TRACE_CONTEXTS.append(factory)


def register_trace_key(name: str, read: Callable[[], object]) -> None:
  """Makes `read()` (hashable, read at each bridged call) part of the trace-cache key; a change
  re-traces once, and the re-trace reason names `name`.

  Example:
    >>> register_trace_key("demo", lambda: 1)
    >>> trace_keys()[-1]
    ('demo', 1)
    >>> del _TRACE_KEYS["demo"]  # the doctest's own cleanup
  """
  _TRACE_KEYS[name] = read


def trace_keys() -> tuple:
  """`((name, value), ...)` for every registered trace key, read now.

  Example:
    >>> isinstance(trace_keys(), tuple)
    True
  """
  return tuple([(name, read()) for name, read in _TRACE_KEYS.items()])


def describe_key_change(old: tuple, new: tuple) -> str:
  """The re-trace reason for two `trace_keys()` results: `"name old -> new"` per change.

  Example:
    >>> describe_key_change((("autocast", "off"),), (("autocast", "xla bfloat16"),))
    'autocast off -> xla bfloat16'
  """
  before = dict(old)
  return "; ".join(f"{name} {before.get(name)} -> {value}" for name, value in new
                   if before.get(name) != value)


def _plain_tensor_used(tensor: torch.Tensor) -> None:
  raise diagnostics.PlainTensorUsed(tuple(tensor.shape))


@threads.once
def environment() -> torchax.tensor.Environment:
  """The torchax environment bridged code runs in (created on first use).

  Its tensors report the XLA device as their `device`, as in plain torch_xla. New tensors
  (`torch.zeros(3)`, `torch.arange(n, device=x.device)`) are JAX values whatever device they
  name, and math between a torchax tensor and an outside torch tensor is an error
  rather than a silent constant.

  Example:
    >>> env = environment()
  """
  jax = runtime.jax_module()
  import torch_xla
  import torchax.config

  env_type = torchax_private.environment_class(_plain_tensor_used,
                                               functools.partial(rng.next_key, jax))
  torchax_private.report_device(env_type, torch_xla.device())
  torchax_private.report_requires_grad(env_type, grad_reads.MARK)
  # its default key must be a constant even mid-trace; making it starts JAX's backend
  with jax.ensure_compile_time_eval(), runtime.process_state_kept():
    env = env_type(torchax.config.Configuration(allow_mixed_math_with_scalar_tensor=False))
  for op, impl in _OP_OVERRIDES.items():
    env.override_op_definition(op, impl)
  torchax_private.wrap_dispatch(env, torch_dtypes.dispatcher(env))  # innermost: torchax's results
  for wrapper in _DISPATCH_WRAPPERS:
    torchax_private.wrap_dispatch(env, wrapper)
  torchax_private.wrap_dispatch(env, grad_reads.dispatcher)  # outermost: every op's results
  return env


def torchax_tensor_type() -> type[torchax.tensor.Tensor] | None:
  """torchax's tensor class, or None while torchax is not imported (then no tensor is one).

  Example:
    >>> torchax_tensor_type() is None or torchax_tensor_type().__name__ == "Tensor"
    True
  """
  return getattr(sys.modules.get("torchax.tensor"), "Tensor", None)


def is_traced(value: object) -> TypeGuard[torchax.tensor.Tensor]:
  """Whether `value` is a tensor of torch code being traced (a torchax tensor).

  Example:
    >>> is_traced(torch.ones(2))
    False
  """
  tensor = torchax_tensor_type()
  return tensor is not None and isinstance(value, tensor)


def to_jax(tree: PyTree) -> PyTree:
  """`tree` with each torchax tensor replaced by its JAX array; other leaves unchanged.

  Example:
    >>> to_jax({"n": 1})
    {'n': 1}
  """
  jax = runtime.jax_module()
  return jax.tree.map(lambda t: t.jax() if is_traced(t) else t, tree,
                      is_leaf=lambda t: isinstance(t, torch.Tensor))


def to_torchax(tree: PyTree) -> PyTree:
  """`tree` with each JAX array wrapped as a torchax tensor of the bridge environment.

  Example:
    >>> to_torchax((runtime.jax_module().numpy.ones(2),))[0].shape
    torch.Size([2])
  """
  jax = runtime.jax_module()
  env = environment()
  import torchax.tensor

  return jax.tree.map(
      lambda a: torchax.tensor.Tensor(a, env) if isinstance(a, jax.Array) else a, tree)


def traced_arrays(tree: PyTree) -> tuple[list[torchax.tensor.Tensor], Rebuild]:
  """`(tensors, rebuild)` for a pytree of torch values inside a trace: `tensors` are its traced
  tensors, and `rebuild(arrays)` gives the pytree with new torchax tensors of `arrays` in their
  places, and those new tensors. Runs torch code as a function of arrays (`jax.checkpoint`).

  Example:
    >>> jax = runtime.jax_module()
    >>> tensors, rebuild = traced_arrays((to_torchax(jax.numpy.ones(2)), 3))
    >>> (x, n), new = rebuild([jax.numpy.zeros(2)])
    >>> x.jax().tolist(), n, new[0] is x
    ([0.0, 0.0], 3, True)
  """
  jax = runtime.jax_module()
  leaves, treedef = jax.tree.flatten(tree)
  positions = [i for i, leaf in enumerate(leaves) if is_traced(leaf)]

  def rebuild(arrays: Sequence[jax_types.Array]) -> tuple[PyTree, list[torchax.tensor.Tensor]]:
    full, new = list(leaves), to_torchax(list(arrays))
    for position, tensor in zip(positions, new):
      grad_reads.mark(tensor, grad_reads.marked(leaves[position]))
      full[position] = tensor
    return treedef.unflatten(full), new

  return [leaves[i] for i in positions], rebuild


def scoped_cache(name: str) -> dict:
  """A dict that lives as long as the innermost `run_torch` call (a fresh one outside any).

  Example:
    >>> scoped_cache("folds")
    {}
  """
  caches = getattr(_SCOPE, "caches", None)
  return {} if caches is None else caches.setdefault(name, {})


@contextlib.contextmanager
def _new_scope() -> Iterator[None]:
  saved = getattr(_SCOPE, "caches", None)
  _SCOPE.caches = {}
  try:
    yield
  finally:
    _SCOPE.caches = saved


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
  saved = getattr(_SCOPE, name, False)
  setattr(_SCOPE, name, True)
  try:
    yield
  finally:
    setattr(_SCOPE, name, saved)


def _with_thread_key(jax: types.ModuleType) -> torchax.tensor.Environment:
  """The environment, with this thread's default random key made: torchax's properties are per
  thread and made on first use, which inside a trace would keep a traced value. The same for
  torchax's own global environment, which code that converts through torchax itself uses (torch_xla's
  experimental `assume_pure` called inside bridged code).

  Example:
    >>> _with_thread_key(runtime.jax_module()) is environment()
    True
  """
  import torchax

  env = environment()
  with jax.ensure_compile_time_eval():
    torchax_private.current_key(env)
    torchax_private.current_key(torchax.default_env())
  return env


@contextlib.contextmanager
def torch_code() -> Iterator[None]:
  """Inside the block, torch ops on torchax tensors are traced as `run_torch` traces them (the
  environment, every registered trace context): for torch code that a JAX rule runs, such as an
  autograd Function's backward inside a `custom_vjp`, or its forward traced again for remat.
  Nested blocks in one thread change nothing.

  Example:
    >>> with torch_code():
    ...   (to_torchax(runtime.jax_module().numpy.ones(2)) * 2).jax().tolist()
    [2.0, 2.0]
  """
  if getattr(_SCOPE, "in_torch_code", False):  # already inside: the modes are on
    yield
    return
  jax = runtime.jax_module()
  with _entered(jax, _with_thread_key(jax)):
    yield


@contextlib.contextmanager
def _entered(jax: types.ModuleType, env: torchax.tensor.Environment) -> Iterator[None]:
  """What every `run_torch` call enters, nested ones included, around the torch code it runs."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(threads.TRACING)
    stack.enter_context(_flag("in_torch_code"))
    stack.enter_context(env)
    stack.enter_context(_new_scope())
    # softmax's gradient from its output alone, as torch's: the rule saves no exp and no sums
    stack.enter_context(jax.softmax_custom_jvp(True))
    for factory in _TRACE_CONTEXTS:
      stack.enter_context(factory())
    yield


def run_torch(fn: Callable, key_data: jax_types.Array | None, args: PyTree, kwargs: PyTree, *,
              fn_name: str, grad: grad_reads.Caller | None = None, aliases: list | None = None,
              ) -> tuple[PyTree, dict[int, jax_types.Array], bool]:
  """Calls torch `fn(*args, **kwargs)` on the JAX arrays in `args`/`kwargs`, inside a JAX trace.

  Returns `(outputs, mutated, drew_random)`: outputs with JAX arrays for tensors; a dict from the
  position of each argument array (in `jax.tree.leaves((args, kwargs))` order) that the code
  updated in place to its new value; whether the code drew random numbers. `key_data` (int32[2])
  seeds every random op. `grad`: the grad mode the code runs in and the arrays whose tensors
  answer `requires_grad` True (`grad_reads`); None: as it is now, and none. `aliases`, when
  given, receives one entry per output leaf: `("argument", i)` for an output that is the tensor of
  argument leaf i itself (returned as it came, or after an in-place update), `("output", k)` for
  one returned again after output leaf k, None for the others.

  Example:
    >>> jax = runtime.jax_module()
    >>> out, mutated, drew = run_torch(torch.sin, None, (jax.numpy.zeros(2),), {}, fn_name="sin")
    >>> out.tolist(), mutated, drew
    ([0.0, 0.0], {}, False)
  """
  jax = runtime.jax_module()
  import torchax.tensor

  env = _with_thread_key(jax)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  # one torchax tensor per array: an in-place update through one place shows in all
  tensors: dict[int, torchax.tensor.Tensor] = {}
  wrapped = [tensors.setdefault(id(x), torchax.tensor.Tensor(x, env))
             if isinstance(x, jax.Array) else x for x in leaves]
  t_args, t_kwargs = treedef.unflatten(wrapped)
  prng = rng.key_from_data(jax, key_data) if key_data is not None else None
  try:
    with contextlib.ExitStack() as stack:
      stack.enter_context(threads.TRACING)  # the environment's key is set per trace
      if prng is not None:
        stack.enter_context(env.override_property(prng=prng))
      stack.enter_context(_entered(jax, env))
      if grad is not None:
        stack.enter_context(grad_reads.entered(grad, tensors))
      outputs = fn(*t_args, **(t_kwargs or {}))
      drew_random = prng is not None and torchax_private.current_key(env) is not prng  # key was split
  except errors.BridgeError:
    raise
  except Exception as e:
    raise diagnostics.translate(e, fn_name) from e
  mutated = {i: w.jax() for i, (w, x) in enumerate(zip(wrapped, leaves))
             if isinstance(w, torchax.tensor.Tensor) and w.jax() is not x}
  if aliases is not None:
    aliases.extend(_aliases(jax, outputs, wrapped))
  return _unwrap(jax, outputs, fn_name), mutated, drew_random


def _aliases(jax: types.ModuleType, outputs: PyTree, arguments: list) -> list:
  """Per output leaf: the argument leaf or earlier output leaf it is the very tensor of, or None
  (torchax tensors by identity: a `clone` is another tensor holding the same array)."""
  argument_at: dict[int, tuple[str, int]] = {}
  for i, value in enumerate(arguments):
    if isinstance(value, torch.Tensor):
      argument_at.setdefault(id(value), ("argument", i))
  found: list[tuple[str, int] | None] = []
  seen: dict[int, tuple[str, int]] = {}
  for k, leaf in enumerate(jax.tree.leaves(outputs, is_leaf=lambda x: isinstance(x, torch.Tensor))):
    if not isinstance(leaf, torch.Tensor):
      found.append(None)
      continue
    found.append(argument_at.get(id(leaf)) or seen.get(id(leaf)))
    seen.setdefault(id(leaf), ("output", k))
  return found


def _unwrap(jax: types.ModuleType, outputs: PyTree, fn_name: str) -> PyTree:
  import torchax.tensor

  def unwrap(x: object) -> object:
    if isinstance(x, torchax.tensor.Tensor):
      return x.jax()
    if isinstance(x, torchax.tensor.View):
      return x.torch().jax()
    if isinstance(x, torch.Tensor):
      raise errors.CapturedTensorError(
          f"{fn_name} returned a torch tensor that is not computed from its arguments (shape "
          f"{tuple(x.shape)}, device {x.device}), reached where the bridge does not lift "
          f"tensors from (a helper's closure, an object without `__dict__`). Pass it in as an "
          f"argument, or read it from a variable of the enclosing scope, a global or `self`.")
    return x

  return jax.tree.map(unwrap, outputs, is_leaf=lambda x: isinstance(x, torch.Tensor))
