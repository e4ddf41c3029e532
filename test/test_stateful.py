"""stateful: argument objects holding tensors are passed as their state and written back."""
import types

import pytest
import torch

import torch_xla_jaxbridge as jb


class Memory:
  """A user's own stateful object: a list that grows and a counter written in place."""

  def __init__(self, device):
    self.items = []
    self.count = torch.zeros((), device=device)


def remember(memory, x):
  memory.items.append(x * 2)
  memory.count += 1
  return x + memory.count


def test_an_argument_object_is_updated_as_eager_code_would(dev):
  bridged = jb.bridge(remember)
  memory = Memory(dev)
  count = memory.count
  for step in range(3):
    out = bridged(memory, torch.full((2,), float(step), device=dev))
    assert out.cpu().tolist() == [step + step + 1.0] * 2
  assert [t.cpu().tolist() for t in memory.items] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
  assert memory.count is count and count.item() == 3  # the same tensor, updated in place
  assert jb.cache_info()[:2] == (0, 3)  # the list grew: a new structure each call
  assert "Memory passed as its state: 2 tensors" in jb.cache_info().retrace_reasons[-1]


def test_gradients_flow_through_tensors_the_object_receives(dev):
  memory = Memory(dev)
  x = torch.ones(2, device=dev, requires_grad=True)
  jb.bridge(remember)(memory, x)
  (memory.items[0] * 3).sum().backward()
  assert x.grad.cpu().tolist() == [6.0, 6.0]


class Config:
  scale = 3.0


def test_an_object_without_tensors_stays_a_static_value(dev):
  config = Config()
  scale = jb.bridge(lambda x, cfg: x * cfg.scale)
  assert scale(torch.ones(1, device=dev), config).cpu().tolist() == [3.0]
  assert vars(config) == {}  # not copied or written back


def test_an_object_nested_too_deep_is_named(dev):
  node = types.SimpleNamespace(value=torch.ones(1, device=dev))
  node.parent = node  # refers to itself
  with pytest.raises(jb.errors.BadArgumentError, match=r"argument args\[1\]: a SimpleNamespace "
                     r"holding a SimpleNamespace that nests objects more than 8 deep \(or refers "
                     r"to itself\).*use_cache=False"):
    jb.bridge(lambda x, n: x * n.value, fallback=False)(torch.ones(1, device=dev), node)


def test_a_tensor_held_twice_stays_one_tensor_in_the_trace(dev):
  """Eager code that updates `a` in place sees the update through `b`: so does the trace."""
  shared = torch.zeros(2, device=dev)
  holder = types.SimpleNamespace(a=shared, b=shared)

  def bump_and_read(h, x):
    h.a.add_(1)
    return x + h.b

  out = jb.bridge(bump_and_read)(holder, torch.ones(2, device=dev))
  assert out.cpu().tolist() == [2.0, 2.0]
  assert holder.a is shared and holder.b is shared and shared.cpu().tolist() == [1.0, 1.0]
