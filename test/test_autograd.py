"""bridge / BridgeModule / assume_pure against eager CPU PyTorch: outputs and every gradient."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import models
import torch_xla_jaxbridge as jb


def rel_err(actual, expected):
  actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
  return ((actual - expected).norm() / expected.norm().clamp_min(0.1)).item()  # ~0 grads: abs


def check_module(model, *inputs, dev, train=True, tol=1e-4):
  """Runs `model` eagerly on CPU and bridged on XLA; compares outputs, input and param grads."""
  torch.manual_seed(1)
  ref = copy.deepcopy(model).train(train)
  ref_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
  ref_out = ref(*ref_in)
  cotangent = torch.randn_like(ref_out)
  (ref_out * cotangent).sum().backward()

  on_device = copy.deepcopy(model).to(dev)
  if hasattr(on_device, "tie"):
    on_device.tie()
  bridged = jb.BridgeModule(on_device).train(train)
  xla_in = [x.detach().to(dev).requires_grad_(x.is_floating_point()) for x in inputs]
  out = bridged(*xla_in)
  (out * cotangent.to(dev)).sum().backward()
  torch_xla.sync()
  assert rel_err(out, ref_out) < tol
  for x, r in zip(xla_in, ref_in):
    if r.requires_grad:
      assert rel_err(x.grad, r.grad) < tol
  for (name, p), (_, r) in zip(bridged.named_parameters(), ref.named_parameters()):
    assert rel_err(p.grad, r.grad) < tol, name
  return bridged, ref


def test_mlp(dev):
  check_module(models.MLP(), torch.randn(6, 8), dev=dev)


@pytest.mark.parametrize("train", [True, False])
def test_convnet_with_batchnorm(dev, train):
  bridged, ref = check_module(models.ConvNet(), torch.randn(4, 3, 6, 6), dev=dev, train=train)
  for name, buf in ref.named_buffers():  # running stats written back as eager torch does
    torch.testing.assert_close(dict(bridged.named_buffers())[name].cpu(), buf, rtol=1e-5,
                               atol=1e-6)
  assert int(bridged.bn.num_batches_tracked.cpu()) == (1 if train else 0)


def test_layernorm_and_rmsnorm(dev):
  check_module(torch.nn.Sequential(torch.nn.LayerNorm(16), models.RMSNorm(16)),
               torch.randn(3, 5, 16), dev=dev)


def test_embedding_with_tied_weights(dev):
  bridged, ref = check_module(models.TiedLM(), torch.randint(0, 50, (3, 7)), dev=dev)
  assert bridged.out.weight is bridged.embed.weight
  assert len(list(bridged.parameters())) == len(list(ref.parameters()))


def test_decoder_layer_with_gqa_and_rotary(dev):
  check_module(models.DecoderLayer(), torch.randn(2, 8, 32), torch.arange(8), dev=dev)


def test_top2_mixture_of_experts(dev):
  check_module(models.MoE(), torch.randn(2, 6, 16), dev=dev)


@pytest.mark.parametrize("masked", [False, True])
def test_scaled_dot_product_attention(dev, masked):
  mask = torch.rand(6, 6) > 0.3 if masked else None

  def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

  q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
  ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
  ref = attend(*ref_in, mask)
  ref.sum().backward()
  xla_in = [t.to(dev).requires_grad_() for t in (q, k, v)]
  out = jb.bridge(attend)(*xla_in, None if mask is None else mask.to(dev))
  out.sum().backward()
  assert rel_err(out, ref) < 1e-4
  for x, r in zip(xla_in, ref_in):
    assert rel_err(x.grad, r.grad) < 1e-4


def test_partial_grads_and_kwargs_tensors(dev):
  @jb.bridge
  def affine(x, w, *, bias, scale=2.0):
    return (x @ w + bias) * scale

  x, w, b = torch.randn(4, 3), torch.randn(3, 2), torch.randn(2)
  xw, ww, wb = x.to(dev), w.to(dev).requires_grad_(), b.to(dev).requires_grad_()
  affine(xw, ww, bias=wb, scale=3.0).sum().backward()
  rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
  ((x @ rw + rb) * 3.0).sum().backward()
  assert xw.grad is None
  assert rel_err(ww.grad, rw.grad) < 1e-5 and rel_err(wb.grad, rb.grad) < 1e-5


def test_no_grad_path_keeps_no_residuals(dev):
  layer = jb.BridgeModule(models.MLP().to(dev))
  with torch.no_grad():
    out = layer(torch.randn(2, 8, device=dev))
  assert out.grad_fn is None
  ir = torch_xla._XLAC._get_xla_tensors_text([out])
  assert "xla::MLP_fwd(" in ir
  assert jb.cache_info().misses == 1


def test_input_mutation_is_written_back(dev):
  @jb.bridge
  def accumulate(total, x):
    total.add_(x)
    return x * 2

  total = torch.zeros(3, device=dev)
  out = accumulate(total, torch.ones(3, device=dev))
  accumulate(total, torch.ones(3, device=dev))
  assert total.cpu().tolist() == [2.0, 2.0, 2.0]
  assert out.cpu().tolist() == [2.0, 2.0, 2.0]


def test_captured_tensor_error(dev):
  outside = torch.ones(3, device=dev)

  @jb.bridge
  def uses_outside(x):
    return x * outside

  with pytest.raises(jb.errors.CapturedTensorError, match=r"uses_outside: a torch tensor that "
                     r"is not an argument .* used at .*test_autograd.py:\d+: return x \* outside"
                     r".*pass them in as arguments"):
    uses_outside(torch.ones(3, device=dev))


def test_attribute_forwarding_and_state_dict(dev):
  model = models.DecoderLayer().to(dev)
  bridged = jb.BridgeModule(model)
  assert bridged.attn.heads == 4 and bridged.attn is model.attn
  assert list(bridged.state_dict()) == list(model.state_dict())
  bridged.eval()
  assert not model.training and not model.attn.training
  optimizer = torch.optim.SGD(bridged.parameters(), lr=0.1)
  before = model.mlp.up_proj.weight.detach().clone()
  bridged(torch.randn(1, 4, 32, device=dev), torch.arange(4, device=dev)).sum().backward()
  optimizer.step()
  assert not torch.equal(model.mlp.up_proj.weight.detach().cpu(), before.cpu())
