"""Modules bridged one by one: by class (`bridge_modules`), or inside a region that fell back.

A `ModuleBridge` runs one module's forward bridged (one trace shared by structurally identical
modules). When the module cannot be bridged it records why (`fallback.Outcome`) and runs the
module's own forward as plain LazyTensor code, with each of its submodules that holds parameters
bridged in turn while it runs: the fallback is as narrow as the code that needs it, the way
torch.compile breaks a graph and goes on. A call that finds a hook on a submodule (`_core.hooks`)
runs so too, that call only, so that the hook runs around its own module's call every time.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterable, Iterator, Literal

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import (cache_slots, captures, fallback, hf_checkpointing,
                                         layer_slots, rollback)
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import Bridged, _any_traced, off_xla, one_tensor
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import attribute_reads, hooks, modules, settings_key, structure_keys

# (structure key, remat, hooks) -> Bridged of identical modules; each of their ModuleBridges holds
# it, so it (with its traces) lives as long as one of them does
_SHARED: weakref.WeakValueDictionary[tuple, Bridged[SharedForward]] = (
    weakref.WeakValueDictionary())
_BRIDGES: weakref.WeakKeyDictionary[torch.nn.Module, ModuleBridge] = (
    weakref.WeakKeyDictionary())  # module -> its ModuleBridge (which holds it weakly)


class SharedForward(modules.Calling):
  """The forward of whichever module of one structure is being called (named by `run_for`):
  what the `Bridged` shared by structurally identical modules runs, holding none of them.
  `reads`: the plain attributes its traces read, the only ones its calls are keyed by;
  `slot_reads`: those of calls passed their own cache slot (`layer_slots`), the slot index aside.

  Example:
    >>> layer, forward = torch.nn.Linear(2, 2), SharedForward(hooks=True)
    >>> params, buffers, training = modules.module_state(layer)
    >>> settings = modules.StateWalk(layer).settings(forward.reads)
    >>> forward.run_for(layer, forward, params, buffers, training, settings, (torch.ones(2),),
    ...                 {}).shape
    torch.Size([2])
  """
  __slots__ = ("hooks", "reads", "slot_reads")

  def __init__(self, hooks: bool) -> None:
    super().__init__()
    self.hooks = hooks
    self.reads = settings_key.ReadSettings()
    self.slot_reads = settings_key.ReadSettings()

  def __call__(self, params: dict, buffers: dict, training: tuple, settings: settings_key.Settings,
               args: tuple, kwargs: dict) -> Any:
    # the settings are read by the forward from the module itself; in the call for its cache key
    module = self.module()
    with attribute_reads.attribute_reads(module) as reads:
      out = modules.module_forward(module, params, buffers, training, args, kwargs,
                                   hooks=self.hooks)
    if settings.reads is self.slot_reads:  # its slot index addressed only its own slot
      if cache_slots.violated():  # it reached another slot and caught the error: not traced
        raise cache_slots.OtherSlotTouched(f"{type(module).__name__} read another cache slot")
      found = layer_slots.slot_index(module)
      self.slot_reads.add(reads - found[1] if found is not None else reads)
    else:
      self.reads.add(reads)
    return out


def shared_bridged(module: torch.nn.Module, remat: remat_policies.RematArg,
                   hooks: bool = True) -> Bridged[SharedForward]:
  """The bridged forward of `module`, shared with every structurally identical module (same
  classes, shapes and attribute values; plain numbers and strings by type: a call compares those
  its traces read, so Hugging Face layers differing in an unread `layer_idx` share one trace)
  bridged under the same remat policy, and kept while a caller holds it; its function is a
  `SharedForward`, so call it as `bridged.fn.run_for(module, bridged, ...)`. With `hooks` the module's hooks run inside the bridged code (`BridgeModule`,
  whose own hooks run outside); without, its class forward runs directly (a module whose
  `forward` is the bridge's: its hooks run around the bridged call).

  Example:
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> shared_bridged(a, None) is shared_bridged(b, None)
    True
  """
  key = structure_keys.structure_key(module, settings_by_value=False)
  found = _SHARED.get((key, remat, hooks)) if key is not None else None
  if found is None:
    found = Bridged(SharedForward(hooks), remat=remat, name=type(module).__name__, lift=False)
    if key is not None:
      _SHARED[(key, remat, hooks)] = found
  return found


@dataclasses.dataclass(frozen=True)
class Settings:
  """How a module is bridged: its name in the report, its remat policy, whether it may fall
  back to plain LazyTensor code."""
  name: str
  remat: Any = None
  fallback: bool = True
  hooks: bool = False  # the module's hooks run inside the bridged code (`BridgeModule`)
  # bridged by a fallback around it: called inside bridged code, it is traced in line there, as
  # it would be without the bridge (a module bridged by the user is its own region there too)
  in_line_when_traced: bool = False


class ModuleBridge:
  """One module's forward, bridged or (when that fails) plain with its submodules bridged.

  Example:
    >>> layer = torch.nn.Linear(2, 2).to("xla")
    >>> ModuleBridge(layer, Settings("layer"))(torch.ones(1, 2, device="xla")).shape
    torch.Size([1, 2])
  """

  def __init__(self, module: torch.nn.Module, settings: Settings) -> None:
    self.module = weakref.ref(module)
    self.settings = settings
    self.state = modules.StateWalk(module)
    self.bridged = bridged = shared_bridged(module, settings.remat, settings.hooks)
    # under Hugging Face gradient checkpointing, made when first used
    self.checkpointed: Bridged[SharedForward] | None = None
    # the bridged functions whose traces the report counts; no reference back to self: a bridge
    # whose module is gone is freed at once (it is held by `_BRIDGES` only, so no cycle may
    # hold it)
    self.traced = traced = [bridged]
    self.slots = layer_slots.SlotSharing(module)
    self.outcome = fallback.Outcome(settings.name, "module",
                                    lambda: sum(b.traces for b in traced))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.call(args, kwargs, hf_checkpointing.requested(self._module()))

  def call(self, args: tuple, kwargs: dict, checkpointed: bool) -> Any:
    """The forward on `args`, `kwargs`; `checkpointed`: under Hugging Face gradient
    checkpointing (the bridged call recomputes the module: `hf_checkpointing.remat_for`).

    Example:
      >>> layer = torch.nn.Linear(2, 2).to("xla")
      >>> bridge = ModuleBridge(layer, Settings("layer"))
      >>> bridge.call((torch.ones(1, 2, device="xla"),), {}, checkpointed=True).shape
      torch.Size([1, 2])
    """
    module = self._module()
    if off_xla((args, kwargs), one_tensor(self.state)):  # on the CPU: its own forward, plain
      if self.settings.hooks:  # (a BridgeModule's: with the module's hooks)
        return module(*args, **kwargs)
      return type(module).forward(module, *args, **kwargs)
    if not self.outcome.fell_back:
      params, buffers, training = self.state.state()
      hooked = hooks.hooked(self.state, self.settings.name, itself=self.settings.hooks)
      if hooked is None or _any_traced((args, kwargs)):  # traced: the enclosing trace's hooks
        bridged = self._bridged(module, checkpointed)
        settings = self.state.settings(bridged.fn.reads)
        passed, index = (args, kwargs), None
        if (hooked is None and layer_slots.has_cache(args, kwargs)
            and not _any_traced(passed)):  # with a cache: its own slot of it
          slotted = self.slots.prepare(params, buffers, training, args, kwargs,
                                       (settings.values, settings.host), self.settings.hooks)
          if slotted is not None:
            passed, index = slotted[:2], slotted[2]
            settings = self.state.settings(bridged.fn.slot_reads)
        with cache_slots.addressing(index):
          ran, outputs = rollback.attempt(
              lambda: bridged.fn.run_for(module, bridged, params, buffers, training, settings,
                                         *passed),
              lambda: ([module], []), lambda e: self._fall_back(e, (args, kwargs)))
        if ran:
          self.outcome.bridged_again()
          return outputs
      else:
        self.outcome.fall_back(hook_error(hooked, self.settings.name), self.settings.fallback)
    with self.outcome.plain_run(), submodules_bridged(module, self.settings):
      if self.settings.hooks:  # the module's own hooks too (`BridgeModule`)
        return module(*args, **kwargs)
      return type(module).forward(module, *args, **kwargs)

  def _module(self) -> torch.nn.Module:
    module = self.module()
    assert module is not None, "a module's bridge is called through the module"
    return module

  def _fall_back(self, exc: BaseException, arguments: tuple) -> None:
    if _any_traced(arguments):  # inside bridged code: errors belong to the caller
      raise exc
    self.outcome.fall_back(exc, self.settings.fallback)

  def _bridged(self, module: torch.nn.Module, checkpointed: bool) -> Bridged[SharedForward]:
    remat = hf_checkpointing.remat_for(self.settings.remat, checkpointed)
    if remat == self.settings.remat:
      return self.bridged
    if self.checkpointed is None:
      self.checkpointed = shared_bridged(module, remat, self.settings.hooks)
      self.traced.append(self.checkpointed)
    return self.checkpointed


def hook_error(hooked: str, name: str) -> errors.HookError:
  """The passing fallback of a region whose modules hold hooks (`hooks.hooked`).

  Example:
    >>> str(hook_error("`Block.fc` holds a forward hook", "Block")).split(";")[0]
    '`Block.fc` holds a forward hook'
  """
  return errors.HookError(
      f"{hooked}; hooks run at every call, so while it does, `{name}` runs as plain LazyTensor "
      f"code with the hooked modules outside the bridged calls (a trace would run a hook once).")


def bridge_of(module: torch.nn.Module, settings: Settings) -> ModuleBridge:
  """The module's `ModuleBridge`, made once."""
  found = _BRIDGES.get(module)
  if found is None or found.settings != settings:
    found = _BRIDGES[module] = ModuleBridge(module, settings)
  return found


def bridged_forward(module: torch.nn.Module, settings: Settings, *args: Any,
                    **kwargs: Any) -> Any:
  """What `module.forward` is while the module is bridged (a `functools.partial` of this, which
  copies and pickles with the module).

  Example:
    >>> layer = torch.nn.Linear(2, 2).to("xla")
    >>> bridged_forward(layer, Settings("layer"), torch.ones(1, 2, device="xla")).shape
    torch.Size([1, 2])
  """
  if torch_private.torch_tracer_active():  # traced by torch (torch_xla's scan): plain code
    if not torch_private.dynamo_compiling():  # Dynamo would trace the note into its graph
      fallback.traced_by_torch(bridge_of(module, settings).outcome)
    return type(module).forward(module, *args, **kwargs)
  if settings.in_line_when_traced and _any_traced((args, kwargs)):
    return type(module).forward(module, *args, **kwargs)
  return bridge_of(module, settings)(*args, **kwargs)


def _is_container(module: torch.nn.Module) -> bool:
  """A module that is never called itself (`ModuleList`, `ModuleDict`): its children are."""
  return type(module).forward is torch.nn.Module.forward


def _has_parameters(module: torch.nn.Module) -> bool:
  return next(module.parameters(), None) is not None


def _bridgeable(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
  """`(path, module)` of the submodules to bridge one by one: each descendant holding
  parameters, looking through containers. Descendants too, not only children: a forward may call
  a grandchild directly (`self.model.decoder(...)`), passing over its parent."""
  for name, child in module.named_children():
    path = f"{prefix}.{name}" if prefix else name
    if child is None or not _has_parameters(child) or "forward" in vars(child):
      continue  # nothing to gain, or already bridged (or a forward of its own set on it)
    if not _is_container(child):
      yield path, child
    yield from _bridgeable(child, path)


class bridged_while:  # noqa: N801  (a context manager, used as a function)
  """Inside the block, each `(module, settings)` of `pairs` runs bridged (its `forward` is
  `bridged_forward`); after it, each module's own forward again.

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> with bridged_while([(layer, Settings("layer"))]):
    ...   "forward" in vars(layer)
    True
    >>> "forward" in vars(layer)
    False
  """

  def __init__(self, pairs: list[tuple[torch.nn.Module, Settings]]) -> None:
    self.pairs = pairs

  def __enter__(self) -> bridged_while:
    for module, settings in self.pairs:
      module.forward = modules.BridgedForward(bridged_forward, module, settings)
      hf_checkpointing.take_over(module)
    return self

  def __exit__(self, *exc: object) -> Literal[False]:
    for module, _ in self.pairs:
      vars(module).pop("forward", None)
      hf_checkpointing.give_back(module)
    return False


def submodules_bridged(module: torch.nn.Module, settings: Settings) -> bridged_while:
  """While `module`'s own forward runs as plain code: its submodules with parameters bridged.

  Example:
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with submodules_bridged(net, Settings("net")):
    ...   "forward" in vars(net[0])
    True
  """
  return bridged_while([(child, dataclasses.replace(settings, name=f"{settings.name}.{path}",
                                                    hooks=False, in_line_when_traced=True))
                        for path, child in _bridgeable(module, "")])


def captured_bridged(fn: Any, settings: Settings) -> bridged_while:
  """While `fn` runs as plain code: the modules it reads from its closure, its globals or `self`
  bridged (each falling back to its own submodules where it must).

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> with captured_bridged(lambda x: layer(x), Settings("f")):
    ...   "forward" in vars(layer)
    True
  """
  lifted = captures.collect(fn, settings.name, xla=False)
  found = [(name, captures.read_capture(fn, where)) for where, name, kind, *_ in
           (lifted.layout if lifted else ()) if kind == "module"]
  return bridged_while([(module, dataclasses.replace(settings, name=f"{settings.name}.{name}",
                                                     hooks=False))
                        for name, module in found
                        if _has_parameters(module) and "forward" not in vars(module)])


def bridge_modules(model: torch.nn.Module, classes: Iterable[str | type] | str | type, *,
                   remat: remat_policies.RematArg = None, fallback: bool = True,
                   ) -> list[str]:
  """Bridges every submodule of `model` (itself included) whose class is one of `classes`
  (classes, or class names such as `"LlamaDecoderLayer"`), in place: each one's forward becomes
  one graph node (structurally identical ones share one trace), while `model` stays the same
  module (its parameters, `state_dict()`, hooks). A module that cannot be bridged runs as plain
  LazyTensor code with its own submodules bridged (`fallback=False`: raise instead); on the CPU
  (`model.to("cpu")`), its own forward runs, and back on XLA it is bridged again. Returns the
  paths of the modules bridged (bridged before too: called again, it applies the new `remat`
  and `fallback`). Like torchprime's `model.pure_modules`. With the optimizer
  from `jb.optim` (same arguments as torch's), its step is one node too: most of the gain left
  to `jb.train_step` (docs/performance.md, "Time to first step against depth"). One class or
  class name alone is as if in a list.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> jb.bridge_modules(net.to("xla"), ["Linear"])
    ['0', '2']
  """
  if not isinstance(model, torch.nn.Module):
    raise errors.BadArgumentError(
        f"bridge_modules: model is a {type(model).__name__}; it takes a torch.nn.Module, whose "
        f"submodules of the given classes it bridges in place, e.g. `jb.bridge_modules(model, "
        f"['LlamaDecoderLayer'])`. For a function, use `jb.bridge(fn)`.")
  if isinstance(classes, (str, type)) or not isinstance(classes, Iterable):
    classes = [classes]  # one class or name alone: as if in a list (anything else: named below)
  wanted = list(classes)
  bad = [c for c in wanted if not isinstance(c, (str, type))]
  if bad:
    raise errors.BadArgumentError(
        f"bridge_modules: classes holds {bad!r}; give module classes or their names, e.g. "
        f"['LlamaDecoderLayer'].")
  names = {c if isinstance(c, str) else c.__name__ for c in wanted}
  remat_policies.policy_for(remat)  # validates `remat`
  found, layers = [], []
  for path, module in model.named_modules():
    own = vars(module).get("forward")  # a forward set on the module itself, not its class's
    if type(module).__name__ in names and (own is None or
                                           isinstance(own, modules.BridgedForward)):
      settings = Settings(path or type(module).__name__, remat, fallback)
      module.forward = modules.BridgedForward(bridged_forward, module, settings)
      found.append(path)
      if own is None and hf_checkpointing.is_checkpointing_layer(module):
        hf_checkpointing.take_over(module)
        layers.append(module)
  if layers:  # `gradient_checkpointing_enable()` may come later
    model.register_forward_pre_hook(hf_checkpointing.Reclaim(layers))
  if not found:
    present = sorted({type(m).__name__ for m in model.modules()})
    raise errors.BadArgumentError(
        f"bridge_modules: no submodule of {type(model).__name__} is a {sorted(names)}; its "
        f"classes are {present}.")
  return found
