"""Hugging Face models nobody here wrote, trained as their users train them: padded batches with
attention masks, whole-model `jb.train_step`, LayerDrop, nested block outputs, bridging by class
name; against eager CPU (losses and gradient norms)."""
import copy

import pytest
import torch
import torch_xla

import heldout
import torch_xla_jaxbridge as jb


def step_row():
  return next(r for r in reversed(jb.bridge_report().rows) if r.kind == "step")


# Each model compiles its own programs (a few seconds each on 2 cores, and memory maps the test
# process keeps): one per kind in `make test`, the rest under `make slow`.
@pytest.mark.parametrize("name, padding", [
    ("qwen3", "left"), pytest.param("roberta", "right", marks=pytest.mark.slow),
    pytest.param("qwen3", "right", marks=pytest.mark.slow),
    pytest.param("t5", "right", marks=pytest.mark.slow),
    *[pytest.param(name, "right", marks=pytest.mark.slow)
      for name in ("distilbert", "electra", "gpt_neox", "bloom", "falcon")]])
def test_the_whole_step_stays_one_node_with_an_attention_mask(name, padding):
  """transformers asks whether it is being traced before reading the mask's values: inside
  bridged code it is told yes, as under torch.compile, so the step needs no fallback."""
  eager, losses, eager_norms, norms = heldout.train_steps(name, padding=padding)
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  assert step_row().status == "bridged"


@pytest.mark.parametrize("name", ["bart", pytest.param("opt", marks=pytest.mark.slow),
                                  pytest.param("pegasus", marks=pytest.mark.slow)])
def test_layerdrop_falls_back_around_the_layers_and_keeps_the_values(name):
  """BART and OPT draw a random number per layer to steer Python (LayerDrop; with probability 0
  the draw still happens): the step runs as LazyTensor glue around bridged layers."""
  eager, losses, eager_norms, norms = heldout.train_steps(name)
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  report = jb.bridge_report()
  assert step_row().status == "fallback" and "layerdrop" in step_row().reason
  layers = [r for r in report.rows if ".layers." in r.name and r.name.count(".") <= 6]
  assert layers and all(r.status == "bridged" for r in layers), str(report)


@pytest.mark.slow
def test_layerdrop_with_a_probability_trains():
  model, moved = heldout.build("bart", layerdrop=0.5)
  opt = jb.optim.AdamW(moved.parameters(), lr=1e-2)
  step = jb.train_step(lambda b: moved(**b).loss, opt)
  inputs = {k: v.to("xla") for k, v in heldout.batch("bart").items()}
  with pytest.warns(jb.errors.FallbackWarning, match="dropout_probability < self.layerdrop"):
    losses = [step(inputs) for _ in range(6)]
  torch_xla.sync()
  assert losses[-1].item() < losses[0].item()


def test_t5_blocks_return_their_position_bias_tuples_through_bridge_module():
  model, moved = heldout.build("t5")
  model.eval(), moved.eval()
  for stack in (moved.encoder, moved.decoder):
    stack.block = torch.nn.ModuleList(jb.BridgeModule(b, fallback=False) for b in stack.block)
  inputs = dict(heldout.batch("t5"), use_cache=False)
  expected = model(**inputs)
  out = moved(**{k: v.to("xla") if torch.is_tensor(v) else v for k, v in inputs.items()})
  out.loss.backward()
  expected.loss.backward()
  torch_xla.sync()  # one program for the outputs and every gradient, not one per read
  torch.testing.assert_close(out.logits.cpu(), expected.logits, rtol=1e-5, atol=1e-5)
  grads = {n: p.grad for n, p in model.named_parameters()}
  for n, p in moved.named_parameters():
    torch.testing.assert_close(p.grad.cpu(), grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_model_bridged_by_class_name_in_the_one_node_step_matches_eager():
  eager, losses, eager_norms, norms = heldout.train_steps("qwen3", classes=["Qwen3DecoderLayer"])
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)


def test_bridge_modules_by_class_name_with_backward_and_a_torch_optimizer():
  model, moved = heldout.build("qwen3")
  paths = jb.bridge_modules(moved, ["Qwen3DecoderLayer"])
  assert paths == ["model.layers.0", "model.layers.1"]
  inputs = heldout.batch("qwen3", padding="left")
  jb.clear_cache()
  loss = moved(**{k: v.to("xla") for k, v in inputs.items()}).loss
  loss.backward()
  torch_xla.sync()  # one program for the loss and every gradient, not one per read
  expected = model(**inputs).loss
  expected.backward()
  assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
  grads = {n: p.grad for n, p in model.named_parameters()}
  for n, p in moved.named_parameters():
    torch.testing.assert_close(p.grad.cpu(), grads[n], rtol=1e-4, atol=1e-6)
  # one trace each way for both layers (each passed its own slot of the cache, `layer_slots`)
  assert jb.cache_info().misses == 2
  moved(**{k: v.to("xla") for k, v in inputs.items()}).loss.backward()
  assert jb.cache_info().misses == 2  # the second step traces nothing
  rows = [jb.bridge_report().row(p) for p in paths]
  assert all(r is not None and r.status == "bridged" for r in rows)
  state = copy.deepcopy(moved).state_dict()  # a bridged model copies, its state as before
  assert state.keys() == model.state_dict().keys()


@pytest.mark.parametrize("name", [
    "deepseek_v3", "qwen2_moe", pytest.param("olmoe", marks=pytest.mark.slow),
    pytest.param("granitemoe", marks=pytest.mark.slow)])
def test_mixture_of_experts_blocks_train_as_one_node_with_eagers_values(name):
  """Their routers one-hot encode `topk` indices (int64 only: inside bridged code they are int64,
  as in torch) and their expert loops read which tokens each expert got (`torch.where(mask)`,
  `nonzero()`, `.tolist()`); inside bridged code every expert runs densely, weighted."""
  eager, losses, eager_norms, norms = heldout.train_steps(name, steps=1)
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  assert step_row().status == "bridged"


def test_gptj_trains_as_one_node_reading_its_plain_tensor_rotary_table():
  """GPT-J keeps its rotary table as a plain tensor attribute on the CPU and moves it inside
  `forward`: the bridged step reads it as an input (on the device), as a buffer."""
  eager, losses, eager_norms, norms = heldout.train_steps("gptj", steps=1)
  assert losses == pytest.approx(eager, rel=1e-5)
  assert norms == pytest.approx(eager_norms, rel=1e-4)
  assert step_row().status == "bridged"
