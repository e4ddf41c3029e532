"""Hugging Face gradient checkpointing (`model.gradient_checkpointing_enable()`, torch's checkpoint
around each decoder layer) through the bridge: layers bridged by class, `BridgeModule` layers and
the whole step in `jb.train_step` train with eager CPU's losses and gradients (eager CPU with
checkpointing on), recompute for real (the compiled step needs less memory), and eager CPU code
keeps torch's own checkpoint."""
import copy
import gc

import pytest
import torch
import torch_xla
import transformers

import torch_xla_jaxbridge as jb


def _llama(layers=2, **config):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, attn_implementation="eager", **config)
  return transformers.LlamaForCausalLM(cfg).train()


def _tokens(seq=16):
  return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))


def _enable(model, reentrant):
  model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _eager(model, reentrant, steps):
  """Eager CPU with gradient checkpointing on, SGD: (losses, gradients of the last step,
  parameters after the last step, how many times a layer's forward started)."""
  model = copy.deepcopy(model)
  _enable(model, reentrant)
  calls = []
  for layer in model.model.layers:
    layer.register_forward_pre_hook(lambda *_: calls.append(1))
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  tokens, losses = _tokens(), []
  for _ in range(steps):
    opt.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
  return losses, grads, dict(model.named_parameters()), len(calls)


def _bridged(moved, how):
  if how == "bridge_modules":
    assert jb.bridge_modules(moved, ["LlamaDecoderLayer"], fallback=False) == [
        "model.layers.0", "model.layers.1"]
  else:
    moved.model.layers = torch.nn.ModuleList(
        jb.BridgeModule(layer, fallback=False) for layer in moved.model.layers)


@pytest.mark.parametrize("how, reentrant, enabled", [
    ("bridge_modules", True, "before bridging"), ("bridge_modules", False, "after bridging"),
    ("BridgeModule", False, "before bridging"), ("BridgeModule", True, "after bridging")])
def test_bridged_layers_train_like_eager_with_checkpointing_on(how, reentrant, enabled):
  model = _llama()
  moved = copy.deepcopy(model).to("xla")
  if enabled == "before bridging":
    _enable(moved, reentrant)
  _bridged(moved, how)
  if enabled == "after bridging":
    _enable(moved, reentrant)
  eager_losses, eager_grads, _, eager_calls = _eager(model, reentrant, steps=1)
  assert eager_calls == 2 * 2  # eager CPU still runs torch's checkpoint: each layer twice
  tokens = _tokens().to("xla")
  loss = moved(input_ids=tokens, labels=tokens).loss
  loss.backward()
  torch_xla.sync()
  assert loss.item() == pytest.approx(eager_losses[0], rel=1e-5)
  for name, p in moved.named_parameters():
    torch.testing.assert_close(p.grad.cpu(), eager_grads[name], rtol=1e-4, atol=1e-6)
  rows = [r for r in jb.bridge_report().rows if r.kind == "module"][-2:]  # this model's layers
  assert [r.status for r in rows] == ["bridged", "bridged"]


def _train_step(model):
  return jb.train_step(lambda t: model(input_ids=t, labels=t).loss,
                       jb.optim.SGD(model.parameters(), lr=0.1), fallback=False)


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_whole_step_in_train_step_trains_like_eager_with_checkpointing_on(reentrant):
  model = _llama()
  eager_losses, _, eager_params, _ = _eager(model, reentrant, steps=2)
  moved = copy.deepcopy(model).to("xla")
  _enable(moved, reentrant)
  step, tokens = _train_step(moved), _tokens().to("xla")
  losses = [step(tokens) for _ in range(2)]
  torch_xla.sync()
  assert [loss.item() for loss in losses] == pytest.approx(eager_losses, rel=1e-5)
  for name, p in moved.named_parameters():
    torch.testing.assert_close(p.cpu(), eager_params[name], rtol=1e-4, atol=1e-6)


def _blocks_step(checkpointed, dropout=0.0):
  """`jb.train_step` of 4 residual MLP blocks, each through torch's checkpoint or not."""
  torch.manual_seed(0)
  blocks = torch.nn.ModuleList(torch.nn.Sequential(
      torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Dropout(dropout),
      torch.nn.Linear(512, 128)) for _ in range(4)).to("xla")

  def loss_fn(x):
    for block in blocks:
      x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed
               else block(x))
    return x.square().mean()
  return blocks, jb.train_step(loss_fn, jb.optim.SGD(blocks.parameters(), lr=0.1),
                               fallback=False)


def _compiled_memory(make):
  """The memory of the program that `run` of `run, model = make()` leaves pending; then nothing
  of it stays pending (a later report gathers every pending tensor)."""
  run, model = make()
  report = jb.memory_report(run, sync=False)
  for p in model.parameters():
    p.grad = None
  del model, run
  gc.collect()  # the model, its pending update and the cycles of its bridged forwards
  return report


def _blocks_run(checkpointed, x):
  blocks, step = _blocks_step(checkpointed)
  return lambda: step(x), blocks


def test_torch_checkpoint_in_the_one_node_step_recomputes():
  """The recomputation runs in a conditional XLA cannot fold: merged with the forward it
  repeats, the step needed more memory with the checkpoint than without (12.7 vs 10.9 MB)."""
  x = torch.randn(256, 128).to("xla")
  torch_xla.sync()
  off, on = [_compiled_memory(lambda: _blocks_run(checkpointed, x))
             for checkpointed in (False, True)]
  assert on.temp_bytes < 0.5 * off.temp_bytes, (off, on)


def test_dropout_in_a_checkpointed_block_draws_the_same_numbers_when_recomputed():
  """The block's dropout starts from the enclosing code's key, so the forward and its
  recomputation agree and the step equals the one without the checkpoint (same masks)."""
  x = torch.randn(256, 128).to("xla")
  results = []
  for checkpointed in (False, True):
    blocks, step = _blocks_step(checkpointed, dropout=0.5)
    torch_xla.manual_seed(3)
    loss = step(x)
    torch_xla.sync()
    results.append((loss.item(), [p.cpu() for p in blocks.parameters()]))
  (loss, params), (checkpointed_loss, checkpointed_params) = results
  assert checkpointed_loss == pytest.approx(loss, rel=1e-6)
  for got, want in zip(checkpointed_params, params):
    torch.testing.assert_close(got, want)


def _llama_run(how, checkpointed):
  """One training step (forward, backward; SGD in `train_step`) of a 4-layer Llama at sequence
  256, not yet run."""
  moved = _llama(layers=4).to("xla")
  if checkpointed:
    _enable(moved, True)
  tokens = _tokens(seq=256).to("xla")
  if how == "train_step":
    step = _train_step(moved)
    run = lambda: step(tokens)  # noqa: E731
  else:
    jb.bridge_modules(moved, ["LlamaDecoderLayer"], fallback=False)
    run = lambda: moved(input_ids=tokens, labels=tokens).loss.backward()  # noqa: E731
  torch_xla.sync()
  return run, moved


@pytest.mark.parametrize("how", ["bridge_modules", "train_step"])
def test_checkpointing_makes_the_compiled_step_smaller(how):
  """Each layer keeps only its inputs: its attention scores and MLP activations are computed
  again in the backward, not kept (XLA merged `train_step`'s recomputation with the forward
  before it ran in a conditional: the step needed more memory with checkpointing on than off)."""
  off, on = [_compiled_memory(lambda: _llama_run(how, checkpointed))
             for checkpointed in (False, True)]
  assert on.temp_bytes < 0.5 * off.temp_bytes, (off, on)
  assert on.total_bytes < off.total_bytes
