"""jb.train_step: loss, gradients and jb.optim.AdamW's update as one graph node, against eager CPU
torch (AdamW, clip_grad_norm_, LambdaLR); one node, one trace under a changing learning rate;
buffers written back; fresh randomness; optimizer hooks and schedulers; the model found however
the loss reaches it (objects, methods, partials, arguments, a Hugging Face model); errors."""
import copy
import dataclasses
import functools
import re
import types
import warnings

import pytest
import torch
import torch_xla
import transformers

import torch_xla_jaxbridge as jb
import zoo


def model_on(dev):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.BatchNorm1d(8),
                             torch.nn.Linear(8, 3)).to(dev)


def groups(model):  # the second group lists the last layer first: not the order the loss reads
  return [{"params": model[3].parameters(), "lr": 0.02, "weight_decay": 0.0},
          {"params": [*model[2].parameters(), *model[0].parameters()], "amsgrad": True}]


def batches(steps):
  gen = torch.Generator().manual_seed(3)
  return [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen))
          for _ in range(steps)]


def loss_of(model):
  return lambda x, y: (model(x) - y).square().mean()


@pytest.mark.parametrize("clip", [None, 0.3])
def test_matches_eager_cpu_adamw_with_clipping_and_a_schedule(dev, clip):
  cpu_model = model_on("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  options = dict(lr=0.05, weight_decay=0.1, betas=(0.8, 0.95))
  ref = torch.optim.AdamW(groups(cpu_model), **options)
  ours = jb.optim.AdamW(groups(xla_model), max_grad_norm=clip, **options)
  schedules = [torch.optim.lr_scheduler.LambdaLR(o, jb.optim.warmup_cosine(2, 6))
               for o in (ref, ours)]
  step = jb.train_step(loss_of(xla_model), ours)
  ref_losses, ref_norms, losses, norms = [], [], [], []
  for x, y in batches(6):
    ref.zero_grad()
    loss = loss_of(cpu_model)(x, y)
    loss.backward()
    ref_norms.append(torch.nn.utils.clip_grad_norm_(cpu_model.parameters(), clip or float("inf")))
    ref.step()
    ref_losses.append(loss.detach())
    losses.append(step(x.to(dev), y.to(dev)))
    norms.append(ours.grad_norm)
    for schedule in schedules:
      schedule.step()
    torch_xla.sync()
  torch.testing.assert_close(torch.stack([l.cpu() for l in losses]), torch.stack(ref_losses))
  if clip is None:  # computed only for clipping
    assert norms == [None] * len(ref_norms)
  else:
    torch.testing.assert_close(torch.stack([n.cpu() for n in norms]), torch.stack(ref_norms))
  if clip is not None:
    assert all(n > clip for n in ref_norms)  # clipping was active every step
  for (name, a), b in zip(xla_model.state_dict().items(), cpu_model.state_dict().values()):
    torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=name)  # buffers too
  assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
  for a, b in zip(ours.state_dict()["state"].values(), ref.state_dict()["state"].values()):
    for key in b:
      torch.testing.assert_close(a[key].cpu(), b[key], rtol=1e-5, atol=1e-6)


def test_one_graph_node_one_trace_while_the_learning_rate_changes(dev):
  model = model_on(dev)
  opt = jb.optim.AdamW(model.parameters(), lr=0.01, max_grad_norm=1.0)
  schedule = torch.optim.lr_scheduler.LambdaLR(opt, jb.optim.warmup_linear(2, 5))
  step = jb.train_step(loss_of(model), opt)
  for i, (x, y) in enumerate(batches(5)):
    loss = step(x.to(dev), y.to(dev))
    if i == 1:  # (the first step also makes the zero moments)
      ir = torch_xla._XLAC._get_xla_tensors_text([loss, opt.grad_norm, *model.parameters()])
      ops = [line.split(" = ")[1] for line in ir.splitlines() if " = " in line]
      nodes = [op for op in ops if "device_data()" not in op]
      assert len(nodes) == 1 and "xla::_lambda__train_step(" in nodes[0]  # nothing else
    schedule.step()
    torch_xla.sync()
  assert jb.cache_info().misses == 1
  assert all(p.grad is None for p in model.parameters())  # gradients stay inside the node


def test_an_optimizer_step_for_hooks_and_schedulers(dev):
  model = model_on(dev)
  opt = jb.optim.AdamW(model.parameters(), lr=0.01)
  calls = []
  opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
  schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
  step = jb.train_step(loss_of(model), opt)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # torch warns when a scheduler steps before the optimizer
    for x, y in batches(2):
      step(x.to(dev), y.to(dev))
      schedule.step()
  assert calls == [opt, opt]
  assert opt.param_groups[0]["lr"] == 0.0025


def test_randomness_is_fresh_each_step_and_follows_the_seed(dev):
  def run():
    torch.manual_seed(0)
    torch_xla.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(6, 1)).to(dev)
    opt = jb.optim.AdamW(model.parameters(), lr=0.0)  # the weights stay: only the masks differ
    step = jb.train_step(lambda x: model(x).sum(), opt)
    x = torch.ones(4, 6, device=dev)
    return [step(x).item() for _ in range(3)]

  first = run()
  assert len(set(first)) == 3
  assert run() == first


def test_a_layer_policy_saves_memory_inside_the_one_node_step(dev):
  def report(remat):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 64)) for _ in range(4)]
    model = torch.nn.Sequential(*[jb.BridgeModule(l, remat=remat) for l in layers]).to(dev)
    opt = jb.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(512, 64, device=dev)
    step = jb.train_step(lambda x: model(x).square().mean(), opt)
    step(x)
    torch_xla.sync()
    result = jb.memory_report(step, x)
    # parameters and both moments are written over their old buffers
    assert result.alias_bytes == 3 * sum(p.numel() * 4 for p in model.parameters())
    return result

  # the recomputation runs in the backward (not merged with the forward by XLA): less kept
  assert report("full").temp_bytes < 0.7 * report(None).temp_bytes


def test_bad_input_says_what_to_do(dev):
  model = model_on(dev)
  names = ", ".join(jb.optim.optimizers())
  with pytest.raises(jb.errors.BadArgumentError, match=re.escape(
      f"a jb.optim optimizer ({names}). Use one of those, or call loss.backward() and "
      f"optimizer.step()")):
    jb.train_step(loss_of(model), torch.optim.AdamW(model.parameters()))
  opt = jb.optim.AdamW(model.parameters())
  x, y = (t.to(dev) for t in batches(1)[0])
  with pytest.raises(jb.errors.BridgeError, match="must return the loss, one floating-point "
                     "scalar tensor"):
    jb.train_step(lambda x, y: (model(x) - y).square(), opt)(x, y)
  other = torch.nn.Linear(6, 3).to(dev)
  with pytest.raises(jb.errors.BadArgumentError, match="none of the tensors .* is a parameter of "
                     "the optimizer"):
    jb.train_step(lambda x, y: (other(x) - y).square().mean(), opt)(x, y)


class Holder:  # a plain object, not a module (a transformers Trainer, a config namespace)
  pass


class Trainer:
  def __init__(self, model):
    self.model, self.args = model, types.SimpleNamespace(scale=0.5, logging_steps=10)

  def compute_loss(self, x, y):
    return (self.model(x) - y).square().mean() * self.args.scale

  __call__ = compute_loss


@dataclasses.dataclass
class Setup:
  models: dict
  weight: torch.Tensor  # not trained: an input read fresh each step


def _scaled(model, x, y, scale=1.0):
  return (model(x) - y).square().mean() * scale


def holder_attribute(model):
  trainer = Holder()
  trainer.model = model
  return lambda x, y: (trainer.model(x) - y).square().mean()


def dataclass_with_a_dict(model):
  setup = Setup({"student": model}, torch.linspace(0.5, 1.5, 3).to(next(model.parameters()).device))
  return lambda x, y: ((setup.models["student"](x) - y) * setup.weight).square().mean()


def lambda_calling_a_method(model):
  trainer = Trainer(model)
  return lambda x, y: trainer.compute_loss(x, y)


SHAPES = {"holder attribute": holder_attribute, "dataclass with a dict": dataclass_with_a_dict,
          "bound method": lambda model: Trainer(model).compute_loss,
          "lambda calling a method": lambda_calling_a_method,
          "callable object": Trainer,
          "nested partial": lambda model: functools.partial(functools.partial(_scaled, model),
                                                            scale=0.5),
          "module argument": lambda model: _scaled}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_model_is_found_wherever_the_loss_reaches_it(dev, shape):
  cpu_model = model_on("cpu")
  xla_model = copy.deepcopy(cpu_model).to(dev)
  ref = torch.optim.AdamW(cpu_model.parameters(), lr=0.05)
  ours = jb.optim.AdamW(xla_model.parameters(), lr=0.05)
  ref_loss_fn, loss_fn = SHAPES[shape](cpu_model), SHAPES[shape](xla_model)
  step = jb.train_step(loss_fn, ours, fallback=False)
  given = (lambda m, *b: (m, *b)) if shape == "module argument" else (lambda m, *b: b)
  ref_losses, losses = [], []
  for x, y in batches(3):
    ref.zero_grad()
    loss = ref_loss_fn(*given(cpu_model, x, y))
    loss.backward()
    ref.step()
    ref_losses.append(loss.detach())
    losses.append(step(*given(xla_model, x.to(dev), y.to(dev))))
    torch_xla.sync()
  torch.testing.assert_close(torch.stack([l.cpu() for l in losses]), torch.stack(ref_losses))
  for (name, a), b in zip(xla_model.state_dict().items(), cpu_model.state_dict().values()):
    torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=name)  # buffers too
  assert jb.cache_info().misses == 1


@pytest.mark.parametrize("holder", [
    "plain object", pytest.param("transformers.Trainer.compute_loss", marks=pytest.mark.slow)])
def test_a_hugging_face_model_held_by_a_trainer_object(dev, tmp_path, holder):
  model, inputs = zoo.build("llama")
  moved = zoo.on_xla(model, "llama", "whole")[0]
  ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
  opt = jb.optim.AdamW(moved.parameters(), lr=1e-3)
  batch = {k: v.to(dev) for k, v in inputs.items()}
  if holder == "plain object":
    trainer = Holder()
    trainer.model = moved
    step = jb.train_step(lambda batch: trainer.model(**batch).loss, opt, fallback=False)
    call = lambda: step(batch)  # noqa: E731
  else:  # the model as an argument of a bound method of the real thing
    trainer = transformers.Trainer(model=moved, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True))
    step = jb.train_step(trainer.compute_loss, opt, fallback=False)
    call = lambda: step(trainer.model, batch)  # noqa: E731
  ref_losses, losses = [], []
  for _ in range(3):
    ref.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    ref.step()
    ref_losses.append(loss.item())
    losses.append(call())
    torch_xla.sync()
  assert [l.item() for l in losses] == pytest.approx(ref_losses, rel=1e-4)
  assert losses[-1].item() < losses[0].item()
  for (name, a), b in zip(moved.named_parameters(), model.parameters()):
    torch.testing.assert_close(a.cpu(), b.detach(), rtol=1e-4, atol=1e-5, msg=name)
  assert jb.cache_info().misses == 1


class Extension:  # holds its values as a C extension object does: no `__dict__` to read
  __slots__ = ("model",)


def test_a_model_the_search_cannot_reach_is_named_with_the_fixes(dev):
  model = model_on(dev)
  trainer = Holder()
  trainer.ext, trainer.head = Extension(), torch.nn.Linear(3, 3).to(dev)
  trainer.ext.model = model
  opt = jb.optim.AdamW([*model.parameters(), *trainer.head.parameters()])
  x, y = (t.to(dev) for t in batches(1)[0])
  fixes = (r".*Pass the model as an argument \(`jb.train_step\(lambda model, batch: "
           r"model\(\*\*batch\).loss, opt\)`, called as `step\(model, batch\)`\), or read it into "
           r"a variable the loss function closes over \(`model = trainer.model`")
  stopped = re.escape("The search for captured tensors stopped at `trainer.ext` (of type "
                      "Extension: no `__dict__`, so its attributes cannot be read).")
  with pytest.raises(jb.errors.UsageError, match="none of the tensors _lambda_ reads .* what it "
                     "captures: no module or tensor\\) is a parameter of the optimizer. " +
                     stopped + fixes):
    jb.train_step(lambda x, y: (trainer.ext.model(x) - y).square().mean(), opt)(x, y)
  with pytest.raises(jb.errors.CapturedTensorError, match=r"not an input .* used at .*"
                     r"trainer.head\(trainer.ext.model\(x\)\).*" + stopped):
    jb.train_step(lambda x, y: (trainer.head(trainer.ext.model(x)) - y).square().mean(), opt,
                  fallback=False)(x, y)


def test_a_parameter_swapped_into_a_group_in_place_is_trained(dev):
  """A new weight put in the model and in the same slot of the group's list (a re-init, a merged
  adapter): the list object and its length are unchanged; it trains as under loss.backward()
  and opt.step()."""
  def run(one_node):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).to(dev)
    opt = jb.optim.AdamW(model.parameters(), lr=0.1)
    loss_fn = lambda x, y: (model(x) - y).square().mean()  # noqa: E731
    step = jb.train_step(loss_fn, opt) if one_node else None
    x, y = torch.ones(4, 4, device=dev), torch.zeros(4, 1, device=dev)
    for i in range(4):
      if i == 2:
        old = model[0].weight
        model[0].weight = new = torch.nn.Parameter(old.detach().clone())
        group = opt.param_groups[0]["params"]
        group[group.index(old)] = new
        opt.state.pop(old, None)
      if step is not None:
        step(x, y)
      else:
        loss_fn(x, y).backward()
        opt.step()
        opt.zero_grad()
      torch_xla.sync()
    return model[0].weight.detach().cpu(), opt.state[model[0].weight]["step"]

  weight, steps = run(one_node=True)
  plain_weight, plain_steps = run(one_node=False)
  assert steps == plain_steps == 2
  torch.testing.assert_close(weight, plain_weight, rtol=1e-5, atol=1e-6)
