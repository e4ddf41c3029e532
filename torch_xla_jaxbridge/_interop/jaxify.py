"""`jaxify`: torch code as a pure JAX function, so `jax.grad`, `jax.jit` and `jax.vmap` apply."""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import modules, rng, runtime, tracing


def jaxify(fn_or_module: torch.nn.Module | Callable) -> tuple[Callable, dict[str, Any]]:
  """Converts a torch module or function into `(jax_fn, params)`.

  For a module, `params` is a dict of its parameters and buffers as `jax.Array`s (by name) and
  `jax_fn(params, *args, **kwargs)` runs its forward on JAX arrays. For a function, `params` is
  an empty dict and `jax_fn(params, *args, **kwargs)` calls it. Tensors in the outputs come back
  as JAX arrays. The function is pure: pass `key=` (a `jax.random` key) to drive dropout and
  `torch.rand*` (without one, every call uses `jax.random.key(0)`); a forward that updates buffers (BatchNorm in train mode) is refused rather than
  losing the update (call `module.eval()` first).

  Example:
    >>> import jax, jax.numpy as jnp, torch, torch_xla_jaxbridge as jb
    >>> fn, params = jb.jaxify(torch.nn.Linear(3, 2))
    >>> grads = jax.grad(lambda p, x: fn(p, x).sum())(params, jnp.ones((4, 3)))
    >>> sorted(grads)
    ['bias', 'weight']
  """
  jax = runtime.jax_module()
  if isinstance(fn_or_module, torch.nn.Module):
    module = fn_or_module
    weights, buffers, _ = modules.module_state(module)
    params = {k: jax.numpy.asarray(v.detach().cpu().numpy())
              for k, v in {**weights, **buffers}.items()}

    def call(p, *args, **kwargs):
      state = ({k: p[k] for k in weights}, {k: p[k] for k in buffers})
      return torch.func.functional_call(module, state, args, kwargs, tie_weights=False)

    name = type(module).__name__
  elif callable(fn_or_module):
    params, name = {}, getattr(fn_or_module, "__name__", "function")
    call = lambda p, *args, **kwargs: fn_or_module(*args, **kwargs)  # noqa: E731
  else:
    raise errors.BadArgumentError(
        f"jaxify: expected a torch.nn.Module or a function, got {type(fn_or_module).__name__}.")

  def jax_fn(params, *args, key=None, **kwargs):
    key = jax.random.key(0) if key is None else key  # pure: no key, the same randomness each call
    outputs, mutated, _ = tracing.run_torch(call, rng.data_from_key(jax, key), (params,) + args,
                                            kwargs, fn_name=name)
    if mutated:
      raise errors.MutationError(
          f"jaxify({name}): the forward updated its buffers or arguments in place (e.g. "
          f"BatchNorm running statistics in train mode); a pure JAX function cannot keep that. "
          f"Call .eval() first, or bridge the module with jb.BridgeModule, which writes updates "
          f"back.")
    return outputs

  return jax_fn, params
