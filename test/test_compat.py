"""Each private internal `_compat` relies on, checked directly: a version bump fails here, by name."""
import threading

import jax
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._compat import (jax_lowering_private, jax_private, jaxpr_private,
                                         torch_dispatch_private, torch_private, torch_xla_private,
                                         torchax_private)
from torch_xla_jaxbridge._training.memory import compiled_memory
from torch_xla_jaxbridge._core import tracing


@pytest.mark.parametrize("name", torch_xla_private.ENTRY_POINTS)
def test_torch_xla_entry_point_exists(name):
  assert callable(getattr(torch_xla._XLAC, name, None)), f"torch_xla._XLAC.{name} is gone"


def test_trace_context_is_hashable_and_follows_x64():
  with jax_private.enable_x64(False):
    off = jax_private.trace_context()
  with jax_private.enable_x64(True):
    on = jax_private.trace_context()
  assert hash(off) != hash(on) and off != on


def test_enable_x64_is_per_thread():
  seen = []
  with jax_private.enable_x64(True):
    assert jax.numpy.ones(1, jax.numpy.int64).dtype == jax.numpy.int64
    worker = threading.Thread(target=lambda: seen.append(jax.numpy.ones(1, "int64").dtype))
    worker.start()
    worker.join()
  assert str(seen[0]) == "int32"


def test_gspmd_partitioner_lowers_sharding_as_mhlo():
  from torch_xla_jaxbridge._integrations import spmd

  tiles = spmd.Tiles((2, 1), (0, 1), False)
  constraint = spmd._primitive()
  with jax_private.gspmd_partitioner():
    text = jax.jit(lambda x: constraint.bind(x, tiles=tiles)).lower(
        jax.ShapeDtypeStruct((4, 2), jax.numpy.float32)).as_text()
  assert 'mhlo.sharding = "{devices=[2,1]0,1}"' in text and "@Sharding" in text


def test_checkpoint_name_binds_the_primitive_compat_names():
  from jax.ad_checkpoint import checkpoint_name

  eqns = jax.make_jaxpr(lambda x: checkpoint_name(x * 2, "scaled"))(1.0).jaxpr.eqns
  named = [e for e in eqns if jax_private.is_checkpoint_name(e.primitive)]
  assert [e.params["name"] for e in named] == ["scaled"]


def test_user_frames_reach_this_file():
  eqn = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0]
  assert any(f.file_name.endswith("test_compat.py") for f in jax_private.user_frames(eqn.source_info))


def test_leak_error_is_recognised():
  kept = []
  with pytest.raises(Exception) as info:
    with jax.checking_leaks():
      jax.jit(lambda x: kept.append(x) or x).trace(1.0)
  assert jax_private.is_leak_error(info.value)


def test_while_loop_gradient_error_is_recognised():
  loop = lambda x: jax.lax.while_loop(lambda c: c < 3.0, lambda c: c * 2, x)  # noqa: E731
  with pytest.raises(ValueError) as info:
    jax.grad(loop)(1.0)
  assert jax_private.is_while_loop_gradient_error(info.value)


def test_tangents_unread_finds_what_vjps_linear_program_never_reads():
  ones = jax.numpy.ones(3)
  f = lambda a, b, c, d: (a * b).sum() + jax.lax.stop_gradient(c).sum()  # noqa: E731
  _, vjp_fn = jax.vjp(f, ones, ones, ones, ones)
  assert jax_private.tangents_unread(vjp_fn) == {2, 3}
  _, vjp_fn = jax.vjp(jax.checkpoint(f), ones, ones, ones, ones)  # remat: read as a whole
  assert not jax_private.tangents_unread(vjp_fn) & {0, 1}
  assert jax_private.tangents_unread(lambda c: c) == frozenset()  # not built by jax.vjp: unknown


def test_saved_tensor_modified_error_is_recognised():
  x = torch.ones(2, requires_grad=True)
  y = x * 1
  z = y.sin()  # saves y
  y.add_(1)
  with pytest.raises(RuntimeError) as info:
    z.sum().backward()
  assert torch_private.is_saved_tensor_modified_error(info.value)


def test_dlpack_cpu_import_shares_memory():
  import numpy as np

  to_buffer = jax_private.dlpack_cpu_import()
  assert to_buffer is not None, "jaxlib's dlpack_managed_tensor_to_buffer is gone (slower path)"
  source = torch.arange(16.0)
  array = to_buffer(torch.utils.dlpack.to_dlpack(source), jax.devices("cpu")[0], None)
  np.testing.assert_array_equal(np.asarray(array), source.numpy())


def test_replace_data_is_seen_through_aliases_after_an_in_place_op():
  t = torch.nn.Parameter(torch.zeros(3, device="xla"))  # a plain tensor does not show the bug
  with torch.no_grad():
    t.copy_(torch.ones(3))  # as load_state_dict does
  t.detach().cpu()  # an alias read before the replacement
  torch_xla_private.replace_data(t, torch.full((3,), 7.0, device="xla"))
  assert t.detach().cpu().tolist() == t.cpu().tolist() == [7.0] * 3


def test_replace_data_writes_the_new_value_over_the_old_buffer():
  t = torch.nn.Parameter(torch.ones(64, 64, device="xla"))
  torch_xla.sync()
  report = jb.memory_report(lambda: torch_xla_private.replace_data(t, t.detach() * 3))
  assert report.alias_bytes == 64 * 64 * 4  # as an in-place update: one buffer
  assert t.detach().cpu().tolist() == [[3.0] * 64] * 64


def test_set_array_replaces_a_torchax_tensors_value():
  import torchax.tensor

  t = torchax.tensor.Tensor(jax.numpy.zeros(2), tracing.environment())
  torchax_private.set_array(t, jax.numpy.ones(2))
  assert t.jax().tolist() == [1.0, 1.0]


def test_environment_hooks_exist_on_torchax():
  import torchax.tensor

  for hook in ("_should_use_torchax_tensor", "_is_same_device", "t2j_iso"):
    assert callable(getattr(torchax.tensor.Environment, hook, None)), hook


def test_environment_reports_a_plain_tensor_in_traced_math():
  seen = []

  class Stop(Exception):
    pass

  def report(t):
    seen.append(tuple(t.shape))
    raise Stop

  import torchax.config
  import torchax.tensor

  env = torchax_private.environment_class(report)(
      torchax.config.Configuration(allow_mixed_math_with_scalar_tensor=False))
  plain = torch.ones(3)  # made outside: inside the environment it would be traced too
  with env, pytest.raises(Stop):
    torchax.tensor.Tensor(jax.numpy.ones(3), env) + plain
  assert seen == [(3,)]


def test_current_key_changes_when_code_draws():
  env = tracing.environment()
  key = jax.random.key(0)
  with env.override_property(prng=key):
    assert torchax_private.current_key(env) is key
    with env:
      torch.rand(2)
    assert torchax_private.current_key(env) is not key


def test_higher_order_rule_runs_under_torchax():
  from torch_xla_jaxbridge import bridge

  branchy = bridge(lambda x: torch.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, (x,)))
  assert branchy(torch.ones(2, device="xla")).cpu().tolist() == [2.0, 2.0]


def test_torch_checkpoint_wrapper_reads_the_hook():
  import torch.utils.checkpoint

  target = torch_private.torch_checkpoint_target()
  calls = []
  before = target.__dict__.get(torch_private.CHECKPOINT_HOOK)
  setattr(target, torch_private.CHECKPOINT_HOOK, lambda fn, *a, **k: calls.append(fn) or fn(*a))
  try:
    assert torch.utils.checkpoint.checkpoint(lambda x: x + 1, 1, use_reentrant=False) == 2
  finally:
    if before is None:
      delattr(target, torch_private.CHECKPOINT_HOOK)
    else:
      setattr(target, torch_private.CHECKPOINT_HOOK, before)
  assert len(calls) == 1


def test_dynamo_disabled_calls_through():
  assert torch_private.dynamo_disabled(lambda x: x * 3)(2) == 6


def test_torchax_routes_every_op_through_env_dispatch():
  import torchax.config
  import torchax.tensor

  env = torchax_private.environment_class(print)(torchax.config.Configuration())  # not the shared one
  seen = []
  torchax_private.wrap_dispatch(env, lambda dispatch, func, *rest: (seen.append(func),
                                                             dispatch(func, *rest))[1])
  t = torchax.tensor.Tensor(jax.numpy.ones((2, 2)), env)
  with env:
    torch.matmul(t, t)
  assert torch.matmul in seen and torch.ops.aten.mm.default in seen  # both levels


def test_autocast_registrations_lists_the_dispatch_keys_ops():
  assert "aten::linear" in torch_private.autocast_registrations("AutocastXLA")
  assert "aten::linear" in torch_private.autocast_registrations("AutocastCPU")


def test_pending_graph_parameters_follow_the_hlo_and_aliasing_compiles():
  import torch_xla

  w = torch.ones(16, 8, device="xla")
  b = torch.ones(3, device="xla")
  torch_xla.sync()
  w.mul_(2)
  y = (b + 1).sum()
  proto, ids, shapes = torch_xla_private.pending_graph([w, y])
  assert shapes[ids.index(torch_xla_private.tensor_state(w)[1])] == (16, 8)
  assert torch_xla_private.tensor_state(w)[2] and torch_xla_private.tensor_state(w)[1] in ids
  assert {torch_xla_private.tensor_state(w)[0], torch_xla_private.tensor_state(y)[0]} <= torch_xla_private.live_pending_ids("xla:0")
  stats = compiled_memory(proto, [(0, ids.index(torch_xla_private.tensor_state(w)[1]))], 2)
  assert stats.alias_size_in_bytes == 16 * 8 * 4
  torch_xla.sync()


def test_module_tables_are_the_live_dicts():
  lin = torch.nn.Linear(2, 3)
  torch_private.parameters_table(lin)["extra"] = torch.nn.Parameter(torch.ones(1))
  assert "extra" in dict(lin.named_parameters())
  wrapper = torch.nn.Module()
  torch_private.share_tables(wrapper, lin)
  assert torch_private.buffers_table(wrapper) is torch_private.buffers_table(lin)
  assert torch_private.children_table(wrapper) is torch_private.children_table(lin)


def test_hook_tables_are_the_live_dicts_of_each_kind():
  lin = torch.nn.Linear(2, 2)
  tables = torch_private.hook_tables(lin)
  handles = [lin.register_forward_pre_hook(lambda m, i: None),
             lin.register_forward_hook(lambda m, i, o: None),
             lin.register_full_backward_pre_hook(lambda m, g: None),
             lin.register_full_backward_hook(lambda m, gi, go: None)]
  assert [len(t) for t in tables] == [1, 1, 1, 1] and torch_private.has_hooks(lin)
  assert len(torch_private.HOOK_KINDS) == len(tables)
  for handle in handles:
    handle.remove()
  assert not any(tables) and not torch_private.has_hooks(lin)
  lin.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
  assert len(tables[1]) == 1 and torch_private.has_hooks(lin)
  old_style = torch.nn.Linear(2, 2)
  old_style.register_backward_hook(lambda m, gi, go: None)  # a backward hook too
  assert len(torch_private.hook_tables(old_style)[3]) == 1


def test_global_hook_tables_are_the_live_dicts_of_each_kind():
  from torch.nn.modules import module
  tables = torch_private.global_hook_tables()
  handles = [module.register_module_forward_pre_hook(lambda m, i: None),
             module.register_module_forward_hook(lambda m, i, o: None),
             module.register_module_full_backward_pre_hook(lambda m, g: None),
             module.register_module_full_backward_hook(lambda m, gi, go: None)]
  try:
    assert [len(t) for t in tables] == [1, 1, 1, 1]
  finally:
    for handle in handles:
      handle.remove()
  assert not any(tables)


def test_torch_pytrees_round_trip_a_structure_jax_does_not_know():
  from collections import OrderedDict

  leaves, spec = torch_private.tree_flatten(OrderedDict(a=1, b=[2, 3]))
  assert leaves == [1, 2, 3] and torch_private.tree_leaves({"x": (4,)}) == [4]
  assert torch_private.tree_unflatten([5, 6, 7], spec) == OrderedDict(a=5, b=[6, 7])


def test_higher_order_operators_are_torchs():
  operators = torch_private.higher_order_operators()
  assert operators["cond"].name() == "cond" and operators["while_loop"].name() == "while_loop"


def test_the_compile_backend_registers_once():
  calls = []
  torch_private.register_compile_backend(lambda gm, inputs: calls.append(1) or gm, "jaxbridge")
  assert "jaxbridge" in torch.compiler.list_backends()  # the package's, not replaced


def test_user_computation_from_a_proto_and_the_hlo_text():
  proto = jax.jit(lambda x: (x * 3,)).lower(jax.ShapeDtypeStruct((2,), "float32"))
  computation = torch_xla_private.computation_from_proto(
      "xla::triple", proto.compiler_ir("hlo").as_serialized_hlo_module_proto())
  out = torch_xla_private.user_computation("xla::triple", [torch.ones(2, device="xla")],
                                           computation)[0]
  assert "xla::triple" in torch_xla._XLAC._get_xla_tensors_text([out])
  assert "multiply" in torch_xla_private.tensors_hlo_text([out])
  torch_xla_private.sync_tensors([out])
  assert not torch_xla_private.tensor_state(out)[2] and out.cpu().tolist() == [3.0, 3.0]


def test_execution_allowed_reads_torch_xla_compiles_full_graph_flag():
  seen = []
  torch_xla.compile(lambda: seen.append(torch_xla_private.execution_allowed()),
                    full_graph=True)()
  torch_xla.compile(lambda: seen.append(torch_xla_private.execution_allowed()))()
  assert seen == [False, True] and torch_xla_private.execution_allowed()


def test_sharding_readers_without_spmd():
  t = torch.ones(2, device="xla")
  assert torch_xla_private.sharding_spec(t) == "" and torch_xla_private.op_sharding_of(t) is None


def test_hlo_text_round_trips_through_the_proto():
  lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((3,), "float32"))
  proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
  again = jax_private.hlo_proto_from_text(jax_private.hlo_text(proto))
  assert jax_private.cpu_compiled_memory(again).output_size_in_bytes == 12



def test_a_wrapped_cpu_lowering_rule_replaces_the_primitives_lowering():
  primitive = jax_lowering_private.conv_general_dilated_primitive()
  assert primitive is jax.lax.conv_general_dilated_p
  armed = []

  def wrapper(original):
    def rule(ctx, *operands, **params):
      if not armed:  # left installed after the test, it changes nothing
        return original(ctx, *operands, **params)
      zeros = lambda x, w: jax.numpy.zeros(ctx.avals_out[0].shape, x.dtype)  # noqa: E731
      return jax_lowering_private.lower_fun(zeros)(ctx, *operands)
    return rule

  jax_lowering_private.wrap_cpu_lowering(primitive, wrapper)
  x, w = jax.numpy.ones((1, 1, 3)), jax.numpy.ones((1, 1, 1))
  armed.append(True)
  replaced = jax.jit(lambda x, w: jax.lax.conv(x, w, (1,), "VALID"))(x, w)
  armed.clear()
  original = jax.jit(lambda x, w: jax.lax.conv(x, w, (1,), "VALID"))(x, w)
  assert replaced.tolist() == [[[0.0, 0.0, 0.0]]] and original.tolist() == [[[1.0, 1.0, 1.0]]]

def test_generic_lowering_rules_and_linalg_primitives_are_found():
  cholesky, lu = jax_lowering_private.linalg_primitives("cholesky", "lu")
  assert cholesky is jax.lax.linalg.cholesky_p and lu is jax.lax.linalg.lu_p
  assert callable(jax_lowering_private.generic_lowering_rule(cholesky))
  assert jax_lowering_private.generic_lowering_rule(jax_lowering_private.linalg_primitives("eig")[0]) is None


def test_jaxlibs_own_custom_call_targets_are_listed():
  targets = jax_lowering_private.jaxlib_custom_call_targets()
  spd = jax.ShapeDtypeStruct((3, 3), "float32")
  text = jax.jit(jax.numpy.linalg.cholesky).lower(spd).as_text()
  callback = jax.jit(lambda x: jax.pure_callback(lambda a: a, spd, x)).lower(spd).as_text()
  assert "lapack_spotrf_ffi" in targets and "lapack_spotrf_ffi" in text
  assert [t for t in targets if f"@{t}(" in callback] == ["xla_ffi_python_cpu_callback"]


def test_an_identity_primitive_is_linear_batches_and_lowers_as_told():
  seen = []

  def lower(ctx, x, *, tag):
    seen.append(tag)
    return [x]

  noted = jax_lowering_private.identity_primitive("compat_noted", lower,
                                         lambda dim, *, tag: {"tag": f"{tag}@{dim}"})
  assert jax.grad(lambda x: noted.bind(x * 2.0, tag="t") * 3.0)(1.0) == 6.0
  out = jax.jit(jax.vmap(lambda x: noted.bind(x, tag="t"), in_axes=1))(jax.numpy.ones((2, 3)))
  assert out.shape == (3, 2) and "t@1" in seen  # the operand batched at its axis 1


def test_a_jaxprs_function_takes_other_constants():
  w = jax.numpy.float32(2.0)
  closed = jax.make_jaxpr(lambda x: x * w + 1.0)(1.0)
  assert jaxpr_private.jaxpr_function(closed.jaxpr, closed.consts)(3.0)[0] == 7.0
  assert jaxpr_private.jaxpr_function(closed.jaxpr, [jax.numpy.float32(5.0)])(3.0)[0] == 16.0


_COMPAT_LIB = torch.library.Library("jbcompat", "DEF")
_COMPAT_LIB.define("doubled(Tensor x) -> Tensor")
_COMPAT_LIB.impl("doubled", lambda x: x * 2, "XLA")


@torch.library.custom_op("jbcompat::halved", mutates_args=())
def _halved(x: torch.Tensor) -> torch.Tensor:
  return x / 2


_halved.register_autograd(lambda ctx, grad: grad / 2)


def test_custom_op_readers():
  assert torch_dispatch_private.op_namespace(torch.ops.jbcompat.doubled) == "jbcompat"
  assert torch_dispatch_private.has_kernel("jbcompat::doubled", "XLA")
  assert not torch_dispatch_private.has_kernel("jbcompat::doubled", "CPU")
  x = torch.ones(2, device="xla")
  out = torch.ops.jbcompat.doubled.default.redispatch(torch_dispatch_private.dispatch_key_set("XLA"), x)
  assert out.cpu().tolist() == [2.0, 2.0]
  assert torch_dispatch_private.is_op(torch.ops.jbcompat.doubled) and not torch_dispatch_private.is_op(torch.mul)
  assert torch_dispatch_private.overload_of(torch.ops.jbcompat.doubled, (x,), {}) is (
      torch.ops.jbcompat.doubled.default)
  assert torch_dispatch_private.custom_op_definition("jbcompat::doubled") is None
  implementation, setup, backward = torch_dispatch_private.custom_op_parts(
      torch_dispatch_private.custom_op_definition("jbcompat::halved"))
  assert implementation(torch.ones(1)).item() == 0.5 and setup is None
  assert backward(None, torch.ones(1)).item() == 0.5


def test_torchax_operator_not_found_and_dispatch_mode():
  import torchax.tensor

  import torchax.config

  env = torchax_private.environment_class(print)(torchax.config.Configuration())  # not the shared one
  with pytest.raises(torchax_private.operator_not_found()):
    env.dispatch(torch.ops.jbcompat.doubled.default, (), (torchax.tensor.Tensor(
        jax.numpy.ones(2), env),), {})
  with torchax_private.dispatch_mode(env):
    t = torchax.tensor.Tensor(jax.numpy.ones(2), env)
    assert torch.ops.aten.mul.Tensor(t, t).jax().tolist() == [1.0, 1.0]


def test_functorch_transforms_active_is_seen_under_vmap():
  assert not torch_private.functorch_transforms_active()
  seen = []
  torch.vmap(lambda t: seen.append(torch_private.functorch_transforms_active()) or t)(torch.ones(2))
  assert seen == [True]


def test_torchax_renames_the_backend_through_torch_utils_at_import():
  import inspect

  import torchax

  source = inspect.getsource(torchax)
  assert "torch.utils.rename_privateuse1_backend(" in source
  assert "torch._register_device_module(" in source


def test_torchax_tensors_report_their_device_through_a_property():
  import torchax.tensor
  import torchax.view

  tracing.environment()
  for cls in (torchax.tensor.Tensor, torchax.view.View):
    assert isinstance(cls.__dict__["device"], property)
  with tracing.torch_code():
    tensor = tracing.to_torchax(jax.numpy.ones(2))
    assert tensor.device == torch_xla.device() and tensor[:1].device.type == "xla"


def test_torchax_tensors_answer_requires_grad_through_a_property():
  """Marked tensors (and views) read True here and False in torch's own code (its autograd
  recorded nothing on them); torch's flag, their own, stays False; setting False unmarks."""
  import torchax.tensor
  import torchax.view
  from torch.nn.modules.activation import _arg_requires_grad  # torch's own read of the flag

  from torch_xla_jaxbridge._core import grad_reads

  tracing.environment()
  for cls in (torchax.tensor.Tensor, torchax.view.View):
    assert isinstance(cls.__dict__["requires_grad"], property)
  flag = torch._C.TensorBase.__dict__["requires_grad"]
  with tracing.torch_code():
    tensor = tracing.to_torchax(jax.numpy.ones(2))
    assert not tensor.requires_grad
    grad_reads.mark(tensor)
    assert tensor.requires_grad and not _arg_requires_grad(tensor)
    assert not flag.__get__(tensor) and tensor.grad_fn is None
    tensor.requires_grad = False
    assert not tensor.requires_grad and not grad_reads.marked(tensor)


def test_torch_tracer_active_under_fake_functional_and_functorch_modes():
  from torch._subclasses.fake_tensor import FakeTensorMode
  from torch._subclasses.functional_tensor import FunctionalTensorMode

  assert not torch_private.torch_tracer_active()
  with FakeTensorMode():
    assert torch_private.torch_tracer_active()
  with FunctionalTensorMode():
    assert torch_private.torch_tracer_active()
  seen = []
  torch.func.grad(lambda x: (seen.append(torch_private.torch_tracer_active()), x.sum())[1])(
      torch.ones(2))
  assert seen == [True]


def test_tensor_version_counts_in_place_updates():
  t = torch.zeros(2)
  before = torch_private.tensor_version(t)
  t.mul_(2)
  t[0] = 1.0
  assert torch_private.tensor_version(t) == before + 2


def test_holds_pallas_kernel_finds_a_kernel_nested_in_a_jit():
  from jax.experimental import pallas as pl

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  kernel = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((8,), jax.numpy.float32),
                          interpret=True)
  nested = jax.make_jaxpr(lambda x: jax.jit(kernel)(x) + 1)(jax.numpy.ones(8))
  assert jax_private.holds_pallas_kernel(nested)
  assert not jax_private.holds_pallas_kernel(jax.make_jaxpr(lambda x: x * 2)(1.0))


def test_jaxpr_readers_for_layer_chains():
  def f(x):
    with jax.named_scope("outer_1"):
      with jax.named_scope("outer_2"):
        y = x * 2.0
    return jax.numpy.sin(y) + 1.0

  closed = jax.make_jaxpr(f)(1.0)
  mul, sin, add = closed.jaxpr.eqns
  assert jaxpr_private.outer_scope(mul, "outer_") == "outer_1"
  assert jaxpr_private.outer_scope(sin, "outer_") is None
  assert jaxpr_private.is_literal(mul.invars[1]) and not jaxpr_private.is_literal(mul.invars[0])
  assert jaxpr_private.is_jaxpr(closed) and jaxpr_private.jaxpr_consts(closed) == []
  assert not jaxpr_private.is_jaxpr(3)
  custom = jax.make_jaxpr(jax.nn.relu)(1.0).jaxpr.eqns[0]  # a custom_jvp_call with a function
  again = jax.make_jaxpr(jax.nn.relu)(2.0).jaxpr.eqns[0]
  assert jaxpr_private.function_code(custom.params["jvp_jaxpr_fun"]) == jaxpr_private.function_code(
      again.params["jvp_jaxpr_fun"])
  first_two = jaxpr_private.equations_function(closed.jaxpr.invars, sin.outvars, [mul, sin])
  assert float(first_two(0.25)[0]) == pytest.approx(float(jax.numpy.sin(0.5)))


def _recording(seen):
  """A dispatch mode that appends each op it sees to `seen`."""
  class Seen(torch_dispatch_private.dispatch_mode()):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
      seen.append(func)
      return func(*args, **(kwargs or {}))

  return Seen()


def test_dispatch_mode_sees_the_ops_a_meta_tensor_runs():
  seen = []
  with _recording(seen):
    (torch.ones(2, device="meta") * 2).sum()
  assert torch.ops.aten.mul.Tensor in seen and torch.ops.aten.sum.default in seen


def test_functional_of_in_place_names_torchs_functional_overload():
  assert torch_dispatch_private.functional_of_in_place(torch.ops.aten.masked_fill_.Scalar) is (
      torch.ops.aten.masked_fill.Scalar)
  assert torch_dispatch_private.functional_of_in_place(torch.ops.aten.add.Tensor) is None
  assert torch_dispatch_private.functional_of_in_place(torch.ops.aten.mm) is None  # a packet


def test_torchax_views_are_read_through_and_written_into():
  with tracing.torch_code():
    t = tracing.to_torchax(jax.numpy.arange(4.0).reshape(2, 2))
    row = t[1]
    assert isinstance(row, torchax_private.view_type())
    assert torchax_private.view_source(row) is t and torchax_private.view_source(t) is None
    doubled = torchax_private.view_reading_through(row, lambda a: a * 2)
    assert doubled.jax().tolist() == [4.0, 6.0]
    torchax_private.write_into(doubled, tracing.to_torchax(jax.numpy.zeros(2)))
    assert t.jax().tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_dynamo_compiling_is_true_only_in_code_dynamo_traces():
  compiled = torch.compile(lambda x: x + 1 if torch_private.dynamo_compiling() else x - 1,
                           backend="eager")
  assert compiled(torch.zeros(1)).item() == 1.0 and not torch_private.dynamo_compiling()


def test_modes_disabled_hides_an_active_dispatch_mode():
  seen = []
  with _recording(seen):
    torch.ones(2, device="meta").neg()
    count = len(seen)
    with torch_dispatch_private.modes_disabled():
      torch.ones(2, device="meta").neg()
    assert len(seen) == count
    torch.ones(2, device="meta").neg()  # the mode is back after the block
  assert len(seen) > count


def test_environment_class_draws_with_next_key_where_torchax_splits():
  import torchax.config

  advanced = []

  def next_key(key):
    advanced.append(key)
    return jax.random.fold_in(key, 7)

  env = torchax_private.environment_class(print, next_key)(torchax.config.Configuration())
  first = torchax_private.current_key(env)
  drawn = env.get_and_rotate_prng_key()  # what torchax's random ops call before each draw
  assert drawn is first and advanced == [first]
  assert (jax.random.key_data(torchax_private.current_key(env)) ==
          jax.random.key_data(jax.random.fold_in(first, 7))).all()
  seeded = env.get_and_rotate_prng_key(torch.Generator().manual_seed(3))  # torchax's own way
  assert len(advanced) == 1 and seeded is not None
