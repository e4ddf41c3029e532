"""torch_xla's private entry points (its C++ module `torch_xla._XLAC`), one function each.

torch_xla has no public Python API for a user-computation IR node, a computation from an HLO
proto, a tensor's sharding proto, or replacing a tensor's data. Each function says what breaks if
its entry point changes; `test/test_compat.py` checks each one directly.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

ENTRY_POINTS = ("_xla_user_computation", "_xla_op_computation_from_module_proto",
                "_get_xla_op_sharding", "_xla_mark_sharding", "_replace_xla_tensor",
                "_xla_sync_multi", "_init_computation_client", "_get_xla_sharding_spec",
                "_get_xla_tensors_hlo_proto", "_get_xla_tensors_hlo",
                "_get_tensors_xla_device_data_node", "_get_xla_tensor_debug_info",
                "_xla_get_tensor_id", "_xla_tensors_report", "_global_tensor_from_cpu_shards",
                "_get_allow_execution")


def _xlac():
  import torch_xla

  return torch_xla._XLAC


def init_computation_client() -> None:
  """Creates torch_xla's PJRT client now (it is otherwise made on first use). It must exist
  before JAX claims the device, and before torch's autograd engine sizes its per-device queues.

  Example:
    >>> init_computation_client()
  """
  _xlac()._init_computation_client()


def user_computation(op_name: str, tensors: Sequence[torch.Tensor], computation: Any) -> list:
  """The IR node `op_name` calling `computation` on `tensors`; its outputs as XLA tensors. The
  bridge's one node per call (`call_jax`). Under torch_xla's eager mode the outputs are run at
  once, as one program (eager mode would run the node once per output).

  Example:
    >>> import torch_xla, jax
    >>> proto = jax.jit(lambda x: (x * 2,)).lower(jax.ShapeDtypeStruct((2,), "float32"))
    >>> comp = computation_from_proto("xla::double", proto.compiler_ir("hlo")
    ...                               .as_serialized_hlo_module_proto())
    >>> user_computation("xla::double", [torch.ones(2, device="xla")], comp)[0].cpu().tolist()
    [2.0, 2.0]
  """
  xlac = _xlac()
  if not xlac._get_use_eager_mode():
    return xlac._xla_user_computation(op_name, list(tensors), computation)
  # torch_xla's eager mode runs each new tensor's graph as the tensor is made: the node would
  # compile and run once per output. Made lazily, its outputs then run as one program.
  xlac._set_use_eager_mode(False)
  try:
    outputs = xlac._xla_user_computation(op_name, list(tensors), computation)
  finally:
    xlac._set_use_eager_mode(True)
  xlac._xla_sync_multi(outputs, [], False)
  return outputs


def computation_from_proto(op_name: str, hlo_proto: bytes) -> Any:
  """A torch_xla computation (for `user_computation`) from a serialized HLO module.

  Example:
    >>> callable(computation_from_proto)
    True
  """
  return _xlac()._xla_op_computation_from_module_proto(op_name, hlo_proto)


def op_sharding_of(tensor: torch.Tensor) -> Any:
  """The `OpSharding` of an XLA tensor (None when it has none).

  Example:
    >>> op_sharding_of(torch.ones(2, device="xla")) is None
    True
  """
  return _xlac()._get_xla_op_sharding(tensor)


def mark_sharding(tensor: torch.Tensor, op_sharding: Any) -> None:
  """Gives an XLA tensor the sharding `op_sharding` (an `OpSharding` read by `op_sharding_of`).

  Example:
    >>> callable(mark_sharding)
    True
  """
  _xlac()._xla_mark_sharding(tensor, op_sharding)


def sharding_spec(tensor: torch.Tensor) -> str:
  """The HLO text of an XLA tensor's sharding ("" when it has none).

  Example:
    >>> sharding_spec(torch.ones(2, device="xla"))
    ''
  """
  return _xlac()._get_xla_sharding_spec(tensor)


def tensor_from_cpu_shards(shards: list, op_sharding: Any, shape: list) -> torch.Tensor:
  """A sharded XLA tensor of `shape` made from its CPU shards, one per device in device order
  (without the whole tensor ever on one device).

  Example:
    >>> callable(tensor_from_cpu_shards)
    True
  """
  return _xlac()._global_tensor_from_cpu_shards(shards, op_sharding, shape)


def sync_tensors(tensors: Sequence[torch.Tensor]) -> None:
  """Runs the pending graph of `tensors` only (not every live tensor's, as `torch_xla.sync()`
  does), waiting for it; cheap when nothing is pending.

  Example:
    >>> x = torch.ones(2, device="xla") * 2
    >>> sync_tensors([x]); tensor_state(x)[2]
    False
  """
  _xlac()._xla_sync_multi(list(tensors), [], True)


def execution_allowed() -> bool:
  """Whether a graph may run now: false inside `torch_xla.compile(..., full_graph=True)`, which
  turns executions off while its function is traced (one that runs anyway raises and leaves the
  tensors it was computing without data). torch_xla has no public reader of the flag.

  Example:
    >>> execution_allowed()
    True
  """
  return bool(_xlac()._get_allow_execution())


def replace_data(tensor: torch.Tensor, new: torch.Tensor) -> None:
  """`tensor` (an XLA tensor, e.g. a parameter) takes `new`'s value without a copy, as an in-place
  update would: torch_xla's `_replace_xla_tensor` swaps the value inside torch's functionalization
  wrapper, and `torch._functionalize_commit_update` makes it the value of the wrapper's storage.
  Without the commit, once a parameter had an in-place op (`load_state_dict`'s `copy_`), its
  aliases (`detach()`, so `state_dict()`) keep reading the old value. As for torch's in-place
  ops, `_propagate_xla_data` first marks the new value as the old one's update, so the sync that
  computes it writes it over the old device buffer (input/output aliasing: one buffer, not two).
  Public alternative: `tensor.copy_(new)` under no_grad (about 3x the host time per tensor).

  Example:
    >>> t = torch.nn.Parameter(torch.zeros(2, device="xla"))
    >>> with torch.no_grad(): _ = t.copy_(torch.ones(2))
    >>> replace_data(t, torch.full((2,), 5.0, device="xla")); t.detach().cpu().tolist()
    [5.0, 5.0]
  """
  if torch._is_functional_tensor(tensor):
    torch._C._propagate_xla_data(tensor, torch._from_functional_tensor(new))
    _xlac()._replace_xla_tensor(tensor, new)
    torch._functionalize_commit_update(tensor)
  else:  # XLA_DISABLE_FUNCTIONALIZATION=1
    torch.ops.aten._propagate_xla_data(tensor, new)
    _xlac()._replace_xla_tensor(tensor, new)


def replace_data_many(tensors: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> None:
  """`replace_data(t, new)` for each pair (an optimizer step's parameters and states).

  Example:
    >>> ts = [torch.zeros(2, device="xla") for _ in range(2)]
    >>> replace_data_many(ts, [t + 1 for t in ts]); [t.cpu().tolist() for t in ts]
    [[1.0, 1.0], [1.0, 1.0]]
  """
  replace = _xlac()._replace_xla_tensor
  if not tensors or not torch._is_functional_tensor(tensors[0]):
    for tensor, new in zip(tensors, news):
      replace_data(tensor, new)
    return
  propagate, unwrap = torch._C._propagate_xla_data, torch._from_functional_tensor
  commit, is_functional = torch._functionalize_commit_update, torch._is_functional_tensor
  for tensor, new in zip(tensors, news):
    if not is_functional(tensor):
      replace_data(tensor, new)
      continue
    propagate(tensor, unwrap(new))
    replace(tensor, new)
    commit(tensor)


def tensors_hlo_text(tensors: Sequence[torch.Tensor]) -> str:
  """The HLO text of the program that would compute `tensors`.

  Example:
    >>> "multiply" in tensors_hlo_text([torch.ones(2, device="xla") * 3])
    True
  """
  return _xlac()._get_xla_tensors_hlo(list(tensors))


def pending_graph(tensors: Sequence[torch.Tensor]) -> tuple:
  """`(hlo_proto_bytes, parameter_tensor_ids, parameter_shapes)` of the program torch_xla would
  compile to compute `tensors` (its `IrToHlo` lowering, the same as a sync's, without the
  input/output aliasing a sync adds). Parameter ids are torch_xla tensor ids (-1: a constant).
  Breaks if torch_xla renames these entry points; `test_compat` checks the parameter order
  against the HLO's. Public alternative: none.

  Example:
    >>> x = torch.ones(2, device="xla") + 1
    >>> proto, ids, shapes = pending_graph([x])
    >>> len(proto) > 0 and len(ids) == len(shapes)
    True
  """
  proto = _xlac()._get_xla_tensors_hlo_proto(list(tensors))
  ids, values = _xlac()._get_tensors_xla_device_data_node(list(tensors))
  return proto, list(ids), [tuple(getattr(v, "shape", ())) for v in values]


def tensor_state(tensor: torch.Tensor) -> tuple | None:
  """`(tensor_id, alias_id, pending)` of an XLA tensor: its torch_xla id, the id of the device data
  an in-place update of it replaces (a sync aliases that input to this output), and whether it
  holds a graph still to run; None for a tensor on the device that torch_xla does not hold. Read
  from torch_xla's debug text; `test_compat` checks the fields.

  Example:
    >>> import torch_xla
    >>> x = torch.ones(2, device="xla")
    >>> torch_xla.sync()
    >>> _ = x.add_(1)
    >>> tensor_state(x)[2]
    True
  """
  info = _xlac()._get_xla_tensor_debug_info(tensor)
  if info.startswith("Not a XLATensor"):  # on the XLA device only by name (a wrapper's view)
    return None
  alias = re.search(r"AliasID: (-?\d+)", info)
  if alias is None or "XLAData:" not in info:
    raise RuntimeError(f"torch_xla's tensor debug info changed: {info!r}")
  return (_xlac()._xla_get_tensor_id(tensor), int(alias.group(1)),
          re.search(r"XLAData: None", info) is not None)


def live_pending_ids(device: str) -> set:
  """torch_xla's ids of every live tensor on `device` whose value is a graph still to run (more
  than a lone `device_data` node): what `torch_xla.sync()` computes. Parsed from
  `_xla_tensors_report`; `test_compat` checks the format.

  Example:
    >>> x = torch.ones(2, device="xla") * 3
    >>> tensor_state(x)[0] in live_pending_ids(str(x.device))
    True
  """
  report = _xlac()._xla_tensors_report(0, device)
  found = set()
  for tid, ir in re.findall(r"Tensor: id=(\d+),[^\n]*\nIR \{\n(.*?)\n\}", report, re.S):
    lines = ir.strip().splitlines()
    if not (len(lines) == 1 and "xla::device_data" in lines[0]):
      found.add(int(tid))
  return found
