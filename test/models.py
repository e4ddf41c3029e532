"""Small torch models shared by the tests, in plain PyTorch; the Llama-style pieces are the
recipes' own."""
import math

import torch.nn.functional as F
from torch import nn

from torch_xla_jaxbridge.recipes.llama import (CHECKPOINT_NAMES, Attention, DecoderLayer,  # noqa
                                               MoE, RMSNorm, SwiGLU, rotary)


class MLP(nn.Module):

  def __init__(self, d_in=8, hidden=32, d_out=4):
    super().__init__()
    self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

  def forward(self, x):
    return self.fc2(F.gelu(self.fc1(x)))


class ConvNet(nn.Module):

  def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(3, 8, 3, padding=1)
    self.bn = nn.BatchNorm2d(8)
    self.head = nn.Linear(8, 5)

  def forward(self, x):
    h = F.relu(self.bn(self.conv(x)))
    return self.head(h.mean(dim=(2, 3)))


class TiedLM(nn.Module):
  """Embedding and output projection share one weight."""

  def __init__(self, vocab=50, dim=16):
    super().__init__()
    self.embed = nn.Embedding(vocab, dim)
    self.norm = nn.LayerNorm(dim)
    self.out = nn.Linear(dim, vocab, bias=False)
    self.tie()

  def tie(self):
    """Shares the weight; call again after `.to('xla')`, which gives each name its own copy."""
    self.out.weight = self.embed.weight

  def forward(self, tokens):
    return self.out(self.norm(self.embed(tokens))) / math.sqrt(16)
