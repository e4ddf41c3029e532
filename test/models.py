"""Small torch models shared by the tests: plain PyTorch, plus `checkpoint_name` marks (the
identity outside bridged code) with MaxText's names so remat presets apply."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from torch_xla_jaxbridge import checkpoint_name

CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj",
                    "mlpwi", "mlpwo")


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


class RMSNorm(nn.Module):

  def __init__(self, dim, eps=1e-6):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, positions, base=10000.0):
  """Rotary position embedding on the last dimension of x: (batch, heads, seq, head_dim)."""
  half = x.shape[-1] // 2
  freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
  angles = positions[:, None].to(torch.float32) * freqs[None, :]
  cos, sin = angles.cos(), angles.sin()
  x1, x2 = x[..., :half], x[..., half:]
  return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
  """Grouped-query attention with rotary embeddings and a causal mask."""

  def __init__(self, dim=32, heads=4, kv_heads=2):
    super().__init__()
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
    self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
    self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
    self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
    self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

  def forward(self, x, positions):
    b, s, _ = x.shape
    q = checkpoint_name(self.q_proj(x), "query_proj")
    k = checkpoint_name(self.k_proj(x), "key_proj")
    v = checkpoint_name(self.v_proj(x), "value_proj")
    q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
    k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
    v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
    q, k = rotary(q, positions), rotary(k, positions)
    repeat = self.heads // self.kv_heads
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return checkpoint_name(self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), "out_proj")


class SwiGLU(nn.Module):

  def __init__(self, dim=32, hidden=64):
    super().__init__()
    self.gate_proj = nn.Linear(dim, hidden, bias=False)
    self.up_proj = nn.Linear(dim, hidden, bias=False)
    self.down_proj = nn.Linear(hidden, dim, bias=False)

  def forward(self, x):
    gate = checkpoint_name(self.gate_proj(x), "mlpwi")
    up = checkpoint_name(self.up_proj(x), "mlpwi")
    return checkpoint_name(self.down_proj(F.silu(gate) * up), "mlpwo")


class DecoderLayer(nn.Module):
  """Llama-style pre-norm decoder layer: RMSNorm, rotary GQA attention, SwiGLU MLP."""

  def __init__(self, dim=32, heads=4, kv_heads=2, hidden=64):
    super().__init__()
    self.input_norm, self.post_norm = RMSNorm(dim), RMSNorm(dim)
    self.attn = Attention(dim, heads, kv_heads)
    self.mlp = SwiGLU(dim, hidden)

  def forward(self, x, positions):
    x = checkpoint_name(x, "decoder_layer_input")
    h = x + self.attn(self.input_norm(x), positions)
    return h + self.mlp(self.post_norm(h))


class MoE(nn.Module):
  """Top-2 mixture of experts, computed densely (every expert on every token, then combined)."""

  def __init__(self, dim=16, hidden=32, experts=4):
    super().__init__()
    self.router = nn.Linear(dim, experts, bias=False)
    self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))

  def forward(self, x):
    logits = self.router(x)
    weights, chosen = torch.topk(logits.softmax(-1), k=2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    combine = (F.one_hot(chosen, len(self.experts)).to(x.dtype) * weights[..., None]).sum(-2)
    outs = torch.stack([expert(x) for expert in self.experts], dim=-1)
    return (outs * combine[..., None, :]).sum(-1)


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
