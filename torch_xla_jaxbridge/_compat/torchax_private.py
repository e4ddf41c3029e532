"""torchax's private hooks, one function each; `test/test_compat.py` checks each directly."""
from typing import Any, Callable


def import_keeping_torch_state() -> None:
  """Imports torchax without the two process-wide changes its `__init__` makes to torch: it renames
  torch's PrivateUse1 backend to "jax" and registers `torch.jax` as that device's module. After
  them `torch.accelerator` answers "jax" and every `DataLoader(pin_memory=True)` raises ("Please
  register PrivateUse1HooksInterface"), and neither can be undone (torch allows one rename per
  process). Both are skipped while torchax imports (torchax's own use of the name is its tensors'
  `device`, see `report_device`). If torchax was imported before, nothing changes. If torchax
  stops calling the two functions by attribute, `test_compat` fails. Public alternative: none.

  Example:
    >>> import_keeping_torch_state()
    >>> import torch; str(torch.accelerator.current_accelerator()) != "jax"
    True
  """
  import sys

  import torch

  if "torchax" in sys.modules:
    return
  rename, register = torch.utils.rename_privateuse1_backend, torch._register_device_module
  # (patches: torch's stubs name the first parameter differently)
  torch.utils.rename_privateuse1_backend = lambda name: None  # type: ignore[assignment]
  torch._register_device_module = lambda name, module: None
  try:
    import torchax  # noqa: F401
  finally:
    torch.utils.rename_privateuse1_backend, torch._register_device_module = rename, register


def report_device(env_type: type, device: Any) -> None:
  """Makes torchax tensors of environments of `env_type` report `device` as their `device` (torch
  code inside bridged code sees the XLA device its inputs are on, as in plain torch_xla) instead
  of "jax:0", a device torch knows only after the rename `import_keeping_torch_state` skips.
  Tensors of other environments keep torchax's answer. Replaces the `device` property of
  torchax's tensor and view classes, once.

  Example:
    >>> import torch
    >>> from torch_xla_jaxbridge._core import tracing
    >>> tracing.to_torchax(tracing.runtime.jax_module().numpy.ones(1)).device.type
    'xla'
  """
  import torchax.tensor
  import torchax.view

  for cls in (torchax.tensor.Tensor, torchax.view.View):
    original = cls.__dict__["device"]
    if getattr(original.fget, "bridge_device", False):
      continue
    ours = property(lambda self, original=original: device  # type: ignore[misc]  # (mypy: default)
                    if isinstance(self._env, env_type) else original.fget(self))
    setattr(ours.fget, "bridge_device", True)
    cls.device = ours


def report_requires_grad(env_type: type, attribute: str) -> None:
  """Makes torchax tensors (and views) of environments of `env_type` answer `requires_grad` as
  `getattr(tensor, attribute, False)` or torch's own flag, except to torch's and torchax's own
  code, which gets torch's flag; setting it sets that attribute (and torch's flag, when set to
  False). Model code then reads True where plain torch would, while torch's autograd machinery
  sees what it has recorded for these tensors: nothing (torchax converts ops above torch's
  autograd). Told True, torch would run `torch.cond` through its autograd Function (which then
  leaks traced values), register tensor hooks that never run, and, with its C++ flag set on a
  wrapper, record the ops torchax leaves to torch's dispatcher (and fail on views). Replaces a
  property torchax's classes inherit from torch's, once. Public alternative: none.

  Example:
    >>> import jax, torchax.tensor
    >>> from torch_xla_jaxbridge._core import tracing
    >>> t = torchax.tensor.Tensor(jax.numpy.zeros(2), tracing.environment())
    >>> t.requires_grad = True; t.requires_grad
    True
  """
  import sys

  import torch
  import torchax.tensor
  import torchax.view

  flag = torch._C.TensorBase.__dict__["requires_grad"]  # torch's getter and setter
  for cls in (torchax.tensor.Tensor, torchax.view.View):
    if getattr(getattr(cls.__dict__.get("requires_grad"), "fget", None), "bridge_requires_grad",
               False):
      continue

    def read(self: Any) -> bool:
      if isinstance(self._env, env_type) and self.__dict__.get(attribute, False):
        caller = sys._getframe(1).f_globals.get("__name__", "").partition(".")[0]
        if caller not in ("torch", "torchax"):
          return True
      return flag.__get__(self)

    def write(self: Any, value: bool) -> None:
      if isinstance(self._env, env_type):
        self.__dict__[attribute] = bool(value)
        if value:
          return
      flag.__set__(self, value)

    setattr(read, "bridge_requires_grad", True)
    setattr(cls, "requires_grad", property(read, write))


def set_array(tensor: Any, array: Any) -> None:
  """Replaces the JAX array inside a torchax tensor (in-place updates: batch norm statistics,
  `xs.mark_sharding`). Reading is public (`tensor.jax()`); writing is not.

  Example:
    >>> import jax, torchax.tensor
    >>> from torch_xla_jaxbridge._core import tracing
    >>> t = torchax.tensor.Tensor(jax.numpy.zeros(2), tracing.environment())
    >>> set_array(t, jax.numpy.ones(2)); t.jax().tolist()
    [1.0, 1.0]
  """
  tensor._elem = array


def environment_class(on_plain_tensor: Callable, next_key: Callable | None = None) -> type:
  """A torchax Environment in which new tensors are JAX values whatever device they name: it
  overrides torchax's `_should_use_torchax_tensor` and `_is_same_device` (private hooks; if they
  are renamed, `torch.zeros(3, device="cpu")` inside bridged code becomes a real CPU tensor and
  math with it an error). `on_plain_tensor(t)` is called for a plain torch tensor that traced
  code mixes into its math (torchax only `assert`s, which `python -O` removes). With
  `next_key`, a draw takes the current key and leaves `next_key(key)` in its place, where
  torchax splits the key (`get_and_rotate_prng_key`, public; the key is `param.prng`).

  Example:
    >>> env_type = environment_class(on_plain_tensor=print)
  """
  import torch
  import torchax.tensor

  from torch_xla_jaxbridge._compat import torch_private

  class BridgeEnvironment(torchax.tensor.Environment):

    def _should_use_torchax_tensor(self, device):
      return True

    def _is_same_device(self, the_tensor, new_device):
      return True

    def t2j_iso(self, torchtensors):
      for leaf in torch_private.tree_leaves(torchtensors):
        if isinstance(leaf, torch.Tensor) and not isinstance(
            leaf, (torchax.tensor.Tensor, torchax.tensor.View)):
          on_plain_tensor(leaf)
      return super().t2j_iso(torchtensors)

    def get_and_rotate_prng_key(self, generator=None):
      if next_key is None or generator is not None:
        return super().get_and_rotate_prng_key(generator)
      key = self.param.prng
      self.param.prng = next_key(key)
      return key

  return BridgeEnvironment


def current_key(env: Any) -> Any:
  """The PRNG key torchax draws from now (changes when code draws random numbers).

  Example:
    >>> from torch_xla_jaxbridge._core import tracing
    >>> current_key(tracing.environment()) is not None
    True
  """
  return env.param.prng


def register_higher_order_rule(operator: Any, rule: Callable) -> None:
  """Makes torch's higher-order `operator` (cond, while_loop) run `rule(mode, ...)` under
  torchax's dispatch mode. torch's `py_impl` is the registration torch's own modes use.

  Example:
    >>> callable(register_higher_order_rule)
    True
  """
  import torchax.tensor

  operator.py_impl(torchax.tensor.XLADispatchMode)(rule)


def wrap_dispatch(env: Any, wrapper: Callable) -> None:
  """Makes every op torchax converts in `env` go through `wrapper(dispatch, func, types, args,
  kwargs)`, where `dispatch` is torchax's own conversion. torchax's function mode, dispatch mode
  and tensor class all call `env.dispatch(...)` (tensor.py), so an attribute on the instance sees
  each op at both levels (torch functions such as `F.linear`, then aten ops). If torchax stops
  routing through it, autocast inside bridged code stops applying; `test_compat` checks it. Done
  once per environment. Public alternative: none (torchax's own autocast hook reads one global
  policy table and lacks torch_xla's list).

  Example:
    >>> import types
    >>> env = types.SimpleNamespace(dispatch=lambda func, types, args, kwargs: func(*args))
    >>> wrap_dispatch(env, lambda dispatch, func, *rest: -dispatch(func, *rest))
    >>> env.dispatch(abs, (), (-2,), None)
    -2
  """
  wrappers = env.__dict__.setdefault("_bridge_dispatch_wrappers", [])
  if wrapper in wrappers:
    return
  wrappers.append(wrapper)
  original = env.dispatch
  env.dispatch = lambda func, types, args=(), kwargs=None: wrapper(original, func, types, args,
                                                                    kwargs)


def operator_not_found() -> type[Exception]:
  """torchax's exception for an op it has no lowering for (raised by `env.dispatch`); the bridge
  catches it to run custom ops itself. If it moves, custom ops fall back to LazyTensor code.

  Example:
    >>> operator_not_found().__name__
    'OperatorNotFound'
  """
  import torchax.tensor

  return torchax.tensor.OperatorNotFound


def dispatch_mode(env: Any) -> Any:
  """A context that turns on torchax's dispatch mode of `env` (aten ops on torchax tensors become
  JAX) unless it is on already: inside its own handler torch turns it off, and a custom op's
  kernel called from there must still be traced. torchax itself enters `env._dispatch_mode` so
  for the ops it decomposes. If it is renamed, custom ops called below the aten level (from
  another op's kernel) fall back to LazyTensor code.

  Example:
    >>> from torch_xla_jaxbridge._core import tracing
    >>> with dispatch_mode(tracing.environment()):
    ...   pass
  """
  import contextlib

  from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

  mode = env._dispatch_mode
  return contextlib.nullcontext() if mode in _get_current_dispatch_mode_stack() else mode


def view_source(value: Any) -> Any:
  """The torchax tensor a torchax `View` (what indexing a tensor gives, `x[0]`) reads and writes
  through its chain of parents (`.parent`, private); None for anything else.

  Example:
    >>> import jax, torchax.tensor
    >>> from torch_xla_jaxbridge._core import tracing
    >>> with tracing.torch_code():
    ...   t = tracing.to_torchax(jax.numpy.zeros((2, 2)))
    ...   view_source(t[0]) is t, view_source(t) is None
    (True, True)
  """
  import torchax.view

  if not isinstance(value, torchax.view.View):
    return None
  while isinstance(value, torchax.view.View):
    value = value.parent
  return value


def view_reading_through(view: Any, fn: Callable) -> Any:
  """A view of the torchax `View` `view` whose reads are `fn` of `view`'s and whose writes go to
  `view` unchanged (a private `ViewInfo` subclass): `fn` = `jax.lax.stop_gradient` cuts what is
  read from it from JAX's gradients while in-place writes still reach the viewed tensor.

  Example:
    >>> import jax
    >>> from torch_xla_jaxbridge._core import tracing
    >>> with tracing.torch_code():
    ...   t = tracing.to_torchax(jax.numpy.zeros((2, 2)))
    ...   plus_one = view_reading_through(t[0], lambda a: a + 1)
    ...   _ = plus_one.add_(5.0)  # reads 1, writes 6 into t[0]
    ...   plus_one.jax().tolist(), t.jax().tolist()
    ([7.0, 7.0], [[6.0, 6.0], [0.0, 0.0]])
  """
  import torchax.view

  class ReadThrough(torchax.view.ViewInfo):
    def transform_tensor(self, jax_array: Any) -> Any:
      return fn(jax_array)

    def update_tensor(self, new_value: Any, jax_array: Any) -> Any:
      return new_value

    def calculate_output_shape(self, source: Any) -> list[int]:
      return list(source.shape)

  return torchax.view.View(view, ReadThrough(), view._env)


def write_into(target: Any, value: Any) -> None:
  """Writes the torchax tensor `value` into the torchax tensor or `View` `target`, in
  `target`'s dtype: through a view into the tensor it views (`View.update`, private), else by
  replacing `target`'s array (as torchax's own in-place ops do).

  Example:
    >>> import jax
    >>> from torch_xla_jaxbridge._core import tracing
    >>> with tracing.torch_code():
    ...   t = tracing.to_torchax(jax.numpy.zeros((2, 2)))
    ...   write_into(t[1], tracing.to_torchax(jax.numpy.ones(2)))
    ...   t.jax().tolist()
    [[0.0, 0.0], [1.0, 1.0]]
  """
  import torchax.view

  array = value.jax().astype(target.jax().dtype)
  if isinstance(target, torchax.view.View):
    target.update(array)
  else:
    set_array(target, array)


def view_type() -> type:
  """torchax's `View` class (`torchax.view`, not exported), what indexing a torchax tensor gives.

  Example:
    >>> view_type().__name__
    'View'
  """
  import torchax.view

  return torchax.view.View
