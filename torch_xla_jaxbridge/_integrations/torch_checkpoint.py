"""`torch.utils.checkpoint.checkpoint` inside bridged code: `jax.checkpoint` of the function.

Within traced code `torch.utils.checkpoint.checkpoint(fn, *args)` recomputes `fn` in the backward
through `jax.checkpoint`: every reference to torch's `checkpoint`, however it was imported, goes
through the wrapper torch puts around it, which calls the function held in a hook attribute
(`torch_private.torch_checkpoint_target`). Other threads, and calls outside a trace, get torch's
own checkpoint. torch_xla's `torch_xla.utils.checkpoint.checkpoint` (and FSDP's
`checkpoint_module`, which calls it) does the same inside a trace, through a rule for its
autograd Function.
"""
from torch_xla_jaxbridge._compat import torch_private, torchax_private
from torch_xla_jaxbridge._core import grad_reads, patching, recompute, runtime, tracing
from torch_xla_jaxbridge._integrations import autograd_function


def _checkpoint_hook(function, *args, use_reentrant=None, context_fn=None,
                     determinism_check=None, debug=None, preserve_rng_state=True,
                     early_stop=True, **kwargs):
  """torch's checkpoint signature; in a thread that traces bridged code it recomputes `function`
  in the backward via `jax.checkpoint`, elsewhere it is torch's own checkpoint."""
  if not _TORCH_CHECKPOINT.active():
    original = _TORCH_CHECKPOINT.original(torch_private.CHECKPOINT_HOOK)
    original = original or torch_private.dynamo_disabled(torch_private.torch_checkpoint_target())
    return original(function, *args, use_reentrant=use_reentrant, context_fn=context_fn,
                    determinism_check=determinism_check, debug=debug,
                    preserve_rng_state=preserve_rng_state, early_stop=early_stop, **kwargs)
  return _recomputed(function, args, kwargs)


def _recomputed(function, args, kwargs):
  """`function(*args, **kwargs)` on traced tensors, recomputed in the backward (`jax.checkpoint`;
  when the enclosing trace is differentiated, in a conditional, or XLA merges the recomputation
  with the forward and keeps its values: `recompute.sequenced`). Its random numbers (dropout)
  start from the enclosing code's key, the same in the forward and the recomputation."""
  jax = runtime.jax_module()
  tensors, rebuild = tracing.traced_arrays((args, kwargs))
  env = tracing.environment()
  outer_key = torchax_private.current_key(env)
  drew = []

  def recomputed(*arrays):
    (call_args, call_kwargs), _ = rebuild(arrays)
    with env.override_property(prng=outer_key):  # the key never leaves this trace
      out = tracing.to_jax(function(*call_args, **call_kwargs))
      drew.append(torchax_private.current_key(env) is not outer_key)
    return out

  arrays = [t.jax() for t in tensors]
  if recompute.is_differentiated():  # its parameters and the arguments it closes over, too
    out = recompute.sequenced_call(jax.checkpoint(recomputed), *arrays)
  else:
    out = jax.checkpoint(recomputed)(*arrays)
  if drew and drew[-1]:
    env.get_and_rotate_prng_key()  # later draws of the enclosing code differ from these
  return grad_reads.like(tracing.to_torchax(out), tensors)


def _torch_xla_checkpoint(run_function, preserve_rng_state, *args):
  """torch_xla's `CheckpointFunction.apply` (what `torch_xla.utils.checkpoint.checkpoint` and
  FSDP's `checkpoint_module` call) inside a trace: its backward runs torch's autograd, which traced
  tensors do not have; `jax.checkpoint` recomputes the function instead."""
  return _recomputed(run_function, args, {})


_TORCH_CHECKPOINT = patching.Patch(lambda: [torch_private.torch_checkpoint_target()],
                                   {torch_private.CHECKPOINT_HOOK: _checkpoint_hook})
tracing.register_trace_context(lambda: _TORCH_CHECKPOINT)
autograd_function.register_function_rule("torch_xla.utils.checkpoint.CheckpointFunction",
                                         _torch_xla_checkpoint)
