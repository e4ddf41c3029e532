"""The package's exception types. Every message says what was wrong and what to do."""


class BridgeError(Exception):
  """Base class of the errors raised by torch_xla_jaxbridge. `fallback_helps` says whether running
  the region as plain LazyTensor code instead could help (false for a misuse of a feature that
  exists only in bridged code); `lasting`, whether a region that fell back for it stays so (it
  does unless the cause is a state of the call, such as a hook, and not of the code)."""
  fallback_helps = True
  lasting = True


class BadArgumentError(BridgeError, TypeError):
  """An argument cannot cross the torch/JAX boundary (wrong device, unhashable static, ...)."""


class BadValueError(BadArgumentError, ValueError):
  """An argument of the right kind whose value cannot work (layers of different structures,
  scanned inputs of different lengths, a step function that is not callable); a `ValueError`
  too, as upstream torch_xla raises there."""


class MissingSeedError(BadArgumentError, AssertionError):
  """A function made with `assume_pure(..., add_rng_seed_argument=True)` was called without
  `rng_seed=`; an `AssertionError` too, as upstream torch_xla raises there."""


class JaxTracingError(BridgeError):
  """The JAX function raised while being traced for one abstract signature."""


class DataDependentError(BridgeError):
  """Bridged torch code used a tensor's value in Python (`if x.sum() > 0`, `.item()`, ...)."""


class HostRandomnessError(BridgeError):
  """Bridged torch code drew numbers from a host random stream (Python's `random`, NumPy's global
  generator): a trace draws them once, so each call would need its own trace."""


class CapturedTensorError(BridgeError):
  """Bridged torch code used a tensor that is not one of its arguments."""


class LeakedTensorError(BridgeError):
  """A tensor computed inside a traced function was kept outside it (global list, attribute)."""


class MutationError(BridgeError):
  """Bridged torch code mutated an argument in a way that cannot be written back, or a tensor
  shared by a `dlpack.to_cpu` / `to_xla` move was changed in place before backward."""


class InPlaceInputError(MutationError, RuntimeError):
  """A scanned step function changed its carry or its slice of `xs` in place; a `RuntimeError`
  too, as torch (and upstream's scan) raises for an in-place operation autograd cannot allow."""


class ControlFlowError(BridgeError):
  """Bridged control flow that cannot do what was asked (e.g. a gradient through a while loop)."""


class NoLoweringError(BridgeError):
  """Bridged code called something the bridge cannot convert to JAX: a custom op with neither a
  registered lowering nor a traceable implementation, or an autograd Function that changes its
  inputs in place."""


class HookError(BridgeError):
  """A module the bridged code calls holds a forward, forward pre- or backward hook: a user
  callback that runs at every call, which a trace would run once. The region runs that call as
  plain LazyTensor code, where the hook runs (the next call without hooks is bridged again);
  with `fallback=False` this is raised."""
  lasting = False


class TracedByTorchError(BridgeError):
  """Bridged code was called while torch's own machinery traced it (torch_xla's `scan` and
  `scan_layers`, AOTAutograd, `torch.compile` with another backend): there it runs as the plain
  torch code the tracer expects, for that call only. Never raised: the bridge report's reason."""
  lasting = False


class UsageError(BadArgumentError):
  """A call the package refuses whatever the mode: no fallback to plain LazyTensor code helps
  (a training step whose loss is not a scalar, an optimizer `train_step` cannot run, a bad
  sharding spec)."""
  fallback_helps = False


def misuse(error: BridgeError) -> BridgeError:
  """`error`, marked as one no fallback helps (see `BridgeError.fallback_helps`).

  Example:
    >>> misuse(MutationError("shard_map: ...")).fallback_helps
    False
  """
  error.fallback_helps = False
  return error


class FallbackWarning(UserWarning):
  """Said once per region that cannot be bridged and runs as plain LazyTensor code instead
  (`jb.bridge_report()` lists them)."""
