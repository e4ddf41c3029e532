"""Convolutions lowered channels-last for XLA:CPU: every kind keeps eager CPU torch's values and
gradients, the recomputation in a remat backward's conditional gets XLA:CPU's fast form, and JAX
code lowered outside the package keeps its own form."""
import copy
import re

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb
from parity import rel_err
from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._core import cpu_convolutions, runtime

CONVOLUTIONS = {
    "conv1d": (lambda: torch.nn.Conv1d(4, 6, 3, padding=1), (2, 4, 9)),
    "conv2d strided, dilated": (lambda: torch.nn.Conv2d(4, 6, 3, stride=2, padding=2,
                                                        dilation=2), (2, 4, 9, 9)),
    "conv2d grouped": (lambda: torch.nn.Conv2d(4, 6, 3, groups=2, padding=1), (2, 4, 7, 7)),
    "conv2d depthwise": (lambda: torch.nn.Conv2d(4, 4, 3, groups=4), (2, 4, 7, 7)),
    "conv2d 1x1": (lambda: torch.nn.Conv2d(4, 6, 1), (2, 4, 5, 5)),
    "conv3d": (lambda: torch.nn.Conv3d(2, 3, 2, padding=1), (2, 2, 4, 4, 4)),
    "conv_transpose2d": (lambda: torch.nn.ConvTranspose2d(4, 3, 3, stride=2, output_padding=1),
                         (2, 4, 5, 5)),
}


@pytest.mark.parametrize("kind", list(CONVOLUTIONS))
def test_values_and_gradients_match_eager_under_remat(dev, kind):
  make, shape = CONVOLUTIONS[kind]
  torch.manual_seed(0)
  ref = torch.nn.Sequential(make(), torch.nn.Tanh())
  model = copy.deepcopy(ref).to(dev)
  x = torch.randn(shape)
  ref_x, xla_x = x.clone().requires_grad_(), x.to(dev).requires_grad_()
  ref_out = ref(ref_x)
  ref_out.square().sum().backward()
  out = jb.checkpoint(model, xla_x)  # the backward recomputes in a conditional
  out.square().sum().backward()
  torch_xla.sync()
  assert rel_err(out, ref_out) < 1e-5
  assert rel_err(xla_x.grad, ref_x.grad) < 1e-5
  for p, r in zip(model.parameters(), ref.parameters()):
    assert rel_err(p.grad, r.grad) < 1e-5


def test_the_step_program_has_only_channels_last_convolutions(dev):
  model = torch.nn.Conv2d(4, 6, 3, padding=1).to(dev)
  x = torch.randn(2, 4, 7, 7, device=dev, requires_grad=True)
  jb.checkpoint(model, x).square().sum().backward()
  hlo = torch_xla_private.tensors_hlo_text([x.grad, model.weight.grad])
  labels = re.findall(r"convolution\(.*?dim_labels=(\S+?),", hlo)
  # the recomputed forward, the input's and the weight's gradients (the forward's output is
  # not asked for)
  assert len(labels) == 3 and set(labels) == {"b01f_01io->b01f"}, labels
  torch_xla.sync()


def test_convolutions_in_a_conditional_are_lowered_channels_last():
  jax = runtime.jax_module()

  def lowered_text():  # a new function each time: JAX caches a function's lowering
    def conv_in_cond(x, w):
      conv = lambda x: jax.lax.conv(x, w, (1, 1), "SAME")  # noqa: E731 (NCHW, OIHW)
      return jax.lax.cond(x.sum() > 0, conv, conv, x)

    avals = (jax.ShapeDtypeStruct((2, 4, 6, 6), "float32"),
             jax.ShapeDtypeStruct((3, 4, 3, 3), "float32"))
    return jax.jit(conv_in_cond).trace(*avals).lower(lowering_platforms=("cpu",)).as_text()

  with cpu_convolutions.channels_last():
    ours = lowered_text()
  theirs = lowered_text()
  # both branches: channels-last between transposes; outside the block, JAX's own form
  assert ours.count("[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]") == 2
  assert "[b, f, 0, 1]" not in ours
  assert theirs.count("[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]") == 2
