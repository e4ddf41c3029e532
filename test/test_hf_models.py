"""The models users bring: tiny random Hugging Face models called with their own defaults (the
KV cache included), per layer and whole, against eager CPU; greedy decoding with both caches."""
import pytest
import torch

import torch_xla_jaxbridge as jb
import zoo

# Greedy decoding compiles a program per generated token (about 1.5 s each on 2 cores): Llama in
# the default run, the other architectures under `make slow` (results in docs/models.md).
QUICK = ("llama",)
GENERATORS = [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow)
              for name, (*_, generates) in zoo.ARCHITECTURES.items() if generates]


# Every architecture whole; per layer and in one node, the architectures whose layers differ most
# (a Llama-style decoder, mixture of experts, GPT-2, an encoder); the Llama-like decoders
# (Mistral, Qwen2, Gemma, Phi-3) per layer and in one node under `make slow`.
DISTINCT = ("llama", "mixtral", "gpt2", "bert")


def _marks(name, mode="layers"):
  return () if name in DISTINCT or mode == "whole" else pytest.mark.slow


@pytest.mark.parametrize("name, mode", [pytest.param(n, m, marks=_marks(n, m))
                                        for n in zoo.ARCHITECTURES for m in zoo.MODES])
def test_training_step_matches_eager(name, mode):
  eager, bridged, worst, _ = zoo.train_step(name, mode)
  assert bridged == pytest.approx(eager, rel=1e-5)
  assert worst < 1e-4


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in zoo.ARCHITECTURES])
def test_one_node_training_steps_match_eager_adamw(name):
  eager, losses, eager_norms, norms = zoo.one_node_steps(name)
  assert losses == pytest.approx(eager, rel=1e-4)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("cache", [pytest.param("dynamic", marks=pytest.mark.slow), "static"])
@pytest.mark.parametrize("name", GENERATORS)
def test_greedy_generation_matches_eager(name, cache):
  expected, tokens, traces = zoo.generate(name, cache)
  assert torch.equal(tokens, expected)
  # the two layers share their traces, each passed its own slot of the cache
  # (`_bridge.layer_slots`), but for Mixtral's (its router reads which tokens each expert got:
  # no fingerprint on the meta device). A DynamicCache grows: one trace per length; a StaticCache
  # is written in place: prefill and decode (Mistral's sliding-window layers count tokens in a
  # Python int: per length)
  layers = 2 if name in zoo.DATA_DEPENDENT_LAYERS else 1
  per_token = cache == "dynamic" or name in zoo.STATIC_CACHE_COUNTS_IN_PYTHON
  assert traces == (layers * zoo.NEW_TOKENS if per_token else layers * 2)


def test_a_layer_passed_its_cache_slot_takes_as_many_inputs_at_every_depth(dev):
  """A bridged layer is passed its own slot of a Hugging Face cache (`_bridge.layer_slots`): its
  node takes as many inputs at every depth, and the loss equals eager's."""
  import torch_xla
  import transformers

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager", use_cache=True)
  eager = transformers.LlamaForCausalLM(config)
  ids = torch.randint(0, 100, (2, 8))
  model = transformers.LlamaForCausalLM(config).to(dev)
  model.load_state_dict(eager.state_dict())
  jb.bridge_modules(model, ["LlamaDecoderLayer"])
  loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
  ir = torch_xla._XLAC._get_xla_tensors_text([loss])
  operands = [line.split("LlamaDecoderLayer_fwd(")[1].split(")")[0].count("%")
              for line in ir.splitlines() if "LlamaDecoderLayer_fwd(" in line]
  assert len(operands) == 6 and len(set(operands)) == 1, operands
  torch.testing.assert_close(loss.cpu(), eager(input_ids=ids, labels=ids).loss)
