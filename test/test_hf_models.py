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
  layers = 2
  # a DynamicCache grows: one trace per length and layer; a StaticCache is written in place:
  # prefill and decode, per layer (Mistral's sliding-window layers count tokens in a Python int)
  per_token = cache == "dynamic" or name in zoo.STATIC_CACHE_COUNTS_IN_PYTHON
  assert traces == (layers * zoo.NEW_TOKENS if per_token else layers * 2)
