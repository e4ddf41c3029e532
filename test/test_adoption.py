"""The package adopted in a torch_xla example-style trainer (a decoder-only model, the step compiled
by `torch_xla.compile`, `torch.optim.Adam`): the decoder layers bridged by class, and the step as
`jb.train_step` with `jb.optim.AdamW(weight_decay=0)`, give the losses and parameters of the
unmodified LazyTensor run and of eager CPU torch. `scripts/bench_examples.py` runs pytorch/xla's
own example scripts the same way (docs/performance.md)."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import torch_xla_jaxbridge as jb

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN = 64, 32, 4, 2, 96


class Norm(nn.Module):
  """Root-mean-square normalisation with a learned scale, computed in float32."""

  def __init__(self):
    super().__init__()
    self.scale = nn.Parameter(torch.ones(DIM))

  def forward(self, x):
    x32 = x.float()
    return self.scale * (x32 * (x32.square().mean(-1, keepdim=True) + 1e-6).rsqrt()).to(x.dtype)


class Block(nn.Module):
  """Pre-norm block: attention with shared key/value heads (no mask), then a gated MLP."""

  def __init__(self):
    super().__init__()
    self.norm1, self.norm2 = Norm(), Norm()
    head = DIM // HEADS
    self.wq, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
    self.wkv = nn.Linear(DIM, 2 * KV_HEADS * head, bias=False)
    self.gate = nn.Linear(DIM, HIDDEN, bias=False)
    self.up = nn.Linear(DIM, HIDDEN, bias=False)
    self.down = nn.Linear(HIDDEN, DIM, bias=False)

  def forward(self, x):
    b, s, _ = x.shape
    h = self.norm1(x)
    q = self.wq(h).unflatten(-1, (HEADS, -1)).transpose(1, 2)
    k, v = self.wkv(h).unflatten(-1, (2, KV_HEADS, -1)).permute(2, 0, 3, 1, 4)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1, dtype=torch.float32)
    x = x + self.wo((weights.to(q.dtype) @ v).transpose(1, 2).reshape(b, s, DIM))
    h = self.norm2(x)
    return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):

  def __init__(self, layers=2):
    super().__init__()
    self.embed = nn.Embedding(VOCAB, DIM)
    self.blocks = nn.ModuleList(Block() for _ in range(layers))
    self.norm = Norm()
    self.head = nn.Linear(DIM, VOCAB, bias=False)

  def forward(self, tokens):
    h = self.embed(tokens)
    for block in self.blocks:
      h = block(h)
    return self.head(self.norm(h))


def batches(steps):
  gen = torch.Generator().manual_seed(5)
  return [(torch.randint(0, VOCAB, (2, 8), generator=gen),
           torch.randint(0, VOCAB, (2, 8), generator=gen)) for _ in range(steps)]


def cross_entropy(model):
  return lambda data, target: F.cross_entropy(model(data).view(-1, VOCAB), target.view(-1))


def train(model, mode, device, steps=3):
  """The losses of `steps` steps of the example's trainer pattern, adopted as `mode` says."""
  if mode == "by class":
    assert jb.bridge_modules(model, ["Block"]) == ["blocks.0", "blocks.1"]
  loss_of = cross_entropy(model)
  if mode == "train_step":
    optimizer = jb.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    step = jb.train_step(loss_of, optimizer)
  else:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(data, target):
      optimizer.zero_grad()
      loss = loss_of(data, target)
      loss.backward()
      optimizer.step()
      return loss

  if device != "cpu":
    step = torch_xla.compile(step, full_graph=True)
  return [step(data.to(device), target.to(device)).item() for data, target in batches(steps)]


@pytest.fixture(scope="module")
def runs():
  """`mode -> (losses, trained model)` from one starting model: eager CPU, the unmodified
  LazyTensor run, and the two adoptions; with the trace-cache misses and bridge report rows of the
  by-class run."""
  torch.manual_seed(0)
  model = Decoder()
  found = {}
  for mode, device in [("eager", "cpu"), ("unmodified", "xla"), ("by class", "xla"),
                       ("train_step", "xla")]:
    moved = copy.deepcopy(model).to(device)
    jb.clear_cache()
    found[mode] = (train(moved, mode, device), moved)
    if mode == "by class":
      found["by class misses"] = jb.cache_info().misses
      found["by class rows"] = [jb.bridge_report().row(p) for p in ("blocks.0", "blocks.1")]
  return found


@pytest.mark.parametrize("mode", ["by class", "train_step"])
def test_the_adopted_trainer_gives_the_unmodified_and_eager_losses(runs, mode):
  losses, moved = runs[mode]
  (eager, eager_model), (lazy, lazy_model) = runs["eager"], runs["unmodified"]
  assert len(set(losses)) == 3  # the model trains: each step's loss differs
  assert losses == pytest.approx(lazy, rel=1e-5, abs=1e-6)
  assert losses == pytest.approx(eager, rel=1e-5, abs=1e-6)
  for (name, p), q, r in zip(moved.named_parameters(), lazy_model.parameters(),
                             eager_model.parameters()):
    torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-5,
                               msg=name)
    torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_layers_bridged_by_class_share_one_trace_and_stay_bridged(runs):
  assert runs["by class misses"] == 2  # one forward and one backward for both identical blocks
  assert all(row is not None and row.status == "bridged" for row in runs["by class rows"])
