"""Hugging Face models beyond the zoo (tiny random configs, no downloads), called as training
scripts call them: padded batches with their attention masks, in training mode, whole-model
`jb.train_step` against eager CPU AdamW, and grouped-query decoders with their default `sdpa`
attention. test_heldout_models.py and test_sdpa.py run them."""
import copy
import warnings

import torch
import torch_xla
import transformers as tf

import torch_xla_jaxbridge as jb
import zoo

VOCAB, BATCH, LENGTH, TARGET = 64, 2, 10, 6
_NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def _bart(layerdrop=0.0):
  return tf.BartForConditionalGeneration(tf.BartConfig(
      vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
      max_position_embeddings=64, encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop,
      **_NO_DROPOUT))


def _opt(layerdrop=0.0):
  return tf.OPTForCausalLM(tf.OPTConfig(
      vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
      max_position_embeddings=64, word_embed_proj_dim=32, layerdrop=layerdrop, dropout=0.0,
      attention_dropout=0.0))


def _roberta(layerdrop=0.0):
  return tf.RobertaForSequenceClassification(tf.RobertaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=1,
      # what its first forward sets from the labels otherwise: a value its loss reads, so the
      # second step would trace again for it (test_host_values.py)
      problem_type="single_label_classification"))


def _t5(layerdrop=0.0):
  return tf.T5ForConditionalGeneration(tf.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
      decoder_start_token_id=0, dropout_rate=0.0))


def _pegasus(layerdrop=0.0):
  return tf.PegasusForConditionalGeneration(tf.PegasusConfig(
      vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
      max_position_embeddings=64, encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop,
      **_NO_DROPOUT))


_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4)
_MORE = {  # (config class, model class, config keywords beyond _SMALL)
    "electra": (tf.ElectraConfig, tf.ElectraForMaskedLM, dict(
        embedding_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(
        intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64,
        hidden_dropout=0.0, attention_dropout=0.0)),
    "bloom": (tf.BloomConfig, tf.BloomForCausalLM, dict(n_layer=2, hidden_dropout=0.0,
                                                        attention_dropout=0.0)),
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM, dict(num_hidden_layers=2, hidden_dropout=0.0,
                                                           attention_dropout=0.0)),
}


# held out beyond the first list: their routers pick experts with `topk` and `one_hot` (int64
# indices only) and loop over the experts hit; GPT-J keeps its rotary table as a plain tensor
_LATER = {  # (config class, model class, config keywords beyond _SMALL)
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(
        intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
        intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
        max_position_embeddings=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts_per_tok=2, num_experts=4)),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, dict(
        intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2, num_experts=4)),
    "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM, dict(
        intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2,
        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)),
}


def _gptj(layerdrop=0.0):
  return tf.GPTJForCausalLM(tf.GPTJConfig(
      vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=48,
      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _distilbert(layerdrop=0.0):
  return tf.DistilBertForMaskedLM(tf.DistilBertConfig(
      vocab_size=VOCAB, dim=32, hidden_dim=48, n_layers=2, n_heads=4, max_position_embeddings=64,
      dropout=0.0, attention_dropout=0.0))


# grouped-query decoders with their default attention, `sdpa` (torch's attention with
# `enable_gqa=True` when no attention mask is given): name -> (config, model, decoder layer class)
DECODERS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, "LlamaDecoderLayer"),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, "MistralDecoderLayer"),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, "Qwen2DecoderLayer"),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, "Qwen3DecoderLayer"),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, "GemmaDecoderLayer"),
}
_GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)

# name -> (model maker, what the labels are)
MODELS = {"bart": (_bart, "seq2seq"), "opt": (_opt, "lm"), "roberta": (_roberta, "class"),
          "t5": (_t5, "seq2seq"), "pegasus": (_pegasus, "seq2seq"),
          "distilbert": (_distilbert, "lm"), "gptj": (_gptj, "lm"),
          **{name: (lambda layerdrop=0.0, c=c, m=m, kw=kw: m(c(**_SMALL, **kw)), "lm")
             for name, (c, m, kw) in {**_MORE, **_LATER}.items()},
          **{name: (lambda layerdrop=0.0, c=c, m=m: m(c(**_GQA)), "lm")
             for name, (c, m, _) in DECODERS.items()}}


def batch(name, padding="right"):
  """A padded batch as a data collator gives it: ids, attention mask (the first row padded by 3
  on `padding`'s side), labels; `padding=None`: no padding and no attention mask (a packed
  pretraining batch)."""
  gen = torch.Generator().manual_seed(7)
  ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=gen)
  mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
  if padding is not None:
    pad = slice(0, 3) if padding == "left" else slice(LENGTH - 3, LENGTH)
    mask[0, pad] = 0
    ids[0, pad] = 1
  kind = MODELS[name][1]
  labels = (torch.randint(3, VOCAB, (BATCH, TARGET), generator=gen) if kind == "seq2seq" else
            torch.tensor([0, 2]) if kind == "class" else ids.masked_fill(mask == 0, -100))
  inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
  if padding is None:
    del inputs["attention_mask"]
  return inputs


def build(name, layerdrop=0.0):
  """The eager CPU model in training mode (seeded) and its XLA copy, weights tied again."""
  torch.manual_seed(0)
  model = MODELS[name][0](layerdrop).train()
  moved = copy.deepcopy(model).to("xla")
  moved.tie_weights()  # moving to XLA makes new parameters: tie them again, as on CPU
  return model, moved


def train_steps(name, steps=2, padding="right", layerdrop=0.0, classes=None):
  """`(eager losses, losses, eager grad norms, grad norms)` of `steps` clipped AdamW steps:
  torch's on CPU against `jb.train_step` of the whole model (after `jb.bridge_modules(model,
  classes)` when given), called with the padded batch."""
  model, moved = build(name, layerdrop)
  if classes:
    jb.bridge_modules(moved, classes)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    return zoo.eager_against_train_step(model, moved, batch(name, padding), steps)


LR = 2.0 ** 10


def gradients(name, padding="right", classes=(), one_node=False):
  """`(eager loss, loss, worst relative gradient error, regions)` of one forward and backward on
  `batch(name, padding)`: eager CPU torch against the XLA copy after `jb.bridge_modules(moved,
  classes)`, whose gradients come from `loss.backward()` or, `one_node`, from one `jb.train_step`
  with `jb.optim.SGD(lr=LR)`: the parameters' change over LR (large, and a power of two, so the
  change stands far above the parameters' rounding and divides exactly). `regions`: the names of
  the bridged regions made (in `jb.bridge_report()`)."""
  model, moved = build(name)
  regions = jb.bridge_modules(moved, list(classes)) if classes else []
  inputs = batch(name, padding)
  expected = model(**inputs).loss
  expected.backward()
  on_device = {k: v.to("xla") for k, v in inputs.items()}
  if one_node:
    def loss_of(b):
      return moved(**b).loss

    before = {n: p.detach().clone() for n, p in moved.named_parameters()}
    loss = jb.train_step(loss_of, jb.optim.SGD(moved.parameters(), lr=LR))(on_device)
    grads = {n: (before[n] - p.detach()) / LR for n, p in moved.named_parameters()}
    regions.append("train_step(loss_of)")
  else:
    loss = moved(**on_device).loss
    loss.backward()
    grads = {n: p.grad for n, p in moved.named_parameters()}
  torch_xla.sync()  # one program for the loss and every gradient, not one per read
  worst = zoo.worst_gradient_error(grads, {n: p.grad for n, p in model.named_parameters()})
  return expected.item(), loss.item(), worst, regions
