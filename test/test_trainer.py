"""The Hugging Face `Trainer`, the loop most torch_xla users train through, adopted with the
package's lines (docs/models.md, "Hugging Face Trainer"): a tiny grouped-query Llama with the
default attention, `pin_memory` on (the Trainer's default), two epochs, against the same run in
plain torch_xla."""
import warnings

import torch
import transformers as tf

import torch_xla_jaxbridge as jb

STEPS_PER_EPOCH, EPOCHS, BATCH, LENGTH = 2, 2, 4, 16


def tiny_llama():
  """A grouped-query Llama (4 heads, 2 key/value heads) with transformers' default attention."""
  config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)
  torch.manual_seed(0)
  return tf.LlamaForCausalLM(config)


def samples():
  ids = torch.randint(0, 128, (STEPS_PER_EPOCH * BATCH, LENGTH),
                      generator=torch.Generator().manual_seed(1))
  return [{"input_ids": row, "labels": row} for row in ids]


class LossLog(tf.TrainerCallback):
  """The loss of every step, as the Trainer logs it."""

  def __init__(self):
    self.losses = []

  def on_log(self, args, state, control, logs=None, **kwargs):
    if logs and "loss" in logs:
      self.losses.append(logs["loss"])


def train(model, tmp_path, optimizer=None):
  """Two epochs of `Trainer.train()`: (losses, steps run, the trained parameters on the CPU)."""
  args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                              num_train_epochs=EPOCHS, optim="adamw_torch", learning_rate=1e-3,
                              logging_steps=1, report_to=[], save_strategy="no",
                              disable_tqdm=True, seed=0, dataloader_pin_memory=True)
  log = LossLog()
  optimizers = (optimizer, None) if optimizer is not None else (None, None)
  trainer = tf.Trainer(model=model, args=args, train_dataset=samples(), callbacks=[log],
                       optimizers=optimizers)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "pin_memory ... no accelerator is found"
    trainer.train()
  params = {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}
  return log.losses, trainer.state.global_step, params


def test_trainer_with_layers_bridged_and_the_package_optimizer_equals_plain(tmp_path):
  plain_losses, plain_steps, plain_params = train(tiny_llama(), tmp_path / "plain")
  model = tiny_llama().to("xla")
  bridged = jb.bridge_modules(model, ["LlamaDecoderLayer"])
  optimizer = jb.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
  losses, steps, params = train(model, tmp_path / "bridged", optimizer)

  assert str(torch.accelerator.current_accelerator()) != "jax"
  assert plain_steps == steps == STEPS_PER_EPOCH * EPOCHS and len(losses) == steps
  rows = [jb.bridge_report().row(path) for path in bridged]
  assert bridged == ["model.layers.0", "model.layers.1"]
  assert [r.status for r in rows] == ["bridged", "bridged"], [r.reason for r in rows]
  torch.testing.assert_close(losses, plain_losses, rtol=0, atol=1e-4)  # the Trainer rounds to 4
  for name, value in plain_params.items():
    torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=name)
