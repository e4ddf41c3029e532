"""jb.dlpack: zero copy proven by data pointers and by mutation visibility; the unsafe cases."""
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb


def xla_pointer(t):
  return torch_xla._XLAC._unsafe_buffer_pointer(t)


def test_cpu_to_xla_shares_memory(dev):
  cpu = torch.arange(32, dtype=torch.float32)
  xla = jb.dlpack.cpu_to_xla(cpu)
  assert xla.is_xla and xla_pointer(xla) == cpu.data_ptr()
  cpu.mul_(2)  # visible through the XLA tensor: one buffer
  assert torch.equal(xla.cpu(), torch.arange(32, dtype=torch.float32) * 2)


def test_xla_to_cpu_and_to_jax_share_memory(dev):
  xla = torch.arange(16, dtype=torch.float32, device=dev) * 3  # pending work: computed first
  cpu = jb.dlpack.xla_to_cpu(xla)
  array = jb.dlpack.xla_to_jax(xla)
  assert cpu.data_ptr() == xla_pointer(xla) == array.unsafe_buffer_pointer()
  cpu.add_(1)
  np.testing.assert_array_equal(np.asarray(array), np.arange(16) * 3 + 1)


def test_jax_to_xla_shares_memory(dev):
  array = jnp.arange(8, dtype=jnp.float32) + 1
  xla = jb.dlpack.jax_to_xla(array)
  assert xla_pointer(xla) == array.unsafe_buffer_pointer()
  assert xla.cpu().tolist() == list(range(1, 9))


def test_non_contiguous_is_copied_with_a_warning(dev):
  base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
  with pytest.warns(UserWarning, match="not contiguous; it was copied"):
    xla = jb.dlpack.cpu_to_xla(base.t())
  assert torch.equal(xla.cpu(), base.t())  # right values (upstream's are silently wrong)


def test_misaligned_view_is_copied_with_a_note(dev):
  base = torch.arange(20, dtype=torch.float32)
  with pytest.warns(UserWarning, match="not 64-byte aligned .* storage offset 1"):
    xla = jb.dlpack.cpu_to_xla(base[1:])
  assert torch.equal(xla.cpu(), base[1:])


def test_requires_grad_is_detached(dev):
  cpu = torch.ones(4, requires_grad=True)
  xla = jb.dlpack.cpu_to_xla(cpu)
  assert not xla.requires_grad and xla_pointer(xla) == cpu.data_ptr()
  back = jb.dlpack.xla_to_cpu(torch.ones(4, device=dev, requires_grad=True))
  assert not back.requires_grad


def test_wrong_inputs_are_named(dev):
  with pytest.raises(jb.errors.BadArgumentError, match="xla_to_jax: expected an XLA tensor, got "
                     "cpu; use cpu_to_xla"):
    jb.dlpack.xla_to_jax(torch.ones(2))
  with pytest.raises(jb.errors.BadArgumentError, match="cpu_to_xla: expected a CPU tensor, got xla"):
    jb.dlpack.cpu_to_xla(torch.ones(2, device=dev))
  with pytest.raises(jb.errors.BadArgumentError, match="jax_to_xla: expected a jax.Array"):
    jb.dlpack.jax_to_xla(np.ones(2))


# --- to_cpu / to_xla: the moves inside autograd ---------------------------------------------------


def test_to_cpu_shares_memory_forward_and_backward(dev):
  x = (torch.arange(8, dtype=torch.float32, device=dev) * 2).requires_grad_()  # pending work
  cpu = jb.dlpack.to_cpu(x)
  assert cpu.device.type == "cpu" and cpu.requires_grad
  assert cpu.data_ptr() == xla_pointer(x)  # forward: one buffer
  grads = {}
  cpu.register_hook(lambda g: grads.setdefault("cpu", g))
  x.register_hook(lambda g: grads.setdefault("xla", g))
  (cpu * torch.arange(8, dtype=torch.float32)).sum().backward()
  assert grads["xla"].is_xla and xla_pointer(grads["xla"]) == grads["cpu"].data_ptr()  # backward
  torch.testing.assert_close(x.grad.cpu(), torch.arange(8, dtype=torch.float32))


def test_to_xla_shares_memory_forward_and_backward(dev):
  w = torch.arange(8, dtype=torch.float32, requires_grad=True)
  h = w * 3
  xla = jb.dlpack.to_xla(h)
  assert xla.is_xla and xla.requires_grad and xla_pointer(xla) == h.data_ptr()
  grads = {}
  xla.register_hook(lambda g: grads.setdefault("xla", g))
  h.register_hook(lambda g: grads.setdefault("cpu", g))
  (xla * torch.arange(8, dtype=torch.float32, device=dev)).sum().backward()
  assert grads["cpu"].device.type == "cpu"
  assert grads["cpu"].data_ptr() == xla_pointer(grads["xla"])  # the XLA gradient, computed first
  torch.testing.assert_close(w.grad, torch.arange(8, dtype=torch.float32) * 3)


def test_requires_grad_propagates(dev):
  assert not jb.dlpack.to_cpu(torch.ones(2, device=dev)).requires_grad
  assert not jb.dlpack.to_xla(torch.ones(2)).requires_grad
  leaf = torch.ones(2, requires_grad=True)
  assert jb.dlpack.to_cpu(jb.dlpack.to_xla(leaf)).requires_grad
  with torch.no_grad():
    assert not jb.dlpack.to_xla(leaf).requires_grad


def test_non_contiguous_gradient_is_copied_silently_with_right_values(dev):
  a = torch.randn(3, 4)
  weight = torch.randn(4, 3)
  xla = a.to(dev).requires_grad_()
  grads = {}
  cpu = jb.dlpack.to_cpu(xla)
  cpu.register_hook(lambda g: grads.setdefault("cpu", g))
  xla.register_hook(lambda g: grads.setdefault("xla", g))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # autograd chose the layout: no warning
    (cpu.t() * weight).sum().backward()
  assert not grads["cpu"].is_contiguous()
  assert xla_pointer(grads["xla"]) != grads["cpu"].data_ptr()  # made contiguous: a copy
  ref = a.clone().requires_grad_()
  (ref.t() * weight).sum().backward()
  torch.testing.assert_close(xla.grad.cpu(), ref.grad)


def test_to_xla_copies_a_non_contiguous_input_with_a_warning_and_keeps_its_gradient(dev):
  w = torch.randn(3, 4, requires_grad=True)
  with pytest.warns(UserWarning, match="to_xla: the tensor is not contiguous; it was copied"):
    xla = jb.dlpack.to_xla(w.t())
  (xla * torch.arange(12.0, device=dev).reshape(4, 3)).sum().backward()
  torch.testing.assert_close(w.grad, torch.arange(12.0).reshape(4, 3).t())


def _mnist_batch():
  torch.manual_seed(0)
  return torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))


def _mnist_halves():
  torch.manual_seed(1)
  return (torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU()),
          torch.nn.Linear(64, 10))


def _train(first, second, move, images, labels, steps=3):
  """Losses and every parameter gradient of `steps` SGD steps of second(move(first(images)))."""
  params = list(first.parameters()) + list(second.parameters())
  optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
  losses, grads = [], []
  for _ in range(steps):
    for opt in optimizers:
      opt.zero_grad()
    logits = second(move(first(images)))
    loss = torch.nn.functional.cross_entropy(logits, labels.to(logits.device))
    loss.backward()
    losses.append(loss.detach().cpu())
    grads.append([p.grad.cpu() for p in params])
    for opt in optimizers:
      opt.step()
    torch_xla.sync()
  return losses, grads


def _assert_same_training(run, ref):
  for loss, ref_loss in zip(run[0], ref[0]):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for step_grads, ref_grads in zip(run[1], ref[1]):
    assert len(step_grads) == len(ref_grads) == 4
    for grad, ref_grad in zip(step_grads, ref_grads):
      torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_mnist_shaped_model_xla_half_then_cpu_half_trains_like_all_cpu(dev):
  images, labels = _mnist_batch()
  ref = _train(*_mnist_halves(), lambda h: h, images, labels)
  first, second = _mnist_halves()
  run = _train(first.to(dev), second, jb.dlpack.to_cpu, images.to(dev), labels)
  assert all(p.grad.is_xla for p in first.parameters())  # the XLA half was trained
  assert ref[0][2] < ref[0][0]
  _assert_same_training(run, ref)


def test_mnist_shaped_model_cpu_half_then_xla_half_trains_like_all_cpu(dev):
  images, labels = _mnist_batch()
  ref = _train(*_mnist_halves(), lambda h: h, images, labels)
  first, second = _mnist_halves()
  run = _train(first, second.to(dev), jb.dlpack.to_xla, images, labels)
  assert all(p.grad.device.type == "cpu" for p in first.parameters())
  _assert_same_training(run, ref)


def test_gradients_flow_through_a_cpu_xla_cpu_sandwich(dev):
  torch.manual_seed(2)
  layers = [torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)]
  x = torch.randn(5, 8, requires_grad=True)
  ref_x = x.detach().clone().requires_grad_()
  ref_loss = layers[2](torch.tanh(layers[1](layers[0](ref_x)))).square().mean()
  ref_loss.backward()
  ref_grads = [ref_x.grad] + [p.grad.clone() for m in layers for p in m.parameters()]
  for m in layers:
    m.zero_grad()
  layers[1].to(dev)
  middle = jb.dlpack.to_cpu(torch.tanh(layers[1](jb.dlpack.to_xla(layers[0](x)))))
  loss = layers[2](middle).square().mean()
  loss.backward()
  grads = [x.grad] + [p.grad.cpu() for m in layers for p in m.parameters()]
  torch.testing.assert_close(loss, ref_loss)
  assert len(grads) == len(ref_grads) == 7
  for grad, ref_grad in zip(grads, ref_grads):
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_second_derivative_moves_too(dev):
  v = torch.tensor([1.0, 2.0], requires_grad=True)
  y = jb.dlpack.to_cpu(jb.dlpack.to_xla(v) ** 3).sum()
  (grad,) = torch.autograd.grad(y, v, create_graph=True)  # 3 v^2
  (second,) = torch.autograd.grad(grad.sum(), v)  # 6 v
  torch.testing.assert_close(grad.detach(), torch.tensor([3.0, 12.0]))
  torch.testing.assert_close(second, torch.tensor([6.0, 12.0]))


def test_in_place_change_of_a_shared_cpu_side_is_refused_in_backward(dev):
  w = torch.randn(4, 4, device=dev, requires_grad=True)
  h = torch.relu(torch.randn(2, 4, device=dev) @ w)  # relu saves h; to_cpu's result is h's buffer
  cpu = jb.dlpack.to_cpu(h)
  cpu.mul_(-1)  # would change what relu's backward reads
  with pytest.raises(jb.errors.MutationError, match="changed in place before backward.*clone"):
    cpu.sum().backward()
  v = torch.randn(2, 4, requires_grad=True)
  t = v * 2
  xla = jb.dlpack.to_xla(t) @ w  # matmul saves the XLA tensor on t's memory
  t.add_(1)
  with pytest.raises(jb.errors.MutationError, match="changed in place before backward"):
    xla.sum().backward()


def test_in_place_change_allowed_when_asked_for(dev):
  x, w = torch.randn(2, 4), torch.randn(4, 3)
  wx = w.to(dev).requires_grad_()
  cpu = jb.dlpack.to_cpu(x.to(dev) @ wx, check_in_place=False)  # matmul saves x and w, not h
  cpu.mul_(2)
  cpu.sum().backward()
  torch.testing.assert_close(wx.grad.cpu(), x.t() @ torch.full((2, 3), 2.0))


def test_in_place_change_of_the_xla_side_leaves_the_cpu_side(dev):
  leaf = torch.ones(4, requires_grad=True)
  cpu = leaf * 1
  xla = jb.dlpack.to_xla(cpu)
  xla.mul_(3)  # a new XLA buffer: the CPU tensor keeps its values, and no error in backward
  xla.sum().backward()
  torch_xla.sync()
  assert torch.equal(cpu, torch.ones(4)) and torch.equal(xla.detach().cpu(), torch.full((4,), 3.0))
  torch.testing.assert_close(leaf.grad, torch.full((4,), 3.0))


def test_moves_name_wrong_inputs(dev):
  with pytest.raises(jb.errors.BadArgumentError, match="to_cpu: expected an XLA tensor, got cpu; "
                     "use to_xla"):
    jb.dlpack.to_cpu(torch.ones(2))
  with pytest.raises(jb.errors.BadArgumentError, match="to_xla: expected a CPU tensor, got xla"):
    jb.dlpack.to_xla(torch.ones(2, device=dev))
