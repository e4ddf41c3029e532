"""scan_layers against the unrolled eager CPU model: outputs, gradients, remat, RNG, errors."""
import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch_xla

import models
import torch_xla_jaxbridge as jb
from parity import rel_err


def unrolled_vs_scanned(layers, x, dev, *, shared=(), carry_fn=None, unpack=False, **options):
  """Runs the stack unrolled on CPU and scanned on XLA (`options`: scan_layers' keywords);
  compares outputs, the input's and every parameter's gradients. `unpack`: the layers take a
  tuple carry as separate arguments."""
  ref_layers = [copy.deepcopy(l) for l in layers]
  ref_x = x.clone().requires_grad_()
  h = ref_x if carry_fn is None else carry_fn(ref_x)
  for layer in ref_layers:
    h = layer(*h, *shared) if unpack else layer(h, *shared)
  ref_out = h if carry_fn is None else h[0] + h[1].sum()
  ref_out.pow(2).sum().backward()

  xla_layers = [copy.deepcopy(l).to(dev) for l in layers]
  xla_x = x.to(dev).requires_grad_()
  start = xla_x if carry_fn is None else carry_fn(xla_x)
  out = jb.scan_layers(xla_layers, start, shared_args=tuple(s.to(dev) for s in shared),
                       **options)
  out = out if carry_fn is None else out[0] + out[1].sum()
  out.pow(2).sum().backward()
  torch_xla.sync()
  assert rel_err(out, ref_out) < 1e-4
  assert rel_err(xla_x.grad, ref_x.grad) < 1e-4
  for i, (a, b) in enumerate(zip(xla_layers, ref_layers)):
    for (name, p), (_, r) in zip(a.named_parameters(), b.named_parameters()):
      assert rel_err(p.grad, r.grad) < 1e-4, (i, name)


def test_linear_stack(dev):
  unrolled_vs_scanned([torch.nn.Linear(8, 8) for _ in range(5)], torch.randn(3, 8), dev)


def test_decoder_layers_with_shared_positions(dev):
  unrolled_vs_scanned([models.DecoderLayer() for _ in range(3)], torch.randn(2, 8, 32), dev,
                      shared=(torch.arange(8),))


class WithAux(torch.nn.Module):
  """Takes and returns (hidden, aux): aux accumulates a per-layer statistic."""

  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(6, 6)

  def forward(self, carry):
    hidden, aux = carry
    hidden = torch.tanh(self.fc(hidden))
    return hidden, aux + hidden.mean(dim=-1)


def test_tuple_carry(dev):
  unrolled_vs_scanned([WithAux() for _ in range(4)], torch.randn(5, 6), dev,
                      carry_fn=lambda x: (x, torch.zeros(5, device=x.device)))


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch", "minimal",
                                   jb.Remat(save=("mlpwi",))])
def test_every_remat_preset_gives_the_same_gradients(dev, remat):
  unrolled_vs_scanned([models.DecoderLayer() for _ in range(2)], torch.randn(2, 8, 32), dev,
                      shared=(torch.arange(8),), remat=remat)


def test_randomness_differs_per_layer_and_per_call(dev):
  layers = [torch.nn.Dropout(0.5) for _ in range(2)]
  x = torch.ones(20000, device=dev)
  first = jb.scan_layers(layers, x).cpu()
  second = jb.scan_layers(layers, x).cpu()
  kept = (first != 0).double().mean().item()
  assert abs(kept - 0.25) < 0.02  # independent masks: 0.5 * 0.5 (one shared mask: 0.5)
  assert not torch.equal(first, second)


def test_keys_are_split_only_for_layers_that_draw_random_numbers(dev):
  x = torch.ones(4, 8, device=dev)
  plain = jb.scan_layers([torch.nn.Linear(8, 8).to(dev) for _ in range(3)], x)
  random = jb.scan_layers([torch.nn.Dropout(0.5) for _ in range(3)], x)
  assert "rng-bit-generator" not in torch_xla._XLAC._get_xla_tensors_hlo([plain])
  # the split into 3 keys (an unsafe_rbg split draws 10 rows of 4 words per key)
  assert "u32[30,4]" in torch_xla._XLAC._get_xla_tensors_hlo([random])


def test_traced_once_across_steps_and_depths_share_nothing_per_layer(dev):
  layers = [torch.nn.Linear(8, 8).to(dev) for _ in range(6)]
  optimizer = torch.optim.SGD([p for l in layers for p in l.parameters()], lr=0.1)
  for _ in range(3):
    jb.scan_layers(layers, torch.randn(2, 8, device=dev)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
  # forward, backward and the split of the stacked gradients: each traced once
  assert (jb.cache_info().misses, jb.cache_info().hits) == (3, 6)


def test_empty_stack_returns_the_input(dev):
  x = torch.ones(2, device=dev)
  assert jb.scan_layers([], x) is x


def test_mismatched_layers_name_the_first_difference(dev):
  layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
  with pytest.raises(jb.errors.BadValueError,
                     match=r"scan_layers: Shape mismatch: layers\[2\] 'weight' is parameter "
                     r"\(4, 8\) torch.float32, but in layers\[0\] it is parameter \(8, 8\)"):
    jb.scan_layers(layers, torch.ones(2, 8))
  with pytest.raises(ValueError, match=r"mismatched keys: layers\[1\] is a ReLU, layers\[0\] a "
                     r"Linear"):
    jb.scan_layers([torch.nn.Linear(2, 2), torch.nn.ReLU()], torch.ones(2, 2))


def test_buffer_updates_inside_a_scan_are_refused_not_dropped(dev):
  layers = [torch.nn.BatchNorm1d(4).to(dev) for _ in range(2)]
  with pytest.raises(jb.errors.MutationError, match=r"scan_layers: the layers update buffers "
                     r"\['num_batches_tracked', 'running_mean', 'running_var'\] in place"):
    jb.scan_layers(layers, torch.randn(3, 4, device=dev))
  eval_layers = [layer.eval() for layer in layers]
  out = jb.scan_layers(eval_layers, torch.ones(3, 4, device=dev))
  torch.testing.assert_close(out.cpu(), torch.ones(3, 4) / (1 + 1e-5), rtol=1e-4, atol=1e-4)


def test_a_stack_seen_before_reads_its_current_parameters(dev):
  layers = [torch.nn.Linear(4, 4) for _ in range(3)]
  x = torch.randn(2, 4)
  xla_layers = [copy.deepcopy(l).to(dev) for l in layers]
  jb.scan_layers(xla_layers, x.to(dev))
  # a new parameter object after the stack was first checked: read, and given its gradient
  layers[1].weight = torch.nn.Parameter(torch.randn(4, 4))
  xla_layers[1].weight = torch.nn.Parameter(layers[1].weight.detach().to(dev))
  jb.scan_layers(xla_layers, x.to(dev)).pow(2).sum().backward()
  h = x
  for layer in layers:
    h = layer(h)
  h.pow(2).sum().backward()
  assert rel_err(xla_layers[1].weight.grad, layers[1].weight.grad) < 1e-5
  xla_layers[2].weight = torch.nn.Parameter(torch.zeros(3, 4, device=dev))
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"layers\[2\] 'weight' is parameter \(3, 4\) torch.float32"):
    jb.scan_layers(xla_layers, x.to(dev))
  xla_layers[2].weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64, device=dev))
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"layers\[2\] 'weight' is parameter \(4, 4\) torch.float64"):
    jb.scan_layers(xla_layers, x.to(dev))
  xla_layers[2].weight = torch.nn.Parameter(torch.zeros(4, 4, device=dev))
  xla_layers[1].extra = torch.nn.Parameter(torch.zeros(4, device=dev))
  with pytest.raises(jb.errors.BadArgumentError,
                     match=r"layers\[1\] 'extra' is parameter \(4,\) torch.float32, but in "
                     r"layers\[0\] it is missing"):
    jb.scan_layers(xla_layers, x.to(dev))


def test_scanned_layers_are_not_kept_alive(dev):
  layers = [torch.nn.Linear(4, 4).to(dev) for _ in range(2)]
  jb.scan_layers(layers, torch.ones(2, 4, device=dev))
  second = weakref.ref(layers[1])
  del layers
  gc.collect()
  assert second() is None


def stacked_vs_unrolled(layers, x, dev, *, shared=(), remat=None):
  """StackedLayers of `layers` on XLA against the layers unrolled on CPU: output, input gradient
  and each layer's parameter gradient (a slice of the stacked gradient)."""
  stack = jb.StackedLayers(layers, remat=remat).to(dev)
  if hasattr(stack.layer, "tie"):
    stack.layer.tie()  # .to("xla") gives each name its own copy
  h = ref_x = x.clone().requires_grad_()
  for layer in layers:
    h = layer(h, *shared)
  h.pow(2).sum().backward()
  xla_x = x.to(dev).requires_grad_()
  out = stack(xla_x, *(s.to(dev) for s in shared))
  out.pow(2).sum().backward()
  torch_xla.sync()
  assert rel_err(out, h) < 1e-4
  assert rel_err(xla_x.grad, ref_x.grad) < 1e-4
  for name, p in stack.layer.named_parameters():
    assert p.shape[0] == len(layers)
    for i, layer in enumerate(layers):
      assert rel_err(p.grad[i], layer.get_parameter(name).grad) < 1e-4, (i, name)
  return stack


def test_stacked_layers_match_the_unrolled_linear_stack(dev):
  stack = stacked_vs_unrolled([torch.nn.Linear(8, 8) for _ in range(5)], torch.randn(3, 8), dev)
  assert [tuple(p.shape) for p in stack.parameters()] == [(5, 8, 8), (5, 8)]


@pytest.mark.parametrize("remat", [None, "full"])
def test_stacked_decoder_layers_with_shared_positions(dev, remat):
  stacked_vs_unrolled([models.DecoderLayer() for _ in range(3)], torch.randn(2, 8, 32), dev,
                      shared=(torch.arange(8),), remat=remat)


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "frozen"])
def test_stacked_layers_run_without_a_backward_with_shared_arguments(dev, how):
  """Evaluation (no grad mode, or no input requiring grad) with a tensor given to every layer:
  the eager stack's values, and nothing of the trace kept (it once raised LeakedTensorError)."""
  torch.manual_seed(0)
  layers = [models.DecoderLayer() for _ in range(3)]
  x, positions = torch.randn(2, 8, 32), torch.arange(8)
  expected = x
  with torch.no_grad():
    for layer in layers:
      expected = layer(expected, positions)
  stack = jb.StackedLayers(copy.deepcopy(layers)).to(dev)
  mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
  if mode is None:
    stack.requires_grad_(False)
  with mode() if mode else contextlib.nullcontext():
    out = stack(x.to(dev), positions.to(dev))
  assert rel_err(out.cpu(), expected) < 1e-5


class TiedPair(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    self.tie()

  def tie(self):
    self.b.weight = self.a.weight

  def forward(self, h):
    return self.b(torch.tanh(self.a(h)))


def test_stacked_layers_keep_a_tied_parameter_tied(dev):
  layers = [TiedPair() for _ in range(3)]
  on_cpu = jb.StackedLayers(layers)
  assert on_cpu.layer.b.weight is on_cpu.layer.a.weight
  stack = stacked_vs_unrolled(layers, torch.randn(2, 4), dev)
  assert len(list(stack.parameters())) == 3


def test_stacked_layers_train_with_one_parameter_per_name_and_trace_once(dev):
  stack = jb.StackedLayers([torch.nn.Linear(8, 8) for _ in range(6)]).to(dev)
  optimizer = jb.optim.SGD(stack.parameters(), lr=0.1)
  for _ in range(3):
    stack(torch.randn(2, 8, device=dev)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
  assert (jb.cache_info().misses, jb.cache_info().hits) == (3, 6)  # forward, backward, SGD
  entry = torch_xla._XLAC._get_xla_tensors_hlo([stack(torch.ones(2, 8, device=dev))])
  inputs = [line.split("=")[1].split("{")[0].strip() for line in
            entry.split("ENTRY")[1].splitlines() if "parameter(" in line]
  # the stacks (the input is a constant; the RNG key, never read, is not an input of the node)
  assert sorted(inputs) == ["f32[6,8,8]", "f32[6,8]"]


def test_stacked_layers_state_dict_has_the_layer_lists_keys(dev):
  layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
  stack = jb.StackedLayers(torch.nn.Linear(4, 4) for _ in range(3)).to(dev)
  stack.load_state_dict(layers.state_dict())
  assert list(stack.state_dict()) == list(layers.state_dict())
  x = torch.randn(2, 4)
  h = x
  for layer in layers:
    h = layer(h)
  assert rel_err(stack(x.to(dev)), h) < 1e-5
  other = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
  other.load_state_dict({k: v.cpu() for k, v in stack.state_dict().items()})
  assert all(torch.equal(other.state_dict()[k], v) for k, v in layers.state_dict().items())
  partial = {k: v for k, v in layers.state_dict().items() if k != "2.bias"}
  with pytest.raises(RuntimeError, match=r"StackedLayers: 1 of 3 layers miss 'bias' \(first: "
                     r"'2.bias'\)"):
    stack.load_state_dict(partial)


def test_stacked_layers_errors(dev):
  with pytest.raises(jb.errors.BadArgumentError, match="StackedLayers: layers is empty"):
    jb.StackedLayers([])
  with pytest.raises(jb.errors.BadArgumentError, match=r"StackedLayers: Shape mismatch: "
                     r"layers\[1\] 'weight' is parameter \(2, 4\) torch.float32"):
    jb.StackedLayers([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
  shared = torch.nn.Linear(4, 4)
  with pytest.raises(jb.errors.BadArgumentError, match=r"StackedLayers: layers\[2\] 'weight' is "
                     r"the same parameter as layers\[0\] 'weight'; stacking would give each "
                     r"layer its own copy"):
    jb.StackedLayers([shared, torch.nn.Linear(4, 4), shared])


class ThreeWay(torch.nn.Module):
  """Takes its carry as three arguments and returns three tensors (upstream's tuple layers)."""

  def __init__(self):
    super().__init__()
    self.fc = torch.nn.Linear(6, 6)

  def forward(self, x, y, z):
    return self.fc(x).sin(), self.fc(y).cos(), self.fc(z) * x


def test_tuple_carry_spread_over_the_layer_arguments(dev):
  unrolled_vs_scanned([ThreeWay() for _ in range(3)], torch.randn(5, 6), dev,
                      carry_fn=lambda x: (x, x * 2, x * 3), unpack=True)


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_rematerialization_partition"])
def test_upstream_keywords(dev, partition):
  from functorch import compile as functorch_compile
  layers = [models.DecoderLayer() for _ in range(2)]
  unrolled_vs_scanned(layers, torch.randn(2, 8, 32), dev, shared=(torch.arange(8),),
                      partition_fn=getattr(functorch_compile, partition), is_layer_pure=False)


def test_partition_fn_and_remat_are_one_choice(dev):
  from functorch.compile import default_partition
  layers = [torch.nn.Linear(2, 2).to(dev) for _ in range(2)]
  with pytest.raises(jb.errors.BadArgumentError, match="partition_fn= and remat= both given"):
    jb.scan_layers(layers, torch.ones(2, device=dev), default_partition, remat="full")
  with pytest.raises(jb.errors.BadArgumentError, match="is not one this package maps"):
    jb.scan_layers(layers, torch.ones(2, device=dev), partition_fn=lambda *a: a)


class Indexed(torch.nn.Module):
  """A layer that knows its index (as Hugging Face's attention does, for its cache) and a scale
  that, when `reads_scale`, its forward reads."""

  def __init__(self, index, reads_scale=False):
    super().__init__()
    self.lin = torch.nn.Linear(6, 6)
    self.layer_idx, self.scale, self.reads_scale = index, float(index + 1), reads_scale

  def forward(self, x):
    out = torch.tanh(self.lin(x))
    return out * self.scale if self.reads_scale else out


def test_layers_differing_only_in_attributes_their_forward_never_reads_are_scanned(dev):
  torch.manual_seed(0)
  layers = [Indexed(i) for i in range(4)]
  unrolled_vs_scanned(layers, torch.randn(3, 6), dev)
  stacked_vs_unrolled([copy.deepcopy(l) for l in layers], torch.randn(3, 6), dev)


@pytest.mark.parametrize("kind", ["scan_layers", "StackedLayers"])
def test_layers_differing_in_an_attribute_their_forward_reads_are_refused_naming_it(dev, kind):
  torch.manual_seed(0)
  layers = [Indexed(i, reads_scale=True).to(dev) for i in range(3)]
  run = (lambda x: jb.scan_layers(layers, x)) if kind == "scan_layers" else (
      jb.StackedLayers(layers).to(dev))  # made: the check waits for the traced forward
  with pytest.raises(jb.errors.BadValueError,
                     match=r"layers\[1\] 'scale' is 2.0, but in layers\[0\] it is 1.0, and the "
                           r"layer's forward reads it"):
    run(torch.ones(2, 6, device=dev))
  assert type(layers[0]) is Indexed  # the recording class is gone after the trace


def _hugging_face_layers(family):
  """A 3-layer Hugging Face decoder of `family` (tiny, eager attention): its model and layers."""
  import transformers as tf

  torch.manual_seed(0)
  config_class, model_class = {"llama": (tf.LlamaConfig, tf.LlamaModel),
                               "qwen3": (tf.Qwen3Config, tf.Qwen3Model),
                               "gemma": (tf.GemmaConfig, tf.GemmaModel)}[family]
  config = config_class(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=3, vocab_size=16, head_dim=8,
                        attn_implementation="eager")
  model = model_class(config)
  return model, list(model.layers)


@pytest.mark.parametrize("backward", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_hugging_face_decoder_layers_differing_in_layer_idx_are_scanned(dev, family, backward):
  """Their decoder layers hold their own `self_attn.layer_idx`, read only with a cache."""
  model, layers = _hugging_face_layers(family)
  assert [l.self_attn.layer_idx for l in layers] == [0, 1, 2]
  x = torch.randn(2, 5, 32)
  positions = torch.arange(5)[None].expand(2, 5)
  cos, sin = model.rotary_emb(x, positions)
  expected = x
  for layer in layers:
    expected = layer(expected, position_embeddings=(cos, sin))
  moved = [copy.deepcopy(l).to(dev) for l in layers]
  out = jb.scan_layers(moved, x.to(dev),
                       shared_kwargs={"position_embeddings": (cos.to(dev), sin.to(dev))})
  torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
  if not backward:
    return
  expected.pow(2).sum().backward()
  out.pow(2).sum().backward()
  for layer, ref in zip(moved, layers):  # each layer's own gradients, in training mode
    for (name, p), (_, r) in zip(layer.named_parameters(), ref.named_parameters()):
      assert rel_err(p.grad, r.grad) < 1e-4, name


def test_hugging_face_layers_with_and_without_a_sliding_window_are_refused_naming_it(dev):
  """Qwen3 with sliding windows from its second layer on: the layers' programs differ."""
  import transformers as tf

  config = tf.Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=3, vocab_size=16, head_dim=8,
                          use_sliding_window=True, sliding_window=4, max_window_layers=1,
                          attn_implementation="eager")
  model = tf.Qwen3Model(config).to(dev)
  assert [l.self_attn.sliding_window for l in model.layers] == [None, 4, 4]
  x = torch.randn(2, 5, 32, device=dev)
  cos, sin = model.rotary_emb(x, torch.arange(5, device=dev)[None].expand(2, 5))
  with pytest.raises(jb.errors.BadValueError, match=r"layers\[1\] 'self_attn\.sliding_window' "
                                                    r"is 4, but in layers\[0\] it is None, and "
                                                    r"the layer's forward reads it"):
    jb.scan_layers(model.layers, x, shared_kwargs={"position_embeddings": (cos, sin)})
