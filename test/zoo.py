"""Tiny random Hugging Face models (no downloads) and the ways a user bridges them, compared with
eager CPU PyTorch: the model zoo of test_models.py and scripts/model_zoo.py."""
import copy

import torch
import torch_xla
import transformers as tf

import torch_xla_jaxbridge as jb

VOCAB, BATCH, LENGTH, NEW_TOKENS = 64, 2, 8, 8
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                attn_implementation="eager")


def _bert_config():
  return tf.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")


# name -> (config, model class, the list of layers, whether it generates)
ARCHITECTURES = {
    "llama": (lambda: tf.LlamaConfig(**_DECODER), tf.LlamaForCausalLM,
              lambda m: m.model.layers, True),
    "mistral": (lambda: tf.MistralConfig(**_DECODER), tf.MistralForCausalLM,
                lambda m: m.model.layers, True),
    "qwen2": (lambda: tf.Qwen2Config(**_DECODER), tf.Qwen2ForCausalLM,
              lambda m: m.model.layers, True),
    "gemma": (lambda: tf.GemmaConfig(**_DECODER, head_dim=8), tf.GemmaForCausalLM,
              lambda m: m.model.layers, True),
    "phi3": (lambda: tf.Phi3Config(**_DECODER, pad_token_id=0), tf.Phi3ForCausalLM,
             lambda m: m.model.layers, True),
    "mixtral": (lambda: tf.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2),
                tf.MixtralForCausalLM, lambda m: m.model.layers, True),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, attn_implementation="eager"),
             tf.GPT2LMHeadModel, lambda m: m.transformer.h, True),
    "bert": (_bert_config, tf.BertForMaskedLM, lambda m: m.bert.encoder.layer, False),
}
MODES = ("layers", "whole")
# StaticCache layers that keep a Python counter of the tokens seen (sliding windows): their state,
# and so the trace, changes every token
STATIC_CACHE_COUNTS_IN_PYTHON = {"mistral"}
# layers whose forward reads values (a mixture of experts' routing): no fingerprint on the meta
# device, so each keeps a trace of its own with a cache
DATA_DEPENDENT_LAYERS = {"mixtral"}


def build(name):
  """The eager CPU model (seeded) and its inputs, called as training scripts call it."""
  config, model_class, _, _ = ARCHITECTURES[name]
  torch.manual_seed(0)
  model = model_class(config())
  ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
  inputs = {"input_ids": ids, "labels": ids}
  if name == "bert":  # an encoder with padding: the attention mask matters
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, -3:] = 0
    inputs["attention_mask"] = mask
  return model, inputs


def on_xla(model, name, mode):
  """A copy of `model` on the XLA device, bridged per layer or whole: `(copy, what to call)`."""
  moved = copy.deepcopy(model).to("xla")
  moved.tie_weights()  # moving to XLA makes new parameters: tie them again, as on CPU
  if mode == "whole":
    return moved, jb.BridgeModule(moved)
  layers = ARCHITECTURES[name][2](moved)
  for i in range(len(layers)):
    layers[i] = jb.BridgeModule(layers[i])
  return moved, moved


def train_step(name, mode):
  """`(eager loss, bridged loss, worst relative gradient error, traces)` of one forward and
  backward with the model's defaults."""
  model, inputs = build(name)
  reference = model(**inputs)
  reference.loss.backward()
  moved, call = on_xla(model, name, mode)
  jb.clear_cache()
  out = call(**{k: v.to("xla") for k, v in inputs.items()})
  out.loss.backward()
  torch_xla.sync()  # one program for the loss and every gradient (not one per `.cpu()`)
  worst = worst_gradient_error({n: p.grad for n, p in moved.named_parameters()},
                               {n: p.grad for n, p in model.named_parameters()})
  return reference.loss.item(), out.loss.item(), worst, jb.cache_info().misses


def worst_gradient_error(grads, expected):
  """The largest relative error of `grads` (parameter name -> XLA gradient or None) against eager
  CPU's `expected` (the same names). A gradient that is zero in exact arithmetic (a key bias under
  softmax) is rounding noise: measured against a floor of 1e-3 of the largest gradient."""
  assert grads.keys() == expected.keys()
  floor = 1e-3 * max(g.norm().item() for g in expected.values() if g is not None)
  worst = 0.0
  for name, want in expected.items():
    if want is None:
      assert grads[name] is None, name
      continue
    error = ((grads[name].cpu() - want).norm() / max(want.norm().item(), floor)).item()
    worst = max(worst, error)
  return worst


def generate(name, cache):
  """`(eager tokens, bridged tokens, traces)` of greedy decoding with per-layer bridging;
  `cache` is "dynamic" or "static"."""
  model, inputs = build(name)
  model.eval()
  ids = inputs["input_ids"]
  options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                 attention_mask=torch.ones_like(ids))
  if cache == "static":
    options["cache_implementation"] = "static"
  moved, _ = on_xla(model, name, "layers")  # before generating: generate keeps its cache on the model
  with torch.no_grad():
    expected = model.generate(ids, **options)
    jb.clear_cache()
    options["attention_mask"] = options["attention_mask"].to("xla")
    tokens = moved.generate(ids.to("xla"), **options).cpu()
  return expected, tokens, jb.cache_info().misses


def one_node_steps(name, steps=3):
  """`(eager losses, losses, eager grad norms, grad norms)` of `steps` AdamW steps with clipping:
  torch's on CPU (backward, clip_grad_norm_, step) against `jb.train_step` of the model called
  with its defaults (one node a step)."""
  model, inputs = build(name)
  moved, _ = on_xla(model, name, "whole")
  return eager_against_train_step(model, moved, inputs, steps)


def eager_against_train_step(model, moved, inputs, steps, layer_loop=True):
  """`(eager losses, losses, eager grad norms, grad norms)` of `steps` AdamW steps clipped at
  0.5: `model` with torch's AdamW on CPU (backward, clip_grad_norm_, step) against its XLA copy
  `moved` under `jb.train_step` with `jb.optim.AdamW`, both called as `model(**inputs).loss`."""
  eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
  opt = jb.optim.AdamW(moved.parameters(), lr=1e-3, max_grad_norm=0.5)
  on_device = {k: v.to("xla") for k, v in inputs.items()}
  step = jb.train_step(lambda batch: moved(**batch).loss, opt, layer_loop=layer_loop)
  eager, eager_norms, losses, norms = [], [], [], []
  for _ in range(steps):
    eager_opt.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    eager_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
    eager_opt.step()
    eager.append(loss.item())
    losses.append(step(on_device))
    norms.append(opt.grad_norm)
    torch_xla.sync()
  return eager, [l.item() for l in losses], eager_norms, [n.item() for n in norms]
