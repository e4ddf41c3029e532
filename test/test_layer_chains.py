"""Layers called one after another run as one loop (`_core.layer_chains`), and `jb.train_step`
over an unmodified Hugging Face decoder compiles one layer body whatever its depth."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_xla
import transformers

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._core import layer_chains

import zoo


def _layer(i):
  return jax.named_scope(f"{layer_chains.MARK}{i}")


def _values_and_grads(fn, args):
  """`fn`'s value and gradients, directly and through its traced program with chains as loops,
  and the chains found."""
  closed = jax.make_jaxpr(fn)(*args)
  chains = layer_chains.find(closed.jaxpr)
  looped = lambda *a: layer_chains.evaluate(closed, chains, list(a))[0]  # noqa: E731
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
  looped = jax.make_jaxpr(lambda *a: layer_chains.evaluate(closed, chains, list(a)))(H, *WS)
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
  with layer_chains.marking([model]) as count:
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


def _step_hlo(layers, layer_loop):
  model = _llama(layers).to("xla")
  step = jb.train_step(lambda m, i: m(input_ids=i, labels=i).loss,
                       jb.optim.AdamW(model.parameters(), lr=1e-3), layer_loop=layer_loop)
  ids = torch.randint(0, 128, (2, 16)).to("xla")
  loss = step(model, ids)
  text = torch_xla_private.tensors_hlo_text([loss, *model.parameters()])
  torch_xla.sync()
  return text


def test_an_unmodified_hugging_face_decoder_compiles_one_layer_body_whatever_its_depth():
  looped = {n: _step_hlo(n, True) for n in (2, 5)}
  unrolled = {n: _step_hlo(n, False) for n in (2, 5)}
  assert looped[2].count(" dot(") == looped[5].count(" dot(")
  assert " while(" in looped[5]
  assert unrolled[5].count(" dot(") > unrolled[2].count(" dot(")


@pytest.mark.parametrize("layer_loop", [True, False])
def test_hugging_face_llama_trains_as_eager_with_its_layers_looped(layer_loop):
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
