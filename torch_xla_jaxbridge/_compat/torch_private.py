"""torch's private entry points and attributes, one function each.

Each says why the package needs it, what breaks if it changes and the public alternative where
one exists; `test/test_compat.py` checks each directly.
"""
import functools
from typing import Any, Callable

import torch

CHECKPOINT_HOOK = "__dynamo_disable"


# --- torch's pytrees: the structures torch code returns that JAX's pytrees do not know -----------
# (Hugging Face `ModelOutput`s register there). Public alternative: `torch.utils.pytree` in newer
# torch.

def tree_flatten(tree: Any) -> tuple:
  """`(leaves, spec)` of `tree` by torch's pytrees.

  Example:
    >>> tree_flatten({"a": 1})[0]
    [1]
  """
  import torch.utils._pytree

  return torch.utils._pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
  """Undoes `tree_flatten`.

  Example:
    >>> tree_unflatten([2], tree_flatten({"a": 1})[1])
    {'a': 2}
  """
  import torch.utils._pytree

  return torch.utils._pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree: Any) -> list:
  """The leaves of `tree` by torch's pytrees.

  Example:
    >>> tree_leaves([1, (2, 3)])
    [1, 2, 3]
  """
  import torch.utils._pytree

  return torch.utils._pytree.tree_leaves(tree)


# --- nn.Module's own tables: read and written directly for speed ----------------------------------
# (walking `named_parameters()` each call was a large share of a bridged call's host time). Public
# alternative: `named_parameters(recurse=False)` and friends, read only.

def parameters_table(module: torch.nn.Module) -> dict:
  """The module's own parameter dict (`name -> Parameter or None`), the live one.

  Example:
    >>> sorted(parameters_table(torch.nn.Linear(2, 2)))
    ['bias', 'weight']
  """
  return module._parameters


def buffers_table(module: torch.nn.Module) -> dict:
  """The module's own buffer dict (`name -> Tensor or None`), the live one.

  Example:
    >>> sorted(buffers_table(torch.nn.BatchNorm1d(2)))
    ['num_batches_tracked', 'running_mean', 'running_var']
  """
  return module._buffers


def children_table(module: torch.nn.Module) -> dict:
  """The module's own submodule dict (`name -> Module or None`), the live one.

  Example:
    >>> list(children_table(torch.nn.Sequential(torch.nn.ReLU())))
    ['0']
  """
  return module._modules


def share_tables(wrapper: torch.nn.Module, module: torch.nn.Module) -> None:
  """Makes `wrapper` hold `module`'s own parameter, buffer and submodule dicts (the same objects),
  so both show the same state (`jb.BridgeModule`).

  Example:
    >>> wrapper, inner = torch.nn.Module(), torch.nn.Linear(2, 2)
    >>> share_tables(wrapper, inner); sorted(dict(wrapper.named_parameters()))
    ['bias', 'weight']
  """
  wrapper._parameters = module._parameters
  wrapper._buffers = module._buffers
  wrapper._non_persistent_buffers_set = module._non_persistent_buffers_set
  wrapper._modules = module._modules


def reparametrized(module: torch.nn.Module, tensors: dict) -> Any:
  """Context: `module` (and its submodules) read the given tensors by full name in place of their
  own parameters and buffers, as `torch.func.functional_call` arranges before it calls the
  module. Used to run a module's class `forward` directly (its hooks run once, outside the
  bridged call, when the module's own `forward` is the bridge's). Public alternative:
  `torch.func.functional_call`, which calls `module(...)`: its hooks and its instance `forward`.

  Example:
    >>> lin = torch.nn.Linear(1, 1)
    >>> with reparametrized(lin, {"weight": torch.ones(1, 1), "bias": torch.zeros(1)}):
    ...   lin.weight.tolist()
    [[1.0]]
  """
  from torch.nn.utils import stateless

  return stateless._reparametrize_module(module, tensors, tie_weights=False)


# --- nn.Module's hooks: a module holding one runs outside bridged code, so they run per call ------
# (a trace would run them once). Public alternative: none; `register_*_hook` only adds them. If
# these names change, `test_compat` fails here.

HOOK_KINDS = ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook")


def hook_tables(module: torch.nn.Module) -> tuple[dict, dict, dict, dict]:
  """The module's own hook dicts, the live ones, in `HOOK_KINDS` order (a full or old-style
  backward hook is a backward hook; a `with_kwargs` or `always_call` hook is in its kind's dict).

  Example:
    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_hook(lambda m, i, o: None)
    >>> [len(table) for table in hook_tables(lin)]
    [0, 1, 0, 0]
  """
  return (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
          module._backward_hooks)


def has_hooks(module: torch.nn.Module) -> bool:
  """Whether any of the module's own hook dicts (`hook_tables`) holds a hook: their reads, fast
  (one per bridged submodule and call).

  Example:
    >>> has_hooks(torch.nn.Linear(1, 1))
    False
  """
  return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
              or module._backward_hooks)


def global_hook_tables() -> tuple[dict, dict, dict, dict]:
  """The hook dicts of every module (`torch.nn.modules.module.register_module_forward_hook` and
  friends), the live ones, in `HOOK_KINDS` order.

  Example:
    >>> [len(table) for table in global_hook_tables()]
    [0, 0, 0, 0]
  """
  from torch.nn.modules import module

  return (module._global_forward_pre_hooks, module._global_forward_hooks,
          module._global_backward_pre_hooks, module._global_backward_hooks)


# --- torch.utils.checkpoint -----------------------------------------------------------------------

@functools.cache
def torch_checkpoint_target() -> Callable:
  """The function inside torch's `torch.utils.checkpoint.checkpoint` wrapper. The wrapper calls
  the function stored as its `__dynamo_disable` attribute (a cache torch fills on first use), so
  setting that attribute reroutes every reference to `checkpoint`, however it was imported. If
  torch changes this, `torch.utils.checkpoint` inside bridged code runs without recomputation
  (still correct); `test_compat` checks the wrapper reads the attribute.

  Example:
    >>> torch_checkpoint_target().__name__
    'checkpoint'
  """
  import torch.utils.checkpoint

  return torch.utils.checkpoint.checkpoint.__wrapped__  # type: ignore[attr-defined]  # stubs


def dynamo_disabled(fn: Callable) -> Callable:
  """What torch's wrapper stores in the hook when nobody else does.

  Example:
    >>> callable(dynamo_disabled(print))
    True
  """
  import torch._dynamo

  return torch._dynamo.disable(fn, recursive=True, wrapping=False)


# --- torch.compile --------------------------------------------------------------------------------

def register_compile_backend(fn: Callable, name: str) -> None:
  """Registers a torch.compile backend under `name` unless one is (the documented way is this
  private module's `register_backend`).

  Example:
    >>> "jaxbridge" in torch.compiler.list_backends()  # registered when the package is imported
    True
  """
  import torch._dynamo

  if name not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(fn, name=name)


def higher_order_operators() -> dict:
  """torch's higher-order control-flow operators by name: `{"cond": ..., "while_loop": ...}`.

  Example:
    >>> sorted(higher_order_operators())
    ['cond', 'while_loop']
  """
  from torch._higher_order_ops.cond import cond_op
  from torch._higher_order_ops.while_loop import while_loop_op

  return {"cond": cond_op, "while_loop": while_loop_op}


# --- autocast and autograd ------------------------------------------------------------------------

def autocast_registrations(dispatch_key: str) -> set:
  """The ops with a kernel for an autocast dispatch key (`"AutocastXLA"`, `"AutocastCPU"`), as
  `"aten::name.overload"` strings. torch has no public way to read its autocast op lists; the
  bridge's own policy table (`autocast.XLA_POLICY`) is checked against this in the tests, so a
  torch_xla release that adds or drops an autocast op fails there instead of silently differing.

  Example:
    >>> "aten::matmul" in autocast_registrations("AutocastXLA")
    True
  """
  return set(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


def is_saved_tensor_modified_error(exc: BaseException) -> bool:
  """Whether `exc` is autograd's report that a tensor saved for backward was changed in place (a
  RuntimeError identified by its message; torch has no class for it). If torch rewords it, its
  own RuntimeError reaches the user instead of the package's MutationError: still an error.

  Example:
    >>> is_saved_tensor_modified_error(RuntimeError("x"))
    False
  """
  return "inplace operation" in str(exc)


def functorch_transforms_active() -> bool:
  """Whether a `torch.func` transform (`torch.vmap`, as Hugging Face's mask builders use) is
  running: an autograd Function then goes through torch's own functorch rules, not the bridge's.
  Public alternative: none.

  Example:
    >>> functorch_transforms_active(), torch.vmap(lambda x: torch.tensor(
    ...     functorch_transforms_active()))(torch.ones(1)).item()
    (False, True)
  """
  return torch._C._are_functorch_transforms_active()


_DYNAMO_COMPILING = torch.compiler.is_compiling  # torch's own: the package answers True while
# it traces (`_integrations.trace_signals`), and Dynamo folds a call of this one to True


def dynamo_compiling() -> bool:
  """Whether Dynamo (`torch.compile`) is tracing the calling code: torch's own answer (the
  package answers `torch.compiler.is_compiling()` True inside its traces). Public alternative:
  `torch.compiler.is_compiling()` where the package does not patch it.

  Example:
    >>> dynamo_compiling()
    False
  """
  return _DYNAMO_COMPILING()


def torch_tracer_active() -> bool:
  """Whether torch code is being traced by torch's own machinery in this thread: Dynamo
  (`torch.compile` with another backend than the package's), a fake-tensor, functionalization or
  proxy (`make_fx`) dispatch mode, or a `torch.func` transform, as AOTAutograd sets up
  (torch_xla's `scan` and `scan_layers` trace their body with it). Bridged code called there runs
  as plain torch code. Public alternative: none.

  Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...   inside = torch_tracer_active()
    >>> torch_tracer_active(), inside
    (False, True)
  """
  if _DYNAMO_COMPILING():
    return True
  mode = torch._C._get_dispatch_mode
  keys = torch._C._TorchDispatchModeKey
  return (torch._C._are_functorch_transforms_active() or mode(keys.FAKE) is not None
          or mode(keys.FUNCTIONAL) is not None or mode(keys.PROXY) is not None)


def tensor_version(tensor: torch.Tensor) -> int:
  """A tensor's version counter: it changes with every in-place update of its data. Public
  alternative: none (`torch.Tensor._version`).

  Example:
    >>> t = torch.zeros(1)
    >>> before = tensor_version(t)
    >>> _ = t.add_(1)
    >>> tensor_version(t) > before
    True
  """
  return tensor._version

