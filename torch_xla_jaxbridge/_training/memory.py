"""The compiled memory of a torch_xla training step, read from XLA's compiled program.

`memory_report(step_fn, *args)` runs one step, gathers the tensors the next `torch_xla.sync()`
computes, lowers them as torch_xla does (`IrToHlo`, with a sync's input/output aliasing of
in-place updated tensors), compiles that module with XLA and returns its `CompiledMemoryStats`.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Iterable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import jax_private, torch_xla_private


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes of one step's compiled XLA program; `str()` gives a table."""
  argument_bytes: int  # the program's inputs (parameters, data, optimizer state)
  output_bytes: int  # everything the step computes (updated parameters, gradients, loss)
  alias_bytes: int  # outputs written over their inputs (in-place updates): counted once
  temp_bytes: int  # XLA's scratch buffers: activations, residuals, intermediates
  outputs: int  # tensors computed by the program
  unreached: int  # live pending tensors Python holds no reference to (torch_xla view bases)

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs - aliased + temp: the program's peak footprint as XLA assigns it."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def __str__(self) -> str:
    rows = [("arguments", self.argument_bytes), ("outputs", self.output_bytes),
            ("aliased", self.alias_bytes), ("temp", self.temp_bytes), ("total", self.total_bytes)]
    return "\n".join(f"{name:<10} {value:>14,d} B" for name, value in rows)


def _xla_tensors(objects: Iterable[object]) -> dict[Any, tuple[torch.Tensor, Any]]:
  found = {}
  for obj in objects:
    if isinstance(obj, torch.Tensor) and _on_xla(obj):
      for tensor in (obj, obj.grad if obj.is_leaf else None):
        if tensor is not None:
          state = torch_xla_private.tensor_state(tensor)
          if state is not None and state[2]:  # pending
            found[state[0]] = (tensor, state[1])
  return found


def _on_xla(tensor: torch.Tensor) -> bool:
  try:
    return tensor.device.type == "xla"
  except RuntimeError:  # "tensor does not have a device": garbage not yet collected
    return False


def memory_report(step_fn: Callable[..., Any], *args: Any, sync: bool = True,
                  **kwargs: Any) -> MemoryReport:
  """Runs `step_fn(*args, **kwargs)` (one training step on XLA tensors, without its sync) and
  returns the memory of the program its `torch_xla.sync()` compiles, from XLA's compiled module;
  then syncs, so the step has run. With `sync=False` it only compiles: the step stays pending
  (sync to run it), e.g. to size a batch that would not fit.

  Example:
    >>> import torch, torch_xla
    >>> w = torch.ones(256, 256, device="xla")
    >>> torch_xla.sync()
    >>> report = memory_report(lambda: w.mul_(2))
    >>> report.argument_bytes, report.alias_bytes  # w and the scalar 2; w updated in place
    (262148, 262144)
  """
  if not callable(step_fn):
    raise errors.BadArgumentError(
        f"memory_report needs the step as a function, got {type(step_fn).__name__}; pass "
        "`memory_report(step_fn, *args)`, not the result of calling it")
  step_fn(*args, **kwargs)
  gc.collect()
  with _quiet():
    found = _xla_tensors(gc.get_objects())
  if not found:
    raise errors.BadArgumentError(
        "memory_report: the step left nothing for torch_xla.sync() to compute; pass a function "
        "that runs the step on XLA tensors (and does not sync itself)")
  tensors = [tensor for tensor, _ in found.values()]
  device = str(tensors[0].device)
  proto, param_ids, param_shapes = torch_xla_private.pending_graph(tensors)
  outputs = {alias: i for i, (_, alias) in enumerate(found.values())}
  aliases = [(outputs[tid], j) for j, tid in enumerate(param_ids)
             if tid in outputs and tuple(tensors[outputs[tid]].shape) == param_shapes[j]]
  stats = compiled_memory(proto, aliases, len(tensors))
  unreached = len(torch_xla_private.live_pending_ids(device) - set(found))
  if sync:
    import torch_xla

    torch_xla.sync()
  return MemoryReport(stats.argument_size_in_bytes, stats.output_size_in_bytes,
                      stats.alias_size_in_bytes, stats.temp_size_in_bytes, len(tensors), unreached)


def compiled_memory(hlo_proto: bytes, aliases: list, outputs: int = 2) -> Any:
  """XLA's compiled memory statistics (`CompiledMemoryStats`: argument, output, alias, temp
  bytes) of an HLO module with `outputs` results, compiled for JAX's CPU backend with `aliases`
  [(output index, parameter index)] as its input/output aliasing (written into the module's
  header, as a sync's aliasing of in-place updated tensors).

  Example:
    >>> import torch, torch_xla
    >>> proto, _, _ = torch_xla_private.pending_graph([torch.ones(4, device="xla") * 2])
    >>> compiled_memory(proto, []).output_size_in_bytes
    16
  """
  if aliases:
    header, rest = jax_private.hlo_text(hlo_proto).split("\n", 1)
    tupled = outputs > 1  # StableHLO unwraps a 1-tuple: the one output's index is {}
    spec = ", ".join(("{%d}" % out if tupled else "{}") + ": (%d, {}, may-alias)" % param
                     for out, param in aliases)
    hlo_proto = jax_private.hlo_proto_from_text(f"{header}, input_output_alias={{ {spec} }}\n{rest}")
  return jax_private.cpu_compiled_memory(hlo_proto)


class _quiet:
  """Silences torch's warnings while every tensor's `.grad` is read (non-leaf, deprecated ...)."""

  def __enter__(self) -> None:
    import warnings

    self._catch = warnings.catch_warnings()
    self._catch.__enter__()
    warnings.simplefilter("ignore")

  def __exit__(self, *exc: Any) -> None:
    return self._catch.__exit__(*exc)
