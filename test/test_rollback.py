"""A region that falls back leaves the host as plain torch_xla leaves it: the failed try's random
draws, attribute writes, appends and counters are undone before the plain run, for each entry
point (`bridge_modules`, `bridge`, `train_step`), against plain torch_xla with the same seeds."""
import random
import warnings

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model
import transformers

import torch_xla_jaxbridge as jb

CALLS = []  # what a forward appends to, a global of its module
STEPS = 0  # what a forward counts in, a global of its module


class Noisy(torch.nn.Module):
  """Draws NumPy, Python and torch CPU random numbers, writes attributes, appends to its own
  list and to a global one, then reaches a line that cannot be traced (a tensor's value steers
  Python)."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)
    self.count, self.seen, self.last = 0, [], None

  def forward(self, x):
    global STEPS
    mask = torch.tensor(np.random.rand(4) > 0.5, dtype=torch.float32).to(x.device)
    coin = random.random() + torch.rand(()).item()
    self.count += 1
    self.seen.append(coin)
    self.last = coin
    CALLS.append(coin)
    STEPS += 1
    y = self.lin(x) * mask
    if y.sum() > 0:  # data-dependent Python control flow: the region falls back
      y = y * coin
    return y


def _seeded():
  torch.manual_seed(0)
  np.random.seed(0)
  random.seed(0)
  torch_xla.manual_seed(0)
  CALLS.clear()
  global STEPS
  STEPS = 0


def _host(model):
  """What the host holds after the run: the module's attributes, the globals, the streams."""
  return (model.count, list(model.seen), model.last, list(CALLS), STEPS, np.random.rand(),
          random.random(), torch.rand(()).item())


def _run(adopt, steps=2):
  """`(outputs, host)` of `steps` calls of a seeded `Noisy` on the XLA device, adopted by
  `adopt(model)` (which returns the callable to run)."""
  _seeded()
  model = Noisy().to("xla")
  call = adopt(model)
  x = torch.ones(2, 4, device="xla")
  outputs = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    for _ in range(steps):
      outputs.append(call(x).detach().cpu())
  return outputs, _host(model)


def _by_class(model):
  jb.bridge_modules(model, ["Noisy"])
  return model


def _function(model):
  return jb.bridge(lambda x: model(x))


def _step(model):
  step = jb.train_step(lambda x: model(x).sum(), jb.optim.SGD(model.parameters(), lr=0.0))
  return lambda x: step(x).reshape(1)


def _plain_step(model):
  return lambda x: model(x).sum().reshape(1)


@pytest.mark.parametrize("adopt, plain", [(_by_class, lambda m: m), (_function, lambda m: m),
                                          (_step, _plain_step)],
                         ids=["bridge_modules", "bridge", "train_step"])
def test_a_fallback_leaves_the_host_as_a_plain_run_does(adopt, plain):
  outputs, host = _run(adopt)
  plain_outputs, plain_host = _run(plain)
  assert host == plain_host  # counters, lists, globals and every random stream
  for got, want in zip(outputs, plain_outputs):
    torch.testing.assert_close(got, want)
  assert jb.bridge_report().fallbacks()  # the region did fall back


def test_a_failed_try_leaves_no_container_write_and_no_rebinding():
  class Scratch(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.lin = torch.nn.Linear(2, 2)
      self.table = {"kept": 1}

    def forward(self, x):
      self.table["tries"] = self.table.get("tries", 0) + 1  # a write into a dict it holds
      self.table = dict(self.table)  # and a dict it replaces
      y = self.lin(x)
      return y * 2 if y.sum() > 0 else y

  model = Scratch().to("xla")
  table = model.table
  jb.bridge_modules(model, ["Scratch"])
  with pytest.warns(jb.errors.FallbackWarning):
    model(torch.ones(1, 2, device="xla"))
  # as after one plain call: the first dict written once, then replaced by a copy of it
  assert table == {"kept": 1, "tries": 1}
  assert model.table is not table and model.table == table


class RandomFlip(torch.nn.Module):
  """Flips its input on a host coin: Python's `random` or NumPy's global stream."""

  def __init__(self, draw):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)
    self.draw = draw

  def forward(self, x):
    if self.training and self.draw() < 0.5:
      x = x.flip(-1)
    return self.lin(x)


DRAWS = {"random": (lambda: random.random(), "Python random numbers (random)"),
         "numpy": (lambda: np.random.rand(), "NumPy random numbers (numpy.random)")}


def _flips(adopt, draw, calls=6):
  """`(values, streams, reasons)`: `calls` calls of a seeded `RandomFlip` adopted by
  `adopt(model)`, what Python's and NumPy's streams draw next, and the reasons of the regions
  that fell back."""
  before = jb.bridge_report()
  torch.manual_seed(0)
  random.seed(0)
  np.random.seed(0)
  call = adopt(RandomFlip(draw).to("xla"))
  x = torch.arange(8.).reshape(2, 4).to("xla")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    values = [call(x).sum().item() for _ in range(calls)]
  reasons = [r.reason for r in jb.bridge_report(since=before).fallbacks()]
  return values, (random.random(), np.random.rand()), reasons


def _flip_step(model):
  step = jb.train_step(lambda x: model(x).sum(), jb.optim.SGD(model.parameters(), lr=0.0))
  return lambda x: step(x)


def _flip_class(model):
  jb.bridge_modules(model, [RandomFlip])
  return model


@pytest.mark.parametrize("stream", DRAWS)
@pytest.mark.parametrize("adopt", [jb.BridgeModule, _flip_class, _function, _flip_step],
                         ids=["BridgeModule", "bridge_modules", "bridge", "train_step"])
def test_host_random_draws_fall_back_and_draw_at_every_call_as_plain_code(adopt, stream):
  """A trace that draws from Python's or NumPy's global stream would replay its numbers: the
  region falls back, so each call draws, as plain torch_xla's does, and says what was drawn."""
  draw, what = DRAWS[stream]
  values, streams, reasons = _flips(adopt, draw)
  plain_values, plain_streams, _ = _flips(lambda m: m, draw)
  assert len(set(plain_values)) == 2  # both branches taken in 6 calls
  assert values == pytest.approx(plain_values, rel=1e-6)
  assert streams == plain_streams
  assert reasons and all(r.startswith("HostRandomnessError: ") and f"draws {what} on the host: "
                         "each call would need its own trace" in r for r in reasons)


def test_host_random_draws_raise_in_strict_mode():
  model = RandomFlip(random.random).to("xla")
  with pytest.raises(jb.errors.HostRandomnessError, match=r"RandomFlip draws Python random "
                     r"numbers \(random\) on the host: each call would need its own trace"):
    jb.BridgeModule(model, fallback=False)(torch.ones(2, 4, device="xla"))


def _noise_class(model):
  jb.bridge_modules(model, [SeededNoise])
  return model


class SeededNoise(torch.nn.Module):
  """Adds noise drawn from a seeded `torch.Generator` it holds."""

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(4, 4)
    self.generator = torch.Generator().manual_seed(7)

  def forward(self, x):
    return self.lin(x) + torch.randn(x.shape, generator=self.generator, device=x.device)


@pytest.mark.parametrize("adopt", [jb.BridgeModule, _noise_class,
                                   _function, _flip_step],
                         ids=["BridgeModule", "bridge_modules", "bridge", "train_step"])
def test_a_torch_generator_the_code_holds_falls_back_and_draws_as_plain_code(adopt):
  """A trace cannot draw from the generator (it would replay one draw at every call, unseeded by
  it): the region falls back, and its values and the generator's state are plain torch_xla's."""
  def run(adopt_):
    before = jb.bridge_report()
    torch.manual_seed(0)
    model = SeededNoise().to("xla")
    call = adopt_(model)
    x = torch.ones(2, 4).to("xla")
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", jb.errors.FallbackWarning)
      values = [call(x).sum().item() for _ in range(3)]
    reasons = [r.reason for r in jb.bridge_report(since=before).fallbacks()]
    return values, model.generator.get_state(), reasons

  values, state, reasons = run(adopt)
  plain_values, plain_state, _ = run(lambda m: m)
  assert len(set(plain_values)) == 3  # a new draw at each call
  assert values == pytest.approx(plain_values, rel=1e-6)
  assert torch.equal(state, plain_state)
  assert reasons and all(r.startswith("HostRandomnessError: randn draws from a torch.Generator")
                         for r in reasons)


def test_a_torch_generator_raises_in_strict_mode():
  with pytest.raises(jb.errors.HostRandomnessError, match="draws from a torch.Generator the code "
                     "holds: plain torch_xla draws from it"):
    jb.BridgeModule(SeededNoise().to("xla"), fallback=False)(torch.ones(2, 4, device="xla"))


def test_a_forward_that_does_not_draw_keeps_one_trace():
  """The check reads the streams around traces only: a forward that does not draw (the coin
  is not reached in eval mode) bridges, traced once, and draws nothing."""
  jb.clear_cache()
  model = jb.BridgeModule(RandomFlip(random.random).to("xla").eval())
  x = torch.ones(2, 4, device="xla")
  state = random.getstate()
  with warnings.catch_warnings():
    warnings.simplefilter("error", jb.errors.FallbackWarning)
    values = [model(x).sum().item() for _ in range(4)]
  assert random.getstate() == state and len(set(values)) == 1
  info = jb.cache_info()
  assert (info.misses, info.hits) == (1, 3)


def _wav2vec2():
  from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

  config = Wav2Vec2Config(
      vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
      intermediate_size=24, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, mask_time_prob=0.3,
      mask_time_length=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
      feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, pad_token_id=0,
      ctc_loss_reduction="mean")
  torch.manual_seed(0)
  return Wav2Vec2ForCTC(config).train()


@pytest.mark.slow  # 40-120 s (make slow)
def test_wav2vec2_with_its_numpy_time_masks_trains_through_train_step_as_eager_does():
  """Its time masks are drawn with NumPy's global stream: the step that falls back draws them
  once, as eager does, so the masked positions and the losses are eager's."""
  model = _wav2vec2()
  moved = _wav2vec2().to("xla")
  torch.manual_seed(1)
  audio = torch.randn(2, 400)
  labels = torch.randint(1, 12, (2, 6))
  eager_opt = torch.optim.SGD(model.parameters(), lr=0.1)
  step = jb.train_step(lambda a, l: moved(input_values=a, labels=l).loss,
                       jb.optim.SGD(moved.parameters(), lr=0.1))
  np.random.seed(0)
  eager = []
  for _ in range(2):
    eager_opt.zero_grad()
    loss = model(input_values=audio, labels=labels).loss
    loss.backward()
    eager_opt.step()
    eager.append(loss.item())
  eager_stream = np.random.rand()
  np.random.seed(0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jb.errors.FallbackWarning)
    losses = [step(audio.to("xla"), labels.to("xla")).item() for _ in range(2)]
  assert losses == pytest.approx(eager, rel=1e-4)
  assert np.random.rand() == eager_stream


class _Gate(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)

  def forward(self, x):
    y = self.lin(x)
    return y if y.sum().item() > -1e9 else -y  # a value on the host: the region falls back


def _gate_step(model, x):
  return model(x).sum()


def _llama_step(model, x):  # with a cache (the config's default): fingerprinted layer calls
  return model(input_ids=x.long().clamp(0, 63)[:, :8], labels=x.long().clamp(0, 63)[:, :8]).loss


@pytest.mark.parametrize("case", ["a fallback", "layers with a cache"])
def test_the_xla_random_stream_after_a_bridged_step_is_plain_torch_xlas(case):
  """A random draw made before the bridged region in a step (NEFTune's noise, a dropout outside
  the layers) is an update of torch_xla's seed pending until the sync; putting the seed back
  after a fingerprint or a failed trace dropped it, and every later step drew other numbers than
  plain torch_xla (the Trainer's NEFTune losses differed from step 2)."""
  def run(bridged):
    torch.manual_seed(0)
    if case == "a fallback":
      model, step, adopt = _Gate().to("xla"), _gate_step, ["_Gate"]
    else:
      config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2)
      model, step, adopt = (transformers.LlamaForCausalLM(config).to("xla"), _llama_step,
                            ["LlamaDecoderLayer"])
    if bridged:
      jb.bridge_modules(model, adopt)
    torch_xla.manual_seed(5)
    drawn = []
    for _ in range(3):
      noise = torch.rand(4, 8, device="xla")
      step(model, torch.ones(4, 8, device="xla") * 9 + noise).backward()
      after = torch.rand(4, 8, device="xla")
      torch_xla.sync()
      drawn.append((after.cpu(), torch_xla.core.xla_model.get_rng_state()))
    return drawn

  plain, bridged = run(False), run(True)
  for (p_values, p_seed), (b_values, b_seed) in zip(plain, bridged):
    assert b_seed == p_seed
    assert torch.equal(b_values, p_values)
