"""Hugging Face gradient checkpointing (`model.gradient_checkpointing_enable()`) of bridged layers.

With it on, transformers' `GradientCheckpointingLayer.__call__` runs the layer through
`self._gradient_checkpointing_func`, torch's checkpoint, before the layer's forward (and so the
bridge) is reached; torch's checkpoint cannot run on XLA tensors. A layer the bridge runs gets a
`Direct` function instead, which calls the layer as it is, and its bridged call recomputes under
the remat policy "full" when it has none of its own (`remat_for`): only the layer's inputs are
kept for the backward, as with torch's checkpoint.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch

from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import _any_traced
from torch_xla_jaxbridge._core import modules

FUNCTION = "_gradient_checkpointing_func"  # the attribute transformers calls the layer through
# id(torch's function) -> its Direct, shared
_DIRECT: weakref.WeakValueDictionary[int, Direct] = weakref.WeakValueDictionary()


def is_checkpointing_layer(module: torch.nn.Module) -> bool:
  """Whether `module` is a transformers `GradientCheckpointingLayer` (a decoder layer).

  Example:
    >>> is_checkpointing_layer(torch.nn.Linear(2, 2))
    False
  """
  layers = sys.modules.get("transformers.modeling_layers")  # not loaded: no such layer exists
  return layers is not None and isinstance(module, layers.GradientCheckpointingLayer)


def requested(module: torch.nn.Module, flags: torch.nn.Module | None = None) -> bool:
  """Whether gradient checkpointing is on for the layer `module`: transformers' test
  (`gradient_checkpointing` and `training`), read on `flags` (a `BridgeModule` around the layer,
  on which `gradient_checkpointing_enable()` sets them) or on the layer.

  Example:
    >>> requested(torch.nn.Linear(2, 2))
    False
  """
  flags = module if flags is None else flags
  return (is_checkpointing_layer(module) and getattr(flags, "gradient_checkpointing", False) is True
          and flags.training)


def remat_for(remat: remat_policies.RematArg, checkpointed: bool) -> remat_policies.RematArg:
  """The remat policy of a bridged call of a layer: "full" for a checkpointed layer bridged
  without one, else its own.

  Example:
    >>> remat_for(None, True), remat_for("minimal", True), remat_for(None, False)
    ('full', 'minimal', None)
  """
  return "full" if checkpointed and remat is None else remat


class Direct:
  """A bridged layer's `_gradient_checkpointing_func`: the layer's call run as it is, since its
  bridged call recomputes it; a call of a layer the bridge does not run (no longer bridged)
  goes to the function it replaced (torch's checkpoint). One per replaced function, shared by
  the layers, so structurally identical layers still share one trace.

  Example:
    >>> torch_checkpoint = lambda function, *args, **kwargs: "torch's checkpoint"
    >>> Direct(torch_checkpoint)(len, [1])  # not a layer's call: the replaced function gets it
    "torch's checkpoint"
  """

  def __init__(self, original: Callable) -> None:
    self.original = original

  def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
    layer = _layer_of(function)
    if layer is not None and (isinstance(vars(layer).get("forward"), modules.BridgedForward) or
                              _any_traced(args)):  # bridged by class, or inside bridged code
      return function(*args)
    return self.original(function, *args, **kwargs)


def _layer_of(function: Any) -> torch.nn.Module | None:
  """The module whose call `function` is: transformers passes `partial(layer.__call__, **kw)`."""
  while hasattr(function, "func"):
    function = function.func
  owner = getattr(function, "__self__", None)
  return owner if isinstance(owner, torch.nn.Module) else None


def take_over(layer: torch.nn.Module) -> None:
  """Gives `layer` (a transformers checkpointing layer the bridge runs) the `Direct` function
  over the one `gradient_checkpointing_enable()` set, if any.

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> layer._gradient_checkpointing_func = print
    >>> take_over(layer)
    >>> layer._gradient_checkpointing_func.original is print
    True
  """
  found = vars(layer).get(FUNCTION)
  if found is not None and not isinstance(found, Direct):
    direct = _DIRECT.get(id(found))
    if direct is None or direct.original is not found:
      direct = _DIRECT[id(found)] = Direct(found)
    setattr(layer, FUNCTION, direct)


def give_back(layer: torch.nn.Module) -> None:
  """Undoes `take_over` (the layer is no longer run by the bridge).

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> layer._gradient_checkpointing_func = print
    >>> take_over(layer); give_back(layer)
    >>> layer._gradient_checkpointing_func is print
    True
  """
  found = vars(layer).get(FUNCTION)
  if isinstance(found, Direct):
    setattr(layer, FUNCTION, found.original)


class Reclaim:
  """A forward pre-hook of the model given to `bridge_modules`: `gradient_checkpointing_enable()`
  called after bridging sets torch's checkpoint on the layers again; before the model runs (and
  calls them) the bridged layers take `Direct` back.

  Example:
    >>> layer = torch.nn.Linear(2, 2)
    >>> layer._gradient_checkpointing_func = print
    >>> Reclaim([layer])(layer, ())
    >>> isinstance(layer._gradient_checkpointing_func, Direct)
    True
  """
  traceable = True  # sets flags before the model runs: it may run in a trace (`_core.hooks`)

  def __init__(self, layers: list[torch.nn.Module]) -> None:
    self.layers = layers

  def __call__(self, model: torch.nn.Module, args: tuple) -> None:
    for layer in self.layers:
      take_over(layer)
