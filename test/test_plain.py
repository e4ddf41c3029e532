"""One definition of a plain value, used by call_jax's static keys, the bridge's structure key and
the layer-stack identity check; the one 64-bit rule."""
import enum

import numpy as np
import pytest
import torch

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._core import dtypes, modules, plain, structure_keys


class Mode(enum.Enum):
  A = 1
  B = 2


@pytest.mark.parametrize("a, b", [
    (1, 1.0), (1, True), ((1, 2), [1, 2]), ((1, 2), (2, 1)), (None, 0), (Mode.A, Mode.B),
    (torch.float32, torch.bfloat16), ({"k": (1,)}, {"k": (2,)}), (((1,), 2), ((1,), 3)),
    (torch.Size([2]), (2,)), ("a", b"a")])
def test_keys_tell_values_apart(a, b):
  assert plain.key(a) != plain.key(b)
  assert plain.key(a) == plain.key(a)


def test_not_plain_names_the_value():
  with pytest.raises(plain.NotPlain) as info:
    plain.key((1, object()))
  assert type(info.value.value) is object


def test_static_keys_of_numpy_and_hashable_objects():
  assert plain.static_key(np.arange(3)) == plain.static_key(np.arange(3))
  assert plain.static_key(np.arange(3)) != plain.static_key(np.arange(3) + 1)
  marker = object()
  assert plain.static_key(marker) == (object, marker)
  with pytest.raises(plain.NotPlain):
    plain.static_key(bytearray(b"x"))


class Dilated(torch.nn.Module):
  """A WaveNet/TCN layer: every layer has the same parameter shapes, not the same dilation."""

  def __init__(self, channels, dilation):
    super().__init__()
    self.conv = torch.nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)

  def forward(self, x):
    return x + torch.tanh(self.conv(x))


@pytest.mark.parametrize("stack", [lambda layers, x: jb.scan_layers(layers, x),
                                   lambda layers, x: jb.StackedLayers(layers)(x)])
def test_a_dilated_stack_is_refused_with_the_attribute_named(dev, stack):
  layers = [Dilated(4, d).to(dev) for d in (1, 2, 4, 8)]
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"layers\[1\] 'conv.dilation' is \(2,\), but in layers\[0\] it is "
                           r"\(1,\).*jb.BridgeModule"):
    stack(layers, torch.ones(1, 4, 16, device=dev))


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "act", None), lambda m: setattr(m, "mode", Mode.B),
    lambda m: setattr(m, "dtype", torch.bfloat16), lambda m: setattr(m, "shape", (2, (1, 3))),
    lambda m: setattr(m, "_private_scale", 3.0), lambda m: setattr(m, "fn", torch.sigmoid)])
def test_any_attribute_that_differs_is_reported(change):
  class Layer(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.lin = torch.nn.Linear(2, 2)
      self.act, self.mode, self.dtype, self.shape = "gelu", Mode.A, torch.float32, (2, (1, 2))
      self._private_scale, self.fn = 1.0, torch.tanh

  first, other = Layer(), Layer()
  assert modules.attribute_differences(first, other) == []
  change(other)
  assert len(modules.attribute_differences(first, other)) == 1
  assert structure_keys.structure_key(first) != structure_keys.structure_key(other) or (
      structure_keys.structure_key(first) is None)


def test_identical_layers_with_shared_objects_pass():
  config = object()
  layers = [torch.nn.Linear(2, 2) for _ in range(2)]
  for layer in layers:
    layer.config = config  # the same object: the same computation
  assert modules.attribute_differences(*layers) == []


@pytest.mark.parametrize("kinds, wide", [
    ([torch.float32, torch.int32, torch.complex64], False), ([torch.float64], True),
    ([torch.int64], True), ([torch.complex128], True), ([np.dtype("uint64")], True),
    ([np.dtype("complex64"), np.dtype("float16")], False)])
def test_the_64_bit_rule(kinds, wide):
  assert dtypes.needs_x64(kinds) is wide
