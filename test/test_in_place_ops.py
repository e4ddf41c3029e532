"""In-place ops inside bridged code write their result into the tensor they update, through a view
too (`buf[1].fill_(0)`), as plain torch_xla does: values and the caller's tensor after the call,
with no fallback, for ops that torchax converts by a copy or not at all."""
import warnings

import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb

OPS = {
    "fill_": lambda v: v.fill_(7.0), "zero_": lambda v: v.zero_(),
    "masked_fill_": lambda v: v.masked_fill_(v > 3, 0.0), "addcmul_": lambda v: v.addcmul_(v, v),
    "lerp_": lambda v: v.lerp_(torch.zeros_like(v), 0.5), "frac_": lambda v: v.mul_(0.3).frac_(),
    "index_fill_": lambda v: v.index_fill_(0, torch.tensor([0], device=v.device), 9.0),
    "neg_": lambda v: v.neg_(), "exp_": lambda v: v.exp_(), "abs_": lambda v: v.sub_(4).abs_(),
    "sqrt_": lambda v: v.sqrt_(), "floor_": lambda v: v.mul_(0.7).floor_(),
    "sigmoid_": lambda v: v.sigmoid_(), "log1p_": lambda v: v.log1p_(),
    "reciprocal_": lambda v: v.reciprocal_(), "cos_": lambda v: v.cos_(),
}
TARGETS = {"tensor": lambda b: b, "row": lambda b: b[1], "rows": lambda b: b[1:],
           "column": lambda b: b[1:, 1]}


def _updated(fn, op, target):
  def region(buf):
    OPS[op](TARGETS[target](buf))
    return buf.sum()

  buf = torch.arange(1.0, 10.0).reshape(3, 3).to("xla")
  out = fn(region)(buf)
  return out.cpu(), buf.cpu()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", OPS)
def test_an_in_place_op_writes_its_target_as_in_plain_torch_xla(op, target):
  plain_out, plain_buf = _updated(lambda f: f, op, target)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    out, buf = _updated(lambda f: jb.bridge(f, fallback=False), op, target)
  assert not torch.equal(plain_buf, torch.arange(1.0, 10.0).reshape(3, 3))  # it writes
  torch.testing.assert_close(buf, plain_buf)
  torch.testing.assert_close(out, plain_out)


def test_a_result_torch_cannot_cast_into_its_target_raises_torchs_error():
  """`int_tensor.exp_()`: torch refuses to write a float result into an integer tensor; the
  functional form's result is not truncated into it silently, the region falls back and plain
  torch_xla raises."""
  def region(buf):
    buf.exp_()
    return buf.sum()

  with pytest.raises(RuntimeError, match="can't be cast"):
    region(torch.arange(4).to("xla"))
  buf = torch.arange(4).to("xla")
  with pytest.warns(jb.errors.FallbackWarning, match="can't be cast"), \
       pytest.raises(RuntimeError, match="can't be cast"):
    jb.bridge(region)(buf)
  assert buf.cpu().tolist() == [0, 1, 2, 3]
  with pytest.raises(jb.errors.JaxTracingError, match="can't be cast"):
    jb.bridge(region, fallback=False)(buf)
