"""jb.dlpack: zero copy proven by data pointers and by mutation visibility; the unsafe cases."""
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
