"""Layers called one after another run as one loop (`_core.layer_chains`, `_core.layer_loops`), and `jb.train_step`
over an unmodified Hugging Face decoder compiles one layer body whatever its depth."""
import copy
import gc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_xla
import transformers

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._core import layer_chains, layer_loops

import heldout
import zoo


def _layer(i):
  return jax.named_scope(f"{layer_chains.MARK}{i}")


def _values_and_grads(fn, args):
  """`fn`'s value and gradients, directly and through its traced program with chains as loops,
  and the chains found."""
  closed = jax.make_jaxpr(fn)(*args)
  chains = layer_chains.find(closed.jaxpr)
  looped = lambda *a: layer_loops.evaluate(closed, chains, list(a))[0]  # noqa: E731
  argnums = tuple(range(len(args)))
  return (jax.value_and_grad(fn, argnums)(*args), jax.value_and_grad(looped, argnums)(*args),
          chains)


def _assert_close(expected, got):
  for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


WS = [jnp.eye(3) * (i + 1) / 4 + 0.1 for i in range(4)]
H = jnp.arange(6.0).reshape(2, 3) / 6


def test_a_chain_with_a_carry_per_layer_weights_and_a_shared_input():
  def f(h, bias, *ws):
    for i, w in enumerate(ws):
      with _layer(i):
        h = jnp.tanh(h @ w + bias)
    return (h ** 2).sum()

  expected, got, chains = _values_and_grads(f, [H, jnp.ones(3), *WS])
  _assert_close(expected, got)
  (chain,) = chains
  assert len(chain.segments) == 4
  assert (len(chain.carried), len(chain.stacked_per_call), len(chain.shared)) == (1, 1, 1)


def test_the_looped_program_holds_one_layer_body():
  def f(h, *ws):
    for i, w in enumerate(ws):
      with _layer(i):
        h = jnp.sin(h @ w)
    return h.sum()

  closed = jax.make_jaxpr(f)(H, *WS)
  chains = layer_chains.find(closed.jaxpr)
  looped = jax.make_jaxpr(lambda *a: layer_loops.evaluate(closed, chains, list(a)))(H, *WS)
  primitives = [str(e.primitive) for e in looped.jaxpr.eqns]
  assert primitives.count("scan") == 1 and "sin" not in primitives
  assert [str(e.primitive) for e in closed.jaxpr.eqns].count("sin") == 4


def test_a_layer_computing_something_else_splits_the_chain():
  def f(h, *ws):
    for i, w in enumerate(ws):
      with _layer(i):
        h = jnp.tanh(h @ w) * (2.0 if i == 2 else 1.0)
    return h.sum()

  expected, got, chains = _values_and_grads(f, [H, *WS])
  _assert_close(expected, got)
  assert [len(c.segments) for c in chains] == [2]  # layers 0-1; 2 differs; 3 alone


def test_a_layer_reading_an_earlier_layers_output_ends_the_chain():
  def f(h, *ws):
    outs = []
    for i, w in enumerate(ws):
      with _layer(i):
        h = jnp.tanh(h @ w) + (outs[0] if i == 2 else jnp.zeros_like(h))
      outs.append(h)
    return h.sum()

  expected, got, _ = _values_and_grads(f, [H, *WS])
  _assert_close(expected, got)


def test_values_of_every_layer_read_after_the_loop():
  def f(h, *ws):
    every = []
    for i, w in enumerate(ws):
      with _layer(i):
        h = jnp.tanh(h @ w)
        side = h.mean()
      every.append(side)
    return h.sum() + sum(s * (k + 1) for k, s in enumerate(every))

  expected, got, chains = _values_and_grads(f, [H, *WS])
  _assert_close(expected, got)
  assert len(chains[0].segments) == 4 and len(chains[0].outputs) == 1


def test_layers_that_do_not_read_each_other_loop_too():
  def f(h, *ws):
    total = 0.0
    for i, w in enumerate(ws):
      with _layer(i):
        out = jnp.tanh(h @ w).sum()
      total = total + out
    return total

  expected, got, chains = _values_and_grads(f, [H, *WS])
  _assert_close(expected, got)
  assert len(chains[0].segments) == 4 and not chains[0].carried


def test_marking_marks_repeated_layers_only_and_restores_their_classes():
  model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(
      [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU()]))
  with layer_loops.marking([model]) as count:
    inside = [type(m).__name__ == "Linear" and type(m) is not torch.nn.Linear
              for m in model.modules()]
  assert count == 2 and sum(inside) == 2  # the list's two Linears; not the Sequential's one
  assert all(type(m) in (torch.nn.Linear, torch.nn.ReLU, torch.nn.Sequential, torch.nn.ModuleList)
             for m in model.modules())


def _llama(layers, seed=0):
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
  return transformers.LlamaForCausalLM(config)


@pytest.fixture
def loop_from_two(monkeypatch):
  from torch_xla_jaxbridge._training import train_step
  monkeypatch.setattr(train_step, "LOOP_FROM", 2)


def _step_hlo(layers, layer_loop):  # layer_loop=2: loops from two layers (cheap to compile)
  model = _llama(layers).to("xla")
  step = jb.train_step(lambda m, i: m(input_ids=i, labels=i).loss,
                       jb.optim.AdamW(model.parameters(), lr=1e-3), layer_loop=layer_loop)
  ids = torch.randint(0, 128, (2, 16)).to("xla")
  loss = step(model, ids)
  text = torch_xla_private.tensors_hlo_text([loss, *model.parameters()])
  del model, step, loss
  gc.collect()  # the step's pending graph goes with its tensors: read, never compiled
  return text


def test_an_unmodified_hugging_face_decoder_compiles_one_layer_body_whatever_its_depth():
  looped = {n: _step_hlo(n, 2) for n in (2, 5)}
  unrolled = {n: _step_hlo(n, False) for n in (2, 5)}
  assert looped[2].count(" dot(") == looped[5].count(" dot(")
  assert " while(" in looped[5]
  assert unrolled[5].count(" dot(") > unrolled[2].count(" dot(")


def test_each_layers_gradient_and_optimizer_state_are_read_at_a_traced_index():
  """XLA:CPU compiles one kernel per distinct kernel body: a layer's gradient sliced from the
  loop's stacked gradient, and its AdamW state from the flat buffers, at constant offsets made a
  kernel of their own per layer. Read at a traced index (an input of the step), the slicing is
  the same whatever the depth."""
  looped = {n: _step_hlo(n, 2) for n in (2, 5)}
  assert looped[2].count(" slice(") == looped[5].count(" slice(")
  per_layer = looped[5].count(" dynamic-slice(") - looped[2].count(" dynamic-slice(")
  assert per_layer == 3 * 9 * 3  # 3 more layers x 9 parameters x (gradient, exp_avg, exp_avg_sq)


def test_fewer_layers_than_loop_from_stay_unrolled():
  assert " while(" not in _step_hlo(3, True)


@pytest.mark.parametrize("layer_loop", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_hugging_face_llama_trains_as_eager_with_its_layers_looped(layer_loop, loop_from_two):
  model = _llama(3)
  moved = _llama(3).to("xla")
  ids = torch.randint(0, 128, (2, 16))
  mask = torch.ones(2, 16, dtype=torch.long)
  mask[1, 12:] = 0  # a padded batch
  inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
  eager, losses, eager_norms, norms = zoo.eager_against_train_step(model, moved, inputs, 3,
                                                                  layer_loop=layer_loop)
  np.testing.assert_allclose(losses, eager, rtol=1e-5)
  np.testing.assert_allclose(norms, eager_norms, rtol=1e-4)
  for p, q in zip(model.parameters(), moved.parameters()):
    np.testing.assert_allclose(q.cpu().detach().numpy(), p.detach().numpy(), atol=2e-5)


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=4,
              attn_implementation="eager")
# 4 layers whose attention alternates between two kinds: the same code reads another mask or
# window per layer
_ALTERNATING = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "qwen2 sliding from layer 2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=2)),
    "gpt_neo": lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, window_size=3,
        attention_types=[[["global", "local"], 2]], max_position_embeddings=64,
        embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)),
}


@pytest.mark.parametrize("name, looped", [
    ("gemma2", (2, 2)),
    *[pytest.param(name, looped, marks=pytest.mark.slow)
      for name, looped in [("qwen2 sliding from layer 2", (2, 2)), ("gpt_neo", (4,))]]])
def test_layers_of_alternating_attention_kinds_loop_with_their_own_masks(name, looped,
                                                                        chain_lengths):
  """Sliding-window and global layers (a padded batch): each loop runs its layers with their own
  mask, with eager's losses and gradient norms."""
  torch.manual_seed(0)
  model = _ALTERNATING[name]().train()
  moved = copy.deepcopy(model).to("xla")
  moved.tie_weights()  # (moving a copy unties the embeddings, in plain torch_xla too)
  ids = torch.randint(1, 64, (2, 12))
  mask = torch.ones_like(ids)
  mask[1, 8:] = 0
  labels = ids.masked_fill(mask == 0, -100)
  eager, losses, eager_norms, norms = zoo.eager_against_train_step(
      model, moved, {"input_ids": ids, "attention_mask": mask, "labels": labels}, 3)
  assert chain_lengths == [list(looped)]
  np.testing.assert_allclose(losses, eager, rtol=1e-5)
  np.testing.assert_allclose(norms, eager_norms, rtol=1e-4)


@pytest.fixture
def chain_lengths(monkeypatch, loop_from_two):
  """The lengths of the chains each trace found (with loops from two layer calls)."""
  found = []
  real = layer_chains.find

  def recording(jaxpr, min_calls=2):
    chains = real(jaxpr, min_calls)
    found.append([len(c.segments) for c in chains])
    return chains

  monkeypatch.setattr(layer_chains, "find", recording)
  return found


# models nobody here wrote, 2 layers each (encoders, decoders, seq2seq, mixture of experts);
# a few in `make test`, the rest under `make slow`
@pytest.mark.parametrize("name, looped", [
    ("qwen3", [2]), ("t5", []),
    *[pytest.param(name, looped, marks=pytest.mark.slow) for name, looped in [
        ("qwen2_moe", [2]),
        ("roberta", [2]), ("gpt_neox", [2]), ("bloom", [2]), ("falcon", [2]),
        ("distilbert", [2]), ("electra", [2]), ("gemma", [2]), ("mistral", [2]),
        ("deepseek_v3", []), ("olmoe", [2]), ("gptj", [2])]]])
def test_models_train_as_eager_with_their_layers_looped(name, looped, chain_lengths):
  eager, losses, eager_norms, norms = heldout.train_steps(name)
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  assert chain_lengths == [looped]
  row = next(r for r in reversed(jb.bridge_report().rows) if r.kind == "step")
  assert row.status == "bridged"


def test_dropout_per_layer_gives_the_values_of_the_unrolled_step(loop_from_two):
  """Each layer draws its dropout mask from the key the one before it split: the loop carries
  the key, and the masks are the unrolled step's."""
  losses = {}
  for layer_loop in (True, False):
    torch.manual_seed(0)
    torch_xla.manual_seed(0)  # the step's random key comes from torch_xla's generator
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
        attention_dropout=0.3)
    model = transformers.LlamaForCausalLM(config).to("xla")
    step = jb.train_step(lambda m, i: m(input_ids=i, labels=i).loss,
                         jb.optim.AdamW(model.parameters(), lr=1e-3), layer_loop=layer_loop)
    ids = torch.randint(0, 128, (2, 16)).to("xla")
    losses[layer_loop] = []
    for _ in range(2):
      loss = step(model, ids)
      torch_xla.sync()  # the parameters with the loss: one program, not one per tensor read
      losses[layer_loop].append(loss.item())
    assert bool(step.looped) == layer_loop
  assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.parametrize("bad", [-1, 2.5, "yes"])
def test_a_bad_layer_loop_says_what_it_takes(bad):
  model = torch.nn.Linear(2, 1).to("xla")
  with pytest.raises(jb.errors.BadArgumentError, match="layer_loop=.*give True"):
    jb.train_step(lambda x: model(x).sum(), jb.optim.SGD(model.parameters(), lr=0.1),
                  layer_loop=bad)


def test_layers_without_parameters_loop():
  def f(h):
    for i in range(4):
      with _layer(i):
        h = jnp.tanh(h) * 1.5
    return h.sum()

  expected, got, chains = _values_and_grads(f, [H])
  _assert_close(expected, got)
  assert len(chains[0].segments) == 4 and not chains[0].stacked_per_call


def test_a_layer_reading_its_own_value_where_the_first_reads_an_outside_one_is_no_match():
  def f(h, w):
    for i in range(3):
      with _layer(i):
        inner = jnp.tanh(h @ w)
        h = inner * (h if i == 0 else inner)  # call 0 reads h (outside); calls 1, 2 read inner
    return h.sum()

  expected, got, chains = _values_and_grads(f, [H, WS[0]])
  _assert_close(expected, got)
  assert [len(c.segments) for c in chains] == [2]  # calls 1 and 2


@pytest.mark.slow
def test_the_recipe_with_layer_loop_trains_as_without(recipe_run, monkeypatch):
  """`remat.layer_loop=true` (8 layers: one loop) gives the unrolled step's losses."""
  found = []
  real = layer_chains.find
  monkeypatch.setattr(layer_chains, "find", lambda *a: found.append(real(*a)) or found[-1])
  looped, _ = recipe_run("model.layers=8", "remat.layer_loop=true")
  unrolled, _ = recipe_run("model.layers=8", "remat.stack_layers=false")
  assert [len(c.segments) for c in found[0]] == [8]
  assert looped == pytest.approx(unrolled, rel=2e-4)
