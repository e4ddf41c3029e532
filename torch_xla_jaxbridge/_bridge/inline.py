"""A bridged function called inside bridged code: run in the enclosing trace, no node of its own.

Under its own remat policy the function runs in `jax.checkpoint` (its backward, when the enclosing
trace is differentiated, in a conditional XLA cannot fold into the forward); in-place updates of
its arguments and its randomness follow the enclosing code's.
"""
from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING, Any

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import torchax_private
from torch_xla_jaxbridge._core import call, grad_reads, recompute, rng, runtime, tracing
from torch_xla_jaxbridge._core.runtime import PyTree

if TYPE_CHECKING:
  import jax as jax_types

  from torch_xla_jaxbridge._bridge.bridging import Bridged


def run_inline(bridged: Bridged, args: tuple, kwargs: dict,
               seed: int | torch.Tensor | None = None) -> PyTree:
  """The torch function run directly in the enclosing trace (called inside bridged code), in
  `jax.checkpoint` with this function's remat policy when it has one; `seed` (rng_seed) fixes
  its randomness.

  Example:
    >>> from torch_xla_jaxbridge._bridge.bridging import Bridged
    >>> inner = Bridged(lambda x: x * 2, remat="full")
    >>> Bridged(lambda x: inner(x) + 1)(torch.ones(2, device="xla")).cpu().tolist()
    [3.0, 3.0]
  """
  jax = runtime.jax_module()
  with_path, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
  for path, leaf in with_path:
    if isinstance(leaf, torch.Tensor) and not tracing.is_traced(leaf):
      raise errors.CapturedTensorError(
          f"{bridged.name}: {call.path_name(path)} is a tensor on {leaf.device} from outside the "
          f"bridged code that calls {bridged.name} (shape {tuple(leaf.shape)}); inside bridged "
          f"code every tensor must come from its arguments. Pass it (or the modules holding it) "
          f"to the enclosing bridged function as an argument, or read it from a variable that "
          f"function closes over (or an object, dict or list held there).")
  env = tracing.environment()
  key = None if seed is None else _key_from_seed(jax, seed)
  if bridged.policy is None:
    with env.override_property(prng=key) if key is not None else contextlib.nullcontext():
      return bridged.fn(*args, **kwargs)
  tensors, rebuild = tracing.traced_arrays((args, kwargs))
  outer_key = torchax_private.current_key(env)
  # learnt while `run` is traced: which arguments changed, whether it drew
  found: dict[str, Any] = {}

  def run(*arrays: jax_types.Array) -> tuple[PyTree, list]:
    (inner_args, inner_kwargs), wrapped = rebuild(arrays)
    start = key if key is not None else jax.random.fold_in(outer_key, 0x6a62)
    with env.override_property(prng=start):
      outputs = bridged.fn(*inner_args, **inner_kwargs)
      found["drew"] = torchax_private.current_key(env) is not start
    found["mutated"] = [i for i, (w, a) in enumerate(zip(wrapped, arrays)) if w.jax() is not a]
    return tracing.to_jax(outputs), [wrapped[i].jax() for i in found["mutated"]]

  checkpointed = jax.checkpoint(run, policy=bridged.policy)
  if recompute.is_differentiated():  # its backward: in a conditional, as a node's
    checkpointed = recompute.sequenced(checkpointed)
  outputs, mutated = checkpointed(*[t.jax() for t in tensors])
  for i, value in zip(found["mutated"], tracing.to_torchax(mutated)):
    tensors[i].copy_(value)
  if found["drew"] and key is None:
    env.get_and_rotate_prng_key()  # later draws of the enclosing code differ from these
  return grad_reads.like(tracing.to_torchax(outputs), tensors)


def _key_from_seed(jax: types.ModuleType, seed: int | torch.Tensor) -> jax_types.Array:
  """The key `rng.key_data(seed)` would give, for an int or a traced integer tensor."""
  if isinstance(seed, int):
    data = jax.numpy.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], jax.numpy.uint32)
  else:
    s = tracing.to_jax(seed).reshape(())
    high = s >> 32 if s.dtype.itemsize == 8 else s >> 31  # the sign's bits for a 32-bit seed
    data = jax.numpy.stack([high.astype(jax.numpy.uint32), s.astype(jax.numpy.uint32)])
  return rng.key_from_data(jax, jax.lax.bitcast_convert_type(data, jax.numpy.int32))
