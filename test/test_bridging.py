"""bridge / BridgeModule / assume_pure against eager CPU PyTorch: outputs and every gradient."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import models
import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._bridge import auto
from parity import check_module, rel_err


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


def test_captured_tensor_is_an_input(dev):  # what cannot be lifted: test_captures.py
  outside = torch.tensor([1.0, 2.0, 3.0], device=dev)

  @jb.bridge
  def uses_outside(x):
    return x * outside

  assert uses_outside(torch.ones(3, device=dev)).cpu().tolist() == [1.0, 2.0, 3.0]
  outside = torch.tensor([4.0, 5.0, 6.0], device=dev)  # the cell's new tensor, not a constant
  assert uses_outside(torch.ones(3, device=dev)).cpu().tolist() == [4.0, 5.0, 6.0]


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


# --- randomness --------------------------------------------------------------------------------

def test_dropout_masks_fresh_reproducible_and_traced_once(dev):
  drop = jb.bridge(lambda x: F.dropout(x, 0.3, training=True), name="drop")
  x = torch.ones(4096, device=dev)
  torch_xla.manual_seed(7)
  outs = torch.stack([drop(x).cpu() for _ in range(16)])
  kept = (outs != 0).double()
  assert abs(kept.mean().item() - 0.7) < 0.01
  assert abs(kept.var().item() - 0.21) < 0.01
  torch.testing.assert_close(outs.unique(), torch.tensor([0.0, 1 / 0.7]))
  assert not torch.equal(kept[0], kept[1])
  torch_xla.manual_seed(7)
  assert torch.equal(drop(x).cpu(), outs[0])
  info = jb.cache_info()
  # the first call is traced with the constant key, learns the code draws, and runs again with
  # a fresh key (a cache hit): 17 calls, one trace, 17 hits
  assert (info.misses, info.hits) == (1, 17)


def test_dropout_backward_uses_the_forward_mask(dev):
  layer = jb.BridgeModule(torch.nn.Dropout(0.5))
  x = torch.ones(1000, device=dev, requires_grad=True)
  out = layer(x)
  out.sum().backward()
  torch.testing.assert_close(x.grad.cpu(), out.detach().cpu())


def test_torch_rand_inside_bridged_code(dev):
  noisy = jb.bridge(lambda x: x + torch.rand(x.shape) + torch.randn_like(x))
  x = torch.zeros(2000, device=dev)
  a, b = noisy(x).cpu(), noisy(x).cpu()
  assert not torch.equal(a, b)
  assert abs(a.mean().item() - 0.5) < 0.1 and abs(a.std().item() - (1 + 1 / 12) ** 0.5) < 0.1


def test_assume_pure_with_rng_seed_argument(dev):
  noisy = jb.assume_pure(lambda a: a + torch.randn_like(a), add_rng_seed_argument=True)
  x = torch.zeros(64, device=dev)
  same = [noisy(x, rng_seed=3).cpu() for _ in range(2)]
  other = noisy(x, rng_seed=torch.tensor(4, device=dev)).cpu()
  assert torch.equal(same[0], same[1]) and not torch.equal(same[0], other)
  assert jb.cache_info().misses == 1


def test_assume_pure_and_pure_module_match_eager(dev):
  def mlp(x, w):
    return torch.tanh(x @ w).sum()

  w = torch.randn(4, 3)
  wx = w.to(dev).requires_grad_()
  jb.assume_pure(mlp)(torch.ones(2, 4, device=dev), wx).backward()
  wr = w.clone().requires_grad_()
  mlp(torch.ones(2, 4), wr).backward()
  assert rel_err(wx.grad, wr.grad) < 1e-5
  check_module_type = jb.PureModule(torch.nn.Linear(4, 2).to(dev))
  assert isinstance(check_module_type, jb.BridgeModule)


# --- one trace, one node -----------------------------------------------------------------------

def ir_nodes(tensor):
  return [line for line in torch_xla._XLAC._get_xla_tensors_text([tensor]).splitlines()
          if "=" in line]


def test_eight_layers_trace_once_and_add_one_node_each(dev):
  torch.manual_seed(0)
  plain = [models.DecoderLayer().to(dev) for _ in range(8)]
  layers = [jb.BridgeModule(copy.deepcopy(layer)) for layer in plain]
  positions = torch.arange(8, device=dev)
  params = [p for layer in layers for p in layer.parameters()]
  optimizer = torch.optim.SGD(params, lr=0.01)
  torch_xla.sync()
  steps = 3  # enough to see the traces reused across steps
  for step in range(steps):
    h = torch.randn(2, 8, 32, device=dev)
    for layer in layers:
      h = layer(h, positions)
    if step == 0:
      bridged_ir = ir_nodes(h)
    h.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
  info = jb.cache_info()
  # two layer signatures (the first layer's input needs no grad), each one forward and one
  # backward trace, shared by the 8 identical layers over every step
  assert (info.misses, info.hits) == (4, steps * 8 * 2 - 4), info.retrace_reasons
  assert sum("xla::DecoderLayer_fwd(" in n for n in bridged_ir) == 8
  assert not any(op in n for n in bridged_ir for op in ("aten::mm", "aten::matmul", "aten::bmm"))
  h = torch.randn(2, 8, 32, device=dev)
  for layer in plain:
    h = layer(h, positions)
  plain_ir = ir_nodes(h)
  torch_xla.sync()
  assert len(bridged_ir) * 3 < len(plain_ir)


# --- errors ------------------------------------------------------------------------------------

def branchy(x):
  if x.sum() > 0:
    return x
  return -x


def uses_item(x):
  return x * x.max().item()


def uses_nonzero(x):
  return torch.nonzero(x)


def masks_by_value(x):
  return x[x > 0].sum()


@pytest.mark.parametrize("fn, line, hint", [
    (branchy, "if x.sum() > 0:", "y = torch.cond(x.sum() > 0, lambda x: <value if true>"),
    (uses_item, "return x * x.max().item()", "s = x.max()          # keep the value a tensor"),
    (uses_nonzero, "return torch.nonzero(x)", "y = torch.where(mask, x, 0)"),
    (masks_by_value, "return x[x > 0].sum()", "y = torch.where(mask, x, 0)"),
])
def test_data_dependent_control_flow_names_the_line(dev, fn, line, hint):
  with pytest.raises(jb.errors.DataDependentError) as caught:
    jb.bridge(fn, fallback=False)(torch.randn(5, device=dev))
  message = str(caught.value)
  assert message.startswith(f"{fn.__name__}: data-dependent Python control flow at ")
  assert "test_bridging.py:" in message and line in message
  assert hint in message and "docs/control_flow.md (torch.cond" in message


LEAKED = []


def test_leak_to_a_global_list_is_reported_at_the_call(dev):
  def leaky(x):
    y = x * 2
    LEAKED.append(y)
    return y

  with pytest.raises(jb.errors.LeakedTensorError, match=r"leaky_fwd: a tensor computed inside "
                     r"the traced function was kept outside it, in test_bridging.LEAKED"):
    jb.bridge(leaky, fallback=False)(torch.ones(3, device=dev))
  LEAKED.clear()


def test_leak_to_a_module_attribute_is_reported_at_the_call(dev):
  class Stash(torch.nn.Module):

    def forward(self, x):
      self.last = x * 3
      return self.last + 1

  with pytest.raises(jb.errors.LeakedTensorError, match=r"Stash_fwd: .* kept outside it, in "
                     r"Stash.last\. .*return it as an output"):
    jb.BridgeModule(Stash(), fallback=False)(torch.ones(3, device=dev))


def test_mutating_an_input_that_requires_grad_is_refused(dev):
  @jb.bridge(fallback=False)
  def scale_in_place(x):
    x.mul_(2)
    return x.sum()

  with pytest.raises(jb.errors.MutationError, match=r"scale_in_place: an argument that requires "
                     r"grad \(shape \(3,\)\) was modified in place.*x = x.clone\(\)"):
    scale_in_place(torch.ones(3, device=dev, requires_grad=True))


def test_unhashable_static_argument_is_named(dev):
  class Config:
    __hash__ = None

  with pytest.raises(jb.errors.BadArgumentError, match=r"scale: kwargs\['cfg'\]\['opts'\] is a "
                     r"Config, which is not hashable, so it cannot key the trace cache"):
    jb.bridge(lambda x, cfg: x * 2, name="scale", fallback=False)(torch.ones(2, device=dev),
                                                                  cfg={"opts": Config()})


def test_numpy_static_argument_keys_by_value(dev):
  """A NumPy array is a static value keyed by its contents, as in call_jax."""
  import numpy as np

  scale = jb.bridge(lambda x, factors: x * torch.tensor(factors, dtype=x.dtype), name="scale")
  x = torch.ones(2, device=dev)
  assert scale(x, np.array([2.0, 3.0])).cpu().tolist() == [2.0, 3.0]
  assert scale(x, np.array([2.0, 3.0])).cpu().tolist() == [2.0, 3.0]
  assert scale(x, np.array([4.0, 5.0])).cpu().tolist() == [4.0, 5.0]
  assert jb.cache_info()[:2] == (1, 2)


def test_missing_rng_seed_is_named(dev):
  noisy = jb.assume_pure(lambda a: a + torch.randn_like(a), add_rng_seed_argument=True)
  with pytest.raises(jb.errors.BadArgumentError, match="takes a keyword rng_seed="):
    noisy(torch.zeros(2, device=dev))


def test_code_without_randomness_draws_no_key(dev):
  layer = jb.BridgeModule(models.MLP().to(dev))
  layer(torch.randn(2, 8, device=dev))
  torch_xla.sync()
  out = layer(torch.randn(2, 8, device=dev))
  assert "aten::random" not in torch_xla._XLAC._get_xla_tensors_text([out])


def test_first_call_of_a_newly_random_signature_is_fresh(dev):
  def first_train_mask(seed):
    torch_xla.manual_seed(seed)
    layer = jb.BridgeModule(torch.nn.Dropout(0.5)).eval()
    x = torch.ones(256, device=dev)
    layer(x)  # eval: no randomness, so later calls would get the constant key
    return layer.train()(x).cpu()

  assert not torch.equal(first_train_mask(1), first_train_mask(2))


def test_module_state_is_read_fresh_after_structure_changes(dev):
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(dev)
  shared = torch.nn.Linear(4, 4).to(dev)
  model.append(shared)
  model.append(shared)  # the same submodule at two paths: its tensors go in once
  bridged = jb.BridgeModule(model)
  x = torch.randn(2, 4, device=dev)

  def expect_same():
    params, buffers, training = auto.bridge_of(model, bridged._settings).state.state()
    places = {f"{prefix}.{k}".lstrip("."): v for prefix, m in model.named_modules()
              for k, v in m._parameters.items()}
    assert list(params) == list(places) and all(params[n] is p for n, p in places.items())
    assert training == tuple(m.training for m in model.modules())
    torch.testing.assert_close(bridged(x).cpu(), model(x).cpu())

  expect_same()
  model[0].weight = torch.nn.Parameter(torch.zeros(4, 4, device=dev))  # a replaced parameter
  expect_same()
  model[1] = torch.nn.Linear(4, 4).to(dev)  # a replaced submodule
  expect_same()
  model[0].register_buffer("scale", torch.ones(4, device=dev))  # a new buffer
  assert "0.scale" in auto.bridge_of(model, bridged._settings).state.state()[1]
  model[2].eval()
  expect_same()
  reference = copy.deepcopy(model)
  bridged(x).square().sum().backward()
  reference(x).square().sum().backward()
  assert reference[2] is reference[3]
  for (name, p), r in zip(model.named_parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad.cpu(), r.grad.cpu(), msg=name)


def test_constant_key_is_device_data_so_the_first_step_graph_is_the_same(dev):
  from torch_xla_jaxbridge._core import rng

  key = rng.constant_key_data(dev)
  assert "xla::device_data" in torch_xla._XLAC._get_xla_tensors_text([key])


def test_inputs_kept_for_the_backward_are_not_returned_by_the_forward(dev):
  layer = jb.BridgeModule(torch.nn.Linear(4, 4).to(dev))
  x = torch.randn(2, 4, device=dev, requires_grad=True)
  out = layer(x)
  node = out.grad_fn
  # the weight and x, passed as they are, and nothing computed
  assert sorted(node.kept.inputs) == [1, 2] and len(node.saved_tensors) == node.inputs == 2
  out.sum().backward()
  torch.testing.assert_close(layer.weight.grad.cpu(), torch.ones(4, 1) * x.detach().cpu().sum(0))


def test_residuals_are_freed_by_the_backward_while_the_output_is_held(dev):
  """Saved as torch saves: held on `ctx` they would outlive the backward as long as anything
  holds the graph, and each would become an output of the step's program."""
  layer = jb.BridgeModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                              torch.nn.Linear(4, 4)).to(dev), remat="dots")
  out = layer(torch.randn(2, 4, device=dev))
  node = out.grad_fn
  assert len(node.saved_tensors) > node.inputs  # the first matmul's result is a computed one
  out.sum().backward()
  with pytest.raises(RuntimeError, match="freed"):
    node.saved_tensors


@pytest.mark.parametrize("update", ["in place", "jb.optim.SGD"])
def test_an_input_changed_before_the_backward_is_an_error_not_a_stale_gradient(dev, update):
  layer = jb.BridgeModule(torch.nn.Linear(4, 4).to(dev))
  x = torch.randn(2, 4, device=dev, requires_grad=True)
  layer(x).sum().backward()
  out = layer(x)
  if update == "in place":
    with torch.no_grad():
      layer.weight.mul_(2)
  else:
    jb.optim.SGD(layer.parameters(), lr=0.1).step()
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    out.sum().backward()


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 8), (2, 2, 3, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_on_inputs_of_any_rank(dev, shape, bias):
  check_module(torch.nn.Linear(8, 4, bias=bias), torch.randn(*shape), dev=dev)


def test_linear_weight_gradient_is_a_two_dimensional_matmul():
  _, backward = jb.lower_bridged(torch.nn.Linear(8, 4), torch.ones(2, 3, 8), platform="cpu")
  weight_grads = [line for line in backward.splitlines()
                  if "dot_general" in line and line.rstrip().endswith("-> tensor<4x8xf32>")]
  assert len(weight_grads) == 1, backward
  assert "(tensor<6x4xf32>, tensor<6x8xf32>)" in weight_grads[0]  # leading dims folded


class _SharedInput(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.q, self.k, self.v = (torch.nn.Linear(8, 4) for _ in range(3))

  def forward(self, x):
    return self.q(x) * self.k(x) + self.v(x)


def test_linears_sharing_an_input_keep_one_copy_of_it(dev):
  report = jb.saved_residuals(_SharedInput(), torch.ones(2, 3, 8, requires_grad=True))
  assert [r.shape for r in report.rows].count((6, 8)) == 1, str(report)
  check_module(_SharedInput(), torch.randn(2, 3, 8), dev=dev)


class _Attention(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.qkv = torch.nn.Linear(8, 24)

  def forward(self, x):
    q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
    scores = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) + scores @ v


def test_softmax_keeps_only_its_output_for_the_backward(dev):
  """As torch's softmax backward: no exponentials and no row sums among the residuals."""
  report = jb.saved_residuals(_Attention(), torch.ones(2, 5, 8, requires_grad=True))
  names = [r.name.split()[0] for r in report.rows]
  assert names.count("custom_jvp_call") == 2 and "exp" not in names, str(report)  # probabilities
  assert not [r for r in report.rows if r.shape[-1:] == (1,)], str(report)  # no row sums
  check_module(_Attention(), torch.randn(2, 5, 8), dev=dev)


def test_linear_forward_mode_derivative():
  import jax
  import numpy as np

  fn, params = jb.jaxify(torch.nn.Linear(8, 4))
  x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
  dx, dw = np.ones_like(x), np.full((4, 8), 0.5, np.float32)
  _, tangent = jax.jvp(lambda x, w: fn({**params, "weight": w}, x), (x, params["weight"]),
                       (dx, dw))
  np.testing.assert_allclose(tangent, dx @ np.asarray(params["weight"]).T + x @ dw.T, rtol=1e-5)


def test_a_tensor_passed_twice_is_one_tensor_in_the_trace(dev):
  """Eager code that updates `a` in place sees the update through `b`: so does the trace."""
  def bump_and_read(a, b):
    a.add_(1)
    return b * 1

  t = torch.zeros(2, device=dev)
  assert jb.bridge(bump_and_read)(t, t).cpu().tolist() == [1.0, 1.0]
  assert t.cpu().tolist() == [1.0, 1.0]
  w = torch.ones(2, device=dev, requires_grad=True)
  jb.bridge(lambda a, b: (a * b).sum())(w, w).backward()  # d(w.w)/dw = 2w
  assert w.grad.cpu().tolist() == [2.0, 2.0]


def test_bridged_code_sees_the_xla_device_of_its_inputs(dev):
  """Code that branches on the device type takes the branch it takes in plain torch_xla."""
  def scaled(x):
    assert x.device == dev and x[:1].device.type == "xla"
    return x * 2 if x.device.type == "xla" else x

  x = torch.arange(3.0, device=dev)
  assert jb.bridge(scaled)(x).cpu().tolist() == [0.0, 2.0, 4.0]


def test_as_strided_scatters_gradient_is_the_true_one_where_torchs_own_is_not(dev):
  """torch's autograd formula for `as_strided_scatter` with a strided view gives the input a
  gradient at the overwritten positions and none at the kept ones (its gradcheck fails; plain
  torch_xla inherits it); JAX's gradient of the scatter is the derivative. Checked against
  finite differences in float64."""
  torch.manual_seed(0)
  t, s = torch.randn(6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

  def loss(t, s):
    return torch.as_strided_scatter(t, s, (3,), (2,), 0).pow(2).sum()

  step = 1e-6 * torch.eye(6, dtype=torch.float64)
  numeric = torch.tensor([(loss(t + step[i], s) - loss(t - step[i], s)).item() / 2e-6
                          for i in range(6)], dtype=torch.float64)
  assert not torch.autograd.gradcheck(lambda t: loss(t, s), (t.clone().requires_grad_(),),
                                      raise_exception=False)
  moved = t.to(dev).requires_grad_()
  jb.bridge(loss, fallback=False)(moved, s.to(dev)).backward()
  torch.testing.assert_close(moved.grad.cpu(), numeric, rtol=1e-6, atol=1e-6)
