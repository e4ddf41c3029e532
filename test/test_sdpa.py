"""`F.scaled_dot_product_attention` inside bridged code (`_integrations/torch_ops`): every argument
against eager CPU torch (values and gradients), the inputs torch refuses, dropout's randomness, and
Hugging Face grouped-query decoders with their default `sdpa` attention bridged without fallback."""
import itertools

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import heldout
import torch_xla_jaxbridge as jb

B, H, L, S, D = 2, 4, 3, 5, 8


def bool_mask(*shape):
  """A random boolean mask whose second query row sees no key."""
  mask = torch.rand(*shape) > 0.3
  mask[..., 1, :] = False
  return mask


def float_mask(*shape):
  """A random additive mask whose second query row is all -inf."""
  mask = torch.randn(*shape)
  mask[..., 1, :] = float("-inf")
  return mask


# id -> (query, key, value shapes, the keyword arguments (made after seeding))
CASES = {
    "gqa": ((B, H, L, D), (B, 2, S, D), (B, 2, S, D), lambda: dict(enable_gqa=True)),
    "gqa, one kv head, 4-D bool mask": (
        (B, H, L, D), (B, 1, S, D), (B, 1, S, D),
        lambda: dict(enable_gqa=True, attn_mask=bool_mask(B, 1, L, S))),
    "gqa, unbatched, causal, scale": (
        (H, L, D), (2, S, D), (2, S, D), lambda: dict(enable_gqa=True, is_causal=True, scale=0.3)),
    "gqa with equal heads": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                             lambda: dict(enable_gqa=True)),
    "causal, query longer than key": ((B, H, 7, D), (B, H, S, D), (B, H, S, D),
                                      lambda: dict(is_causal=True)),
    "causal, query shorter than key": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                                       lambda: dict(is_causal=True)),
    "bool 2-D mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                      lambda: dict(attn_mask=bool_mask(L, S))),
    "bool 3-D mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                      lambda: dict(attn_mask=bool_mask(H, L, S))),
    "bool 4-D mask, singleton query dim": (
        (B, H, L, D), (B, H, S, D), (B, H, S, D),
        lambda: dict(attn_mask=torch.rand(B, 1, 1, S) > 0.5)),
    "float 2-D mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                       lambda: dict(attn_mask=float_mask(L, S))),
    "float 3-D mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                       lambda: dict(attn_mask=float_mask(H, L, S))),
    "float 4-D mask, singleton batch": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                                        lambda: dict(attn_mask=float_mask(1, H, L, S))),
    "negative scale, narrower value": ((B, H, L, D), (B, H, S, D), (B, H, S, 6),
                                       lambda: dict(scale=-0.7)),
}
BFLOAT16 = {
    "gqa, bool mask": ((B, H, L, D), (B, 2, S, D), (B, 2, S, D),
                       lambda: dict(enable_gqa=True, attn_mask=bool_mask(L, S))),
    "float32 mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                     lambda: dict(attn_mask=float_mask(L, S))),
    "bfloat16 mask": ((B, H, L, D), (B, H, S, D), (B, H, S, D),
                      lambda: dict(attn_mask=float_mask(L, S).bfloat16())),
    "causal": ((B, H, 7, D), (B, H, S, D), (B, H, S, D), lambda: dict(is_causal=True)),
}


def on_xla(kwargs):
  return {k: v.to("xla") if torch.is_tensor(v) else v for k, v in kwargs.items()}


def eager_and_bridged(case, dtype=torch.float32):
  """`(eager, bridged)`: each the output and the query, key and value gradients of attention on
  the same seeded inputs and output gradient; bridged strictly (a fallback would raise)."""
  *shapes, make_kwargs = case
  torch.manual_seed(0)
  inputs = [torch.randn(*shape).to(dtype) for shape in shapes]
  kwargs = make_kwargs()
  eager_in = [t.clone().requires_grad_() for t in inputs]
  out = F.scaled_dot_product_attention(*eager_in, **kwargs)
  cotangent = torch.randn_like(out)
  out.backward(cotangent)
  xla_in = [t.to("xla").requires_grad_() for t in inputs]
  bridged = jb.bridge(F.scaled_dot_product_attention, fallback=False)(*xla_in, **on_xla(kwargs))
  bridged.backward(cotangent.to("xla"))
  torch_xla.sync()
  return ([out.detach()] + [t.grad for t in eager_in],
          [bridged.detach().cpu()] + [t.grad.cpu() for t in xla_in])


@pytest.mark.parametrize("case", list(CASES))
def test_every_argument_matches_eager_cpu(case):
  eager, bridged = eager_and_bridged(CASES[case])
  for got, want in zip(bridged, eager):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
  if "mask" in case and "singleton query" not in case:  # the query that sees no key: zeros
    assert not bridged[0][..., 1, :].any()


@pytest.mark.parametrize("case", list(BFLOAT16))
def test_bfloat16_inputs_match_eager_cpu(case):
  eager, bridged = eager_and_bridged(BFLOAT16[case], torch.bfloat16)
  for got, want in zip(bridged, eager):
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


# id -> (query, key, value shapes, keyword arguments, plain torch_xla's error, the bridged one)
REFUSED = {
    "fewer kv heads without enable_gqa": (
        (B, H, L, D), (B, 2, S, D), (B, 2, S, D), {},
        r"The size of tensor a \(4\) must match the size of tensor b \(2\)",
        r"The size of tensor a \(4\) must match the size of tensor b \(2\)"),
    "heads that do not divide": (
        (B, 3, L, D), (B, 2, S, D), (B, 2, S, D), dict(enable_gqa=True),
        "Number of heads in key and value must divide the number of heads in",
        "enable_gqa=True with 3 query heads and 2 key / 2 value heads"),
    "a mask with is_causal": (
        (B, H, L, D), (B, H, S, D), (B, H, S, D),
        dict(is_causal=True, attn_mask=torch.ones(L, S, dtype=torch.bool)),
        "Explicit attn_mask should not be set when is_causal=True",
        r"an attn_mask with is_causal=True .*pass one mask"),
    "an integer mask": (
        (B, H, L, D), (B, H, S, D), (B, H, S, D), dict(attn_mask=torch.ones(L, S).long()),
        "Expected attn_mask dtype to be bool or float or to match query dtype",
        "attn_mask has dtype torch.int64; torch expects bool"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_torch_refuses_raises_torchs_error(case):
  *shapes, kwargs, torch_says, bridged_says = REFUSED[case]
  inputs = [torch.randn(*shape).to("xla") for shape in shapes]
  kwargs = on_xla(kwargs)
  with pytest.raises(RuntimeError, match=torch_says):
    F.scaled_dot_product_attention(*inputs, **kwargs)
  strict = jb.bridge(F.scaled_dot_product_attention, fallback=False)
  with pytest.raises(jb.errors.JaxTracingError, match=bridged_says):
    strict(*inputs, **kwargs)
  # by default the region falls back to plain LazyTensor code, which raises torch's error
  with pytest.warns(jb.errors.FallbackWarning), pytest.raises(RuntimeError, match=torch_says):
    jb.bridge(F.scaled_dot_product_attention)(*inputs, **kwargs)


def test_query_key_value_of_different_dtypes_are_refused():
  q, k = torch.randn(B, H, L, D).to("xla"), torch.randn(B, H, S, D).to("xla")
  with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same dtype"):
    F.scaled_dot_product_attention(q, k.bfloat16(), k)
  with pytest.raises(jb.errors.JaxTracingError, match=r"dtypes torch.float32, torch.bfloat16 and "
                                                      r"torch.float32; torch expects one dtype"):
    jb.bridge(F.scaled_dot_product_attention, fallback=False)(q, k.bfloat16(), k)


# --- dropout -----------------------------------------------------------------------------------

P, KEYS = 0.3, 64


def dropped_weights(dropout_p=P):
  """Strictly bridged attention whose output is its weights after dropout: query = key = 0 (every
  weight 1/KEYS) and value = the identity. `(attend, q, v)`."""
  attend = jb.bridge(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p),
                     fallback=False)
  q = torch.zeros(2, 2, KEYS, D, device="xla")
  v = torch.eye(KEYS).expand(2, 2, KEYS, KEYS).to("xla")
  return attend, q, v


def test_dropout_drops_a_fraction_p_and_keeps_the_expectation():
  attend, q, v = dropped_weights()
  weights = attend(q, q, v).cpu()  # 16384 weights
  assert abs((weights == 0).double().mean().item() - P) < 0.02
  torch.testing.assert_close(weights.unique(), torch.tensor([0.0, 1 / KEYS / (1 - P)]))
  assert abs(weights.mean().item() * KEYS - 1) < 0.03


def test_dropout_repeats_under_a_seed_and_differs_per_call():
  attend, q, v = dropped_weights()
  torch_xla.manual_seed(7)
  first, second = attend(q, q, v).cpu(), attend(q, q, v).cpu()
  torch_xla.manual_seed(7)
  assert torch.equal(attend(q, q, v).cpu(), first)
  assert not torch.equal(first, second)
  assert jb.cache_info().misses == 1  # a fresh key per call, never a new trace


def test_dropout_backward_uses_the_forward_mask():
  """The forward's output (value = identity) shows the mask; eager torch with that mask applied by
  hand gives the same output and gradients."""
  torch.manual_seed(0)
  q, k = torch.randn(2, 2, 16, D), torch.randn(2, 2, KEYS, D)
  v = torch.eye(KEYS).expand(2, 2, KEYS, KEYS).contiguous()
  cotangent = torch.randn(2, 2, 16, KEYS)
  xla_in = [t.to("xla").requires_grad_() for t in (q, k, v)]
  attend = jb.bridge(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=P),
                     fallback=False)
  out = attend(*xla_in)
  out.backward(cotangent.to("xla"))
  torch_xla.sync()
  kept = out.detach().cpu() != 0
  assert abs(kept.double().mean().item() - (1 - P)) < 0.03
  eager_in = [t.clone().requires_grad_() for t in (q, k, v)]
  weights = torch.softmax(eager_in[0] @ eager_in[1].transpose(-2, -1) / D ** 0.5, -1)
  expected = (weights * kept / (1 - P)) @ eager_in[2]
  expected.backward(cotangent)
  torch.testing.assert_close(out.detach().cpu(), expected.detach())
  for got, want in zip(xla_in, eager_in):
    torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-6)


def test_dropout_applies_under_no_grad_as_torchs_does():
  """torch's attention drops whenever `dropout_p > 0`, with or without autograd."""
  attend, q, v = dropped_weights()
  with torch.no_grad():
    eager = F.scaled_dot_product_attention(q.cpu(), q.cpu(), v.cpu(), dropout_p=P)
    bridged = attend(q, q, v).cpu()
  for weights in (eager, bridged):
    assert abs((weights == 0).double().mean().item() - P) < 0.02


def test_dropout_p_one_gives_zeros_and_zero_gradients():
  attend, q, v = dropped_weights(dropout_p=1.0)
  q.requires_grad_()
  out = attend(q, q, v)
  out.sum().backward()
  assert not out.detach().cpu().any() and not q.grad.cpu().any()


class DroppingAttention(torch.nn.Module):
  """Attention dropping its weights in training only, as torch's documentation writes it."""

  def __init__(self, p=0.5):
    super().__init__()
    self.p = p

  def forward(self, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


def test_a_module_in_eval_mode_matches_eager_and_drops_in_training():
  torch.manual_seed(0)
  q, k, v = (torch.randn(2, H, 16, D) for _ in range(3))
  layer = jb.BridgeModule(DroppingAttention())
  expected = DroppingAttention().eval()(q, k, v)
  torch.testing.assert_close(layer.eval()(q.to("xla"), k.to("xla"), v.to("xla")).cpu(), expected)
  trained = layer.train()(q.to("xla"), k.to("xla"), v.to("xla")).cpu()
  assert not torch.allclose(trained, expected)


# --- Hugging Face grouped-query decoders -------------------------------------------------------

# each case compiles its own programs (several seconds on 2 cores): the unpadded batch (where
# `enable_gqa=True` reaches the attention) both ways in `make test` (test_heldout_models.py runs
# a left-padded Qwen3 step there), the sweep over the five decoders under `make slow`
QUICK = {("llama", None, "bridge_modules"), ("qwen2", None, "train_step")}
DECODER_CASES = [
    pytest.param(name, padding, how, marks=() if (name, padding, how) in QUICK else
                 pytest.mark.slow, id=f"{name}-{padding or 'unpadded'}-{how}")
    for name, padding, how in itertools.product(heldout.DECODERS, [None, "left"],
                                                ["bridge_modules", "train_step"])]


@pytest.mark.parametrize("name, padding, how", DECODER_CASES)
def test_grouped_query_decoders_with_sdpa_attention_stay_bridged(name, padding, how):
  """Without an attention mask transformers passes `enable_gqa=True` (fewer key/value heads than
  query heads); with left padding, a boolean mask whose padding rows see no key."""
  layer = heldout.DECODERS[name][2]
  eager, loss, worst, regions = heldout.gradients(name, padding, [layer],
                                                  one_node=how == "train_step")
  report = jb.bridge_report()
  rows = [report.row(region) for region in regions]
  assert len(rows) == (3 if how == "train_step" else 2) and None not in rows
  assert [r for r in report.fallbacks() if r in rows] == [], str(report)
  assert loss == pytest.approx(eager, rel=1e-5)
  assert worst < 1e-4
