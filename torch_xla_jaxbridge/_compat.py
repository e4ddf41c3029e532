"""Every private JAX, torch, torchax and torch_xla internal the package relies on, in one place.

Each entry says why it is needed, what breaks if it changes, and the public alternative if any.
`test/test_compat.py` checks each assumption directly, so a version bump fails there with a clear
message instead of deep inside a trace. Nothing else in the package imports a private module or
reads a private attribute of another library.
"""
import functools


# --- torch_xla: the C++ entry points (no public Python API for these) ---------------------------

def xlac():
  """torch_xla's C++ module. Used for: the user-computation IR node (`_xla_user_computation`), a
  computation from an HLO proto, reading and setting a tensor's sharding, replacing a tensor's
  data, syncing chosen tensors, a sharded tensor made from its CPU shards (recipe start-up). If a
  name goes, `test_compat` names it; no public alternative.

  Example:
    >>> callable(xlac()._xla_user_computation)
    True
  """
  import torch_xla

  return torch_xla._XLAC


XLAC_FUNCTIONS = ("_xla_user_computation", "_xla_op_computation_from_module_proto",
                  "_get_xla_op_sharding", "_xla_mark_sharding", "_replace_xla_tensor",
                  "_xla_sync_multi", "_init_computation_client", "_get_xla_sharding_spec",
                  "_get_xla_tensors_hlo_proto", "_get_tensors_xla_device_data_node",
                  "_get_xla_tensor_debug_info", "_xla_get_tensor_id", "_xla_tensors_report",
                  "_global_tensor_from_cpu_shards")


def replace_data(tensor, new):
  """`tensor` (an XLA tensor, e.g. a parameter) takes `new`'s value without a copy, as an in-place
  update would: torch_xla's `_replace_xla_tensor` swaps the value inside torch's functionalization
  wrapper, and `torch._functionalize_commit_update` makes it the value of the wrapper's storage.
  Without the commit, once a parameter had an in-place op (`load_state_dict`'s `copy_`), its
  aliases (`detach()`, so `state_dict()`) keep reading the old value. As for torch's in-place
  ops, `_propagate_xla_data` first marks the new value as the old one's update, so the sync that
  computes it writes it over the old device buffer (input/output aliasing: one buffer, not two).
  Public alternative: `tensor.copy_(new)` under no_grad (about 3x the host time per tensor).

  Example:
    >>> import torch
    >>> t = torch.nn.Parameter(torch.zeros(2, device="xla"))
    >>> with torch.no_grad(): _ = t.copy_(torch.ones(2))
    >>> replace_data(t, torch.full((2,), 5.0, device="xla")); t.detach().cpu().tolist()
    [5.0, 5.0]
  """
  import torch

  if torch._is_functional_tensor(tensor):
    torch._C._propagate_xla_data(tensor, torch._from_functional_tensor(new))
    xlac()._replace_xla_tensor(tensor, new)
    torch._functionalize_commit_update(tensor)
  else:  # XLA_DISABLE_FUNCTIONALIZATION=1
    torch.ops.aten._propagate_xla_data(tensor, new)
    xlac()._replace_xla_tensor(tensor, new)


def init_computation_client():
  """Creates torch_xla's PJRT client now (it is otherwise made on first use). It must exist
  before JAX claims the device, and before torch's autograd engine sizes its per-device queues.

  Example:
    >>> init_computation_client()
  """
  xlac()._init_computation_client()


def _jax():
  init_computation_client()
  import jax

  return jax


# --- JAX -----------------------------------------------------------------------------------------

def trace_context():
  """JAX's trace-time config (x64, matmul precision, ...) as a hashable value: part of every
  cache key, so a trace made under other settings is not reused. Breaks: every call re-traces or
  none does; `test_compat` checks it is hashable and changes with x64.

  Example:
    >>> hash(trace_context()) is not None
    True
  """
  _jax()
  from jax._src import config

  return config.trace_context()


def enable_x64(on):
  """Context: JAX's 64-bit mode on or off for this thread only (`jax.enable_x64` is deprecated
  and flips it for every thread).

  Example:
    >>> with enable_x64(False):
    ...   pass
  """
  _jax()
  from jax._src import config

  return config.enable_x64(bool(on))


def gspmd_partitioner():
  """Context: lower with GSPMD shardings (`mhlo.sharding`), which torch_xla partitions, not
  Shardy's. Public alternative: `jax.config.update("jax_use_shardy_partitioner", False)`, which
  is global.

  Example:
    >>> with gspmd_partitioner():
    ...   pass
  """
  _jax()
  from jax._src import config

  return config.use_shardy_partitioner(False)


def wrap_with_sharding_op(ctx, value, aval, op_sharding):
  """Lowering helper: an HLO `Sharding` custom call on `value` (GSPMD form under
  `gspmd_partitioner()`). Used by `jb.spmd`'s constraint primitive; `jax.lax.with_sharding_
  constraint` would need a JAX mesh over JAX's devices, which torch_xla owns.

  Example:
    >>> callable(wrap_with_sharding_op)
    True
  """
  from jax._src.interpreters import mlir

  return mlir.wrap_with_sharding_op(ctx, value, aval, op_sharding)


def op_sharding():
  """A new, empty `xla_client.OpSharding` (the proto JAX lowers shardings from).

  Example:
    >>> op_sharding().tile_assignment_dimensions
    []
  """
  _jax()
  from jax._src.lib import xla_client

  return xla_client.OpSharding()


def is_checkpoint_name(primitive):
  """Whether a jaxpr equation's primitive is the one `jax.ad_checkpoint.checkpoint_name` binds;
  its `params["name"]` is the name. Used to name residuals in `jb.saved_residuals`.

  Example:
    >>> jax = _jax()
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> eqn = jax.make_jaxpr(lambda x: checkpoint_name(x, "a"))(1.0).jaxpr.eqns[0]
    >>> is_checkpoint_name(eqn.primitive)
    True
  """
  _jax()
  from jax._src import ad_checkpoint

  return primitive is ad_checkpoint.name_p


def user_frames(source_info):
  """The frames of a jaxpr equation's source traceback outside JAX, innermost first.

  Example:
    >>> jax = _jax()
    >>> eqn = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0]
    >>> len(list(user_frames(eqn.source_info))) > 0
    True
  """
  from jax._src import source_info_util

  return source_info_util.user_frames(source_info.traceback)


def is_leak_error(exc):
  """Whether `exc` is the report of `jax.checking_leaks()`: JAX raises a plain Exception whose
  message starts with "Leaked trace" (no class to catch).

  Example:
    >>> is_leak_error(Exception("Leaked trace DynamicJaxprTrace"))
    True
  """
  return str(exc).startswith("Leaked trace")


def is_while_loop_gradient_error(exc):
  """Whether `exc` is JAX's refusal to differentiate `lax.while_loop` in reverse mode (a
  ValueError identified by its message).

  Example:
    >>> is_while_loop_gradient_error(ValueError("x"))
    False
  """
  return "Reverse-mode differentiation does not work for lax.while_loop" in str(exc)


def is_saved_tensor_modified_error(exc):
  """Whether `exc` is autograd's report that a tensor saved for backward was changed in place (a
  RuntimeError identified by its message; torch has no class for it). If torch rewords it, its
  own RuntimeError reaches the user instead of the package's MutationError: still an error.

  Example:
    >>> is_saved_tensor_modified_error(RuntimeError("x"))
    False
  """
  return "inplace operation" in str(exc)


def dlpack_cpu_import():
  """JAX's own DLPack import onto its CPU device, or None where this JAX lacks it. The public
  `jax.dlpack.from_dlpack` wraps it in conversions that cost an order of magnitude more host time
  per call (docs/performance.md).

  Example:
    >>> dlpack_cpu_import() is None or callable(dlpack_cpu_import())
    True
  """
  _jax()
  from jax._src.lib import xla_client

  return getattr(xla_client._xla, "dlpack_managed_tensor_to_buffer", None)


# --- torchax -------------------------------------------------------------------------------------

def set_array(tensor, array):
  """Replaces the JAX array inside a torchax tensor (in-place updates: batch norm statistics,
  `xs.mark_sharding`). Reading is public (`tensor.jax()`); writing is not.

  Example:
    >>> jax = _jax()
    >>> import torchax.tensor
    >>> from torch_xla_jaxbridge import tracing
    >>> t = torchax.tensor.Tensor(jax.numpy.zeros(2), tracing.environment())
    >>> set_array(t, jax.numpy.ones(2)); t.jax().tolist()
    [1.0, 1.0]
  """
  tensor._elem = array


def environment_class(on_plain_tensor):
  """A torchax Environment in which new tensors are JAX values whatever device they name: it
  overrides torchax's `_should_use_torchax_tensor` and `_is_same_device` (private hooks; if they
  are renamed, `torch.zeros(3, device="cpu")` inside bridged code becomes a real CPU tensor and
  math with it an error). `on_plain_tensor(t)` is called for a plain torch tensor that traced
  code mixes into its math (torchax only `assert`s, which `python -O` removes).

  Example:
    >>> env_type = environment_class(on_plain_tensor=print)
  """
  import torchax.tensor

  class BridgeEnvironment(torchax.tensor.Environment):

    def _should_use_torchax_tensor(self, device):
      return True

    def _is_same_device(self, the_tensor, new_device):
      return True

    def t2j_iso(self, torchtensors):
      import torch

      for leaf in torch_tree().tree_leaves(torchtensors):
        if isinstance(leaf, torch.Tensor) and not isinstance(
            leaf, (torchax.tensor.Tensor, torchax.tensor.View)):
          on_plain_tensor(leaf)
      return super().t2j_iso(torchtensors)

  return BridgeEnvironment


def current_key(env):
  """The PRNG key torchax draws from now (changes when code draws random numbers).

  Example:
    >>> from torch_xla_jaxbridge import tracing
    >>> current_key(tracing.environment()) is not None
    True
  """
  return env.param.prng


def batch_norm_forward(*args):
  """torchax's batch norm kernel on arrays: `(out, mean, rstd)`. The package reuses it and adds
  the running-statistics update torchax drops.

  Example:
    >>> callable(batch_norm_forward)
    True
  """
  from torchax.ops import jaten

  return jaten._aten__native_batch_norm_legit(*args)


def register_higher_order_rule(operator, rule):
  """Makes torch's higher-order `operator` (cond, while_loop) run `rule(mode, ...)` under
  torchax's dispatch mode. torch's `py_impl` is the registration torch's own modes use.

  Example:
    >>> callable(register_higher_order_rule)
    True
  """
  import torchax.tensor

  operator.py_impl(torchax.tensor.XLADispatchMode)(rule)


# --- torch ---------------------------------------------------------------------------------------

def torch_tree():
  """torch's pytree module (`torch.utils._pytree`): the structures torch code returns that JAX's
  pytrees do not know (Hugging Face `ModelOutput`s register there). Public alternative: none yet
  (`torch.utils.pytree` is a thin re-export in newer torch).

  Example:
    >>> torch_tree().tree_flatten({"a": 1})[0]
    [1]
  """
  import torch.utils._pytree

  return torch.utils._pytree


CHECKPOINT_HOOK = "__dynamo_disable"


@functools.cache
def torch_checkpoint_target():
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

  return torch.utils.checkpoint.checkpoint.__wrapped__


def dynamo_disabled(fn):
  """What torch's wrapper stores in the hook when nobody else does.

  Example:
    >>> callable(dynamo_disabled(print))
    True
  """
  import torch._dynamo

  return torch._dynamo.disable(fn, recursive=True, wrapping=False)



def autocast_registrations(dispatch_key):
  """The ops with a kernel for an autocast dispatch key (`"AutocastXLA"`, `"AutocastCPU"`), as
  `"aten::name.overload"` strings. torch has no public way to read its autocast op lists; the
  bridge's own policy table (`autocast.XLA_POLICY`) is checked against this in the tests, so a
  torch_xla release that adds or drops an autocast op fails there instead of silently differing.

  Example:
    >>> "aten::matmul" in autocast_registrations("AutocastXLA")
    True
  """
  import torch

  return set(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


def wrap_dispatch(env, wrapper):
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


# --- the compiled memory of a step (memory.py) ----------------------------------------------------

def pending_graph(tensors):
  """`(hlo_proto_bytes, parameter_tensor_ids, parameter_shapes)` of the program torch_xla would
  compile to compute `tensors` (its `IrToHlo` lowering, the same as a sync's, without the
  input/output aliasing a sync adds). Parameter ids are torch_xla tensor ids (-1: a constant).
  Breaks if torch_xla renames these entry points; `test_compat` checks the parameter order
  against the HLO's. Public alternative: none.

  Example:
    >>> import torch, torch_xla
    >>> x = torch.ones(2, device="xla") + 1
    >>> proto, ids, shapes = pending_graph([x])
    >>> len(proto) > 0 and len(ids) == len(shapes)
    True
  """
  proto = xlac()._get_xla_tensors_hlo_proto(list(tensors))
  ids, values = xlac()._get_tensors_xla_device_data_node(list(tensors))
  return proto, list(ids), [tuple(getattr(v, "shape", ())) for v in values]


def tensor_state(tensor):
  """`(tensor_id, alias_id, pending)` of an XLA tensor: its torch_xla id, the id of the device data
  an in-place update of it replaces (a sync aliases that input to this output), and whether it
  holds a graph still to run. Read from torch_xla's debug text; `test_compat` checks the fields.

  Example:
    >>> import torch, torch_xla
    >>> x = torch.ones(2, device="xla")
    >>> torch_xla.sync()
    >>> _ = x.add_(1)
    >>> tensor_state(x)[2]
    True
  """
  import re

  info = xlac()._get_xla_tensor_debug_info(tensor)
  alias = re.search(r"AliasID: (-?\d+)", info)
  if alias is None or "XLAData:" not in info:
    raise RuntimeError(f"torch_xla's tensor debug info changed: {info!r}")
  return (xlac()._xla_get_tensor_id(tensor), int(alias.group(1)),
          re.search(r"XLAData: None", info) is not None)


def live_pending_ids(device):
  """torch_xla's ids of every live tensor on `device` whose value is a graph still to run (more
  than a lone `device_data` node): what `torch_xla.sync()` computes. Parsed from
  `_xla_tensors_report`; `test_compat` checks the format.

  Example:
    >>> import torch, torch_xla
    >>> x = torch.ones(2, device="xla") * 3
    >>> tensor_state(x)[0] in live_pending_ids(str(x.device))
    True
  """
  import re

  report = xlac()._xla_tensors_report(0, device)
  found = set()
  for tid, ir in re.findall(r"Tensor: id=(\d+),[^\n]*\nIR \{\n(.*?)\n\}", report, re.S):
    lines = ir.strip().splitlines()
    if not (len(lines) == 1 and "xla::device_data" in lines[0]):
      found.add(int(tid))
  return found


def compiled_memory(hlo_proto, aliases, outputs=2):
  """XLA's compiled memory statistics (`CompiledMemoryStats`: argument, output, alias, temp
  bytes) of an HLO module with `outputs` results, compiled for JAX's CPU backend with `aliases`
  [(output index, parameter index)] as its input/output aliasing. Uses jaxlib's XLA client (private `jax._src.lib`):
  HLO text -> module -> StableHLO -> `compile_and_load`. Breaks on a jaxlib that renames these;
  `test_compat` compiles a small module and checks the alias bytes. Public alternative: none for a
  module JAX did not trace.

  Example:
    >>> import torch, torch_xla
    >>> proto, _, _ = pending_graph([torch.ones(4, device="xla") * 2])
    >>> compiled_memory(proto, []).output_size_in_bytes
    16
  """
  jax = _jax()
  from jax._src.lib import xla_client

  xla = xla_client._xla
  module = xla.HloModule.from_serialized_hlo_module_proto(hlo_proto)
  if aliases:
    text = module.to_string()
    header, rest = text.split("\n", 1)
    tupled = outputs > 1  # StableHLO unwraps a 1-tuple: the one output's index is {}
    spec = ", ".join(("{%d}" % out if tupled else "{}") + ": (%d, {}, may-alias)" % param
                     for out, param in aliases)
    text = f"{header}, input_output_alias={{ {spec} }}\n{rest}"
    module = xla.hlo_module_from_text(text)
  mlir = xla.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
  cpu = jax.devices("cpu")[:1]
  executable = cpu[0].client.compile_and_load(mlir, cpu, xla_client.CompileOptions())
  return executable.get_compiled_memory_stats()
