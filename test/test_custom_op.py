"""jb.jax_op: a JAX function as a torch custom op on CPU and XLA tensors, under torch.compile."""
import jax
import jax.numpy as jnp
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._interop import custom_op

dense_tanh = jb.jax_op(lambda x, w: jnp.tanh(x @ w), name="test_dense_tanh")
split_stats = jb.jax_op(lambda x: (x.mean(axis=-1), x.max(axis=-1), jnp.argmax(x, axis=-1)),
                        name="test_jb::split_stats")
one_tuple = jb.jax_op(lambda x: (x * 2,), name="test_one_tuple")
gather_rows = jb.jax_op(lambda table, idx: table[idx] * 2, name="test_gather_rows")


def torch_dense_tanh(x, w):
  return torch.tanh(x @ w)


def leaves(*shapes):
  torch.manual_seed(0)
  return [torch.randn(*s, requires_grad=True) for s in shapes]


def grads_of(fn, tensors):
  tensors = [t.detach().clone().requires_grad_() for t in tensors]
  out = fn(*tensors)
  out.square().sum().backward()
  return out.detach(), [t.grad for t in tensors]


def test_cpu_forward_and_grads_match_torch():
  x, w = leaves((4, 3), (3, 5))
  out, grads = grads_of(dense_tanh, (x, w))
  ref, ref_grads = grads_of(torch_dense_tanh, (x, w))
  torch.testing.assert_close(out, ref)
  for g, r in zip(grads, ref_grads):
    torch.testing.assert_close(g, r)


def test_xla_forward_and_grads_match_torch_as_one_graph_node(dev):
  x, w = leaves((4, 3), (3, 5))
  xx, ww = (t.detach().to(dev).requires_grad_() for t in (x, w))
  out = dense_tanh(xx, ww)
  ir = torch_xla._XLAC._get_xla_tensors_text([out])
  assert ir.count("xla::jaxbridge.test_dense_tanh") == 1 and "tanh" not in ir.replace(
      "test_dense_tanh", "")
  out.square().sum().backward()
  ref, ref_grads = grads_of(torch_dense_tanh, (x, w))
  torch.testing.assert_close(out.detach().cpu(), ref)
  torch.testing.assert_close(xx.grad.cpu(), ref_grads[0])
  torch.testing.assert_close(ww.grad.cpu(), ref_grads[1])


def test_opcheck_passes():
  x, w = leaves((4, 3), (3, 5))
  torch.library.opcheck(dense_tanh.op, ([x, w],))
  torch.library.opcheck(split_stats.op, ([x],))


def test_tuple_outputs_and_integer_outputs():
  (x,) = leaves((4, 6))
  mean, top, index = split_stats(x)
  torch.testing.assert_close(mean, x.mean(-1))
  assert torch.equal(index, x.argmax(-1)) and index.dtype == torch.int32
  (mean + top).sum().backward()  # the integer output takes no gradient
  ref = x.detach().clone().requires_grad_()
  (ref.mean(-1) + ref.max(-1).values).sum().backward()
  torch.testing.assert_close(x.grad, ref.grad)
  (doubled,) = one_tuple(x)  # a one-element tuple stays a tuple
  torch.testing.assert_close(doubled, x * 2)


def test_integer_inputs_get_no_gradient():
  (table,) = leaves((5, 3))
  idx = torch.tensor([4, 0, 4], dtype=torch.int32)
  gather_rows(table, idx).sum().backward()
  expected = torch.zeros(5, 3)
  expected[0], expected[4] = 2, 4
  torch.testing.assert_close(table.grad, expected)


@pytest.mark.parametrize("backend", [  # inductor: a C++ build, 60-115 s (make slow)
    "eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow), "jaxbridge"])
def test_fullgraph_compile_matches_eager(backend):
  torch._dynamo.reset()
  x, w = leaves((4, 3), (3, 5))
  compiled = torch.compile(lambda a, b: dense_tanh(a, b) * 2, fullgraph=True, backend=backend)
  out, grads = grads_of(compiled, (x, w))
  ref, ref_grads = grads_of(lambda a, b: torch_dense_tanh(a, b) * 2, (x, w))
  torch.testing.assert_close(out, ref)
  for g, r in zip(grads, ref_grads):
    torch.testing.assert_close(g, r)


def test_dynamo_sees_one_node_and_dynamic_shapes_do_not_recompile():
  torch._dynamo.reset()
  graphs = []

  def record(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

  w = torch.randn(3, 5)
  compiled = torch.compile(lambda a: dense_tanh(a, w), fullgraph=True, dynamic=True,
                           backend=record)
  for rows in (2, 3, 7):
    torch.testing.assert_close(compiled(torch.ones(rows, 3)), torch_dense_tanh(
        torch.ones(rows, 3), w))
  assert len(graphs) == 1
  calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
  assert [n.target for n in calls if n.target is dense_tanh.op] == [dense_tanh.op]
  assert not any("jax" in str(n.target) and n.target is not dense_tanh.op for n in calls)
  out_rows = [n for n in calls if n.target is dense_tanh.op][0].meta["example_value"][0].shape[0]
  assert isinstance(out_rows, torch.SymInt)  # from jax.eval_shape, symbolically


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dynamic_shapes_train_with_one_graph(backend):
  torch._dynamo.reset()
  torch._dynamo.utils.counters.clear()
  (w,) = leaves((3, 5))
  compiled = torch.compile(lambda a, b: dense_tanh(a, b).sum(), fullgraph=True, dynamic=True,
                           backend=backend)
  for rows in (2, 3, 7):
    x = torch.randn(rows, 3, requires_grad=True)
    compiled(x, w).backward()
    ref = x.detach().clone().requires_grad_()
    torch_dense_tanh(ref, w.detach()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
  assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_cpu_kernel_reads_tensor_memory_without_copy():
  t = torch.arange(16, dtype=torch.float32)
  array = custom_op._cpu_to_jax(jax, t)
  assert array.unsafe_buffer_pointer() == t.data_ptr()


def test_inside_bridged_code_the_function_is_inlined(dev):
  x, w = leaves((4, 3), (3, 5))
  bridged = jb.bridge(lambda a, b: dense_tanh(a, b).sum(-1))
  xx, ww = (t.detach().to(dev).requires_grad_() for t in (x, w))
  out = bridged(xx, ww)
  out.sum().backward()
  torch.testing.assert_close(out.detach().cpu(), torch_dense_tanh(x, w).sum(-1))
  (ref_grad,) = torch.autograd.grad(torch_dense_tanh(x, w).sum(), w)
  torch.testing.assert_close(ww.grad.cpu(), ref_grad)


def test_bad_inputs_say_what_to_do():
  with pytest.raises(jb.errors.BadArgumentError, match="takes tensors only"):
    dense_tanh(torch.ones(2, 3), 2.0)
  with pytest.raises(jb.errors.BadArgumentError, match="already registered"):
    jb.jax_op(jnp.sin, name="test_dense_tanh")
  with pytest.raises(jb.errors.BadArgumentError, match="not a valid op name"):
    jb.jax_op(jnp.sin, name="has space")
  returns_dict = jb.jax_op(lambda x: {"y": x}, name="test_returns_dict")
  with pytest.raises(jb.errors.BadArgumentError, match="returns an array or a tuple"):
    returns_dict(torch.ones(2))
