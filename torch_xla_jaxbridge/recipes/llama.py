"""A Llama-style decoder in plain PyTorch: RMSNorm, rotary GQA attention, SwiGLU MLP, and its
Mixtral-style variant whose MLP is a top-k mixture of experts.

The standard tensors carry `checkpoint_name` marks with MaxText's names, so every remat preset
applies: `decoder_layer_input`, `query_proj`, `key_proj`, `value_proj`, `out_proj`, `mlpwi`,
`mlpwo`. Outside bridged code the marks are the identity.

Attention is `F.scaled_dot_product_attention`; `attention="flash"` runs it as the Pallas flash
kernel in the bridged layers (`jb.override_ops`, `ATTENTION`).
"""
import collections.abc
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge import errors, flash_attention
from torch_xla_jaxbridge import checkpoint_name, override_ops

CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj",
                    "mlpwi", "mlpwo")
# the op overrides each `model.attention` value applies to the decoder stack
ATTENTION = {"reference": {},
             "flash": {F.scaled_dot_product_attention: flash_attention.sdpa}}


class RMSNorm(nn.Module):

  def __init__(self, dim, eps=1e-6):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def reset_parameters(self):
    nn.init.ones_(self.weight)

  def forward(self, x):
    h = x.float()  # the statistics in float32 whatever the model's dtype
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x, positions, base=10000.0):
  """Rotary position embedding on the last dimension of x: (batch, heads, seq, head_dim)."""
  half = x.shape[-1] // 2
  freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
  angles = positions[:, None].to(torch.float32) * freqs[None, :]
  cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # bfloat16 stays bfloat16
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


class MoE(nn.Module):
  """Top-k mixture of SwiGLU experts, computed densely (every expert on every token, combined by
  the router's renormalised top-k weights): no data-dependent shapes."""

  def __init__(self, dim=16, hidden=32, experts=4, top_k=2):
    super().__init__()
    self.top_k = top_k
    self.router = nn.Linear(dim, experts, bias=False)
    self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))

  def forward(self, x):
    weights, chosen = torch.topk(self.router(x).softmax(-1), k=self.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    combine = (F.one_hot(chosen, len(self.experts)).to(x.dtype) * weights[..., None]).sum(-2)
    outs = torch.stack([expert(x) for expert in self.experts], dim=-1)
    return (outs * combine[..., None, :]).sum(-1)


class DecoderLayer(nn.Module):
  """Pre-norm decoder layer: RMSNorm, rotary GQA attention, SwiGLU MLP (or MoE with experts>0)."""

  def __init__(self, dim=32, heads=4, kv_heads=2, hidden=64, experts=0, top_k=2):
    super().__init__()
    self.input_norm, self.post_norm = RMSNorm(dim), RMSNorm(dim)
    self.attn = Attention(dim, heads, kv_heads)
    self.mlp = MoE(dim, hidden, experts, top_k) if experts else SwiGLU(dim, hidden)

  def forward(self, x, positions):
    x = checkpoint_name(x, "decoder_layer_input")
    h = x + self.attn(self.input_norm(x), positions)
    return h + self.mlp(self.post_norm(h))


class Llama(nn.Module):
  """Token embedding, a stack of decoder layers, a final norm and the output projection.

  Set `scan_remat` to a `remat=` value (or `use_scan = True`) to run the stack as one
  `jb.scan_layers` call; `layers` may also be replaced by a module taking `(h, positions)`, such
  as `jb.StackedLayers(model.layers)`. `attention="flash"` runs the stack under
  `ATTENTION["flash"]`: bridged layers (`BridgeModule`, `scan_layers`, `StackedLayers`) compute
  attention with the flash kernel; plain LazyTensor layers are not bridged and keep torch's.

  Example:
    >>> model = Llama(vocab=256, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)
    >>> model(torch.zeros(1, 8, dtype=torch.long)).shape
    torch.Size([1, 8, 256])
  """

  def __init__(self, vocab=256, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, experts=0,
               top_k=2, attention="reference"):
    super().__init__()
    if attention not in ATTENTION:
      raise errors.BadArgumentError(
          f"Llama: attention={attention!r}; choose one of {', '.join(ATTENTION)}.")
    self.attention = attention
    self.overrides = ATTENTION[attention]  # the ops the stack runs under (sharding.py may replace)
    self.embed = nn.Embedding(vocab, dim)
    self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden, experts, top_k)
                                for _ in range(layers))
    self.norm = RMSNorm(dim)
    self.lm_head = nn.Linear(dim, vocab, bias=False)
    self.use_scan = False
    self.scan_remat = None

  def forward(self, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    h = self.embed(tokens)
    with override_ops(self.overrides):
      if self.use_scan:
        h = jb.scan_layers(self.layers, h, remat=self.scan_remat, shared_args=(positions,))
      elif isinstance(self.layers, nn.ModuleList):
        for layer in self.layers:
          h = layer(h, positions)
      else:
        h = self.layers(h, positions)
    return self.lm_head(self.norm(h)).float()  # the loss in float32 whatever the model's dtype


DTYPES = ("float32", "bfloat16")


def build(model_cfg, seed=0, place=None, stack=None):
  """A Llama (or, with experts, Mixtral-style) model from a recipe's `model` config section, its
  parameters in `model_cfg["dtype"]`.

  The model is built on the meta device, then each module's parameters are made one module at a
  time: torch's default init for that module (`reset_parameters`), drawn on the CPU directly in
  the dtype (as torch initialises a module built with `dtype=`) from a generator seeded by `seed`
  and the module's name, so a value does not depend on the order or the place parameters are made
  in; then handed to `place(name, value, stacked)`, whose result becomes the parameter (default:
  the CPU tensor). Beyond what `place` keeps, the host holds one module's parameters at a time.

  `stack`, given, replaces the (still empty) layer list first, e.g. `jb.StackedLayers`, whose
  one submodule holds a layer's structure with each parameter stacked over the layers: each
  stacked parameter is handed to `place` with `stacked=True` as a `LayerValues`, which makes
  the layers' values one at a time (every layer's module initialised as above), so `place` can
  assemble the stack where it goes, holding one layer's value on the host at a time
  (`sharding.placer` builds it on the device); with no `place`, the stack is made on the CPU.

  Example:
    >>> from torch_xla_jaxbridge.recipes import config
    >>> model = build(config.load()["model"], seed=0)
    >>> model.embed.weight.dtype, model.norm.weight.device.type
    (torch.float32, 'cpu')
    >>> build(config.load(["model.dtype=bfloat16"])["model"], seed=0).embed.weight.dtype
    torch.bfloat16
    >>> stacked = build(config.load()["model"], seed=0, stack=jb.StackedLayers)
    >>> stacked.layers.layer.mlp.up_proj.weight.shape  # 4 layers
    torch.Size([4, 192, 64])
  """
  with torch.device("meta"):
    model = Llama(vocab=model_cfg["vocab"], dim=model_cfg["dim"], layers=model_cfg["layers"],
                  heads=model_cfg["heads"], kv_heads=model_cfg["kv_heads"],
                  hidden=model_cfg["hidden"], experts=model_cfg["experts"],
                  top_k=model_cfg["experts_per_token"],
                  attention=model_cfg["attention"]).to(getattr(torch, model_cfg["dtype"]))
  layers = model.layers
  if stack is not None:
    model.layers = stack(layers)
  for prefix, module in model.named_modules():
    names = [name for name, _ in module.named_parameters(recurse=False)]
    if not names:
      continue
    in_stack = stack is not None and prefix.startswith("layers.")
    if in_stack:  # prefix: layers.<the stack's layer module>[.<path in a layer>]
      path = prefix.split(".", 2)[2] if prefix.count(".") > 1 else ""
      values: dict = {name: LayerValues(layers, path, name, seed, getattr(module, name))
                      for name in names}
    else:
      module.to_empty(device="cpu", recurse=False)
      _initialise(module, seed, prefix)
      values = {name: getattr(module, name).detach() for name in names}
    for name in names:
      value = values.pop(name)  # the host copy goes as soon as it is placed
      if place is not None:
        value = place(f"{prefix}.{name}" if prefix else name, value, in_stack)
      elif in_stack:
        value = value.stack()
      setattr(module, name, nn.Parameter(value))
  return model


def _initialise(module, seed, name):
  """`module`'s own parameters (on the CPU) drawn by its `reset_parameters` from seed `name`."""
  with torch.random.fork_rng(devices=[]):
    torch.manual_seed(module_seed(seed, name))
    module.reset_parameters()


class LayerValues(collections.abc.Sequence):
  """Parameter `name` of module `path` in each layer of the meta list `layers`, made on the CPU
  a layer at a time: `values[i]` initialises layer i's module (from its own seed, as the
  per-layer build does) and returns that parameter's value (a module with several parameters is
  initialised again for each); the layer list keeps no values.
  `shape` and `dtype` are the stack's (those of `meta`, the stacked meta parameter).

  Example:
    >>> from torch_xla_jaxbridge.recipes import config
    >>> stacked = build(config.load()["model"], seed=0, stack=jb.StackedLayers,
    ...                 place=lambda name, value, stacked: value.stack() if stacked else value)
    >>> plain = build(config.load()["model"], seed=0)
    >>> torch.equal(stacked.layers.layer.attn.k_proj.weight[1], plain.layers[1].attn.k_proj.weight)
    True
  """

  def __init__(self, layers, path, name, seed, meta):
    self.layers, self.path, self.name, self.seed = layers, path, name, seed
    self.shape, self.dtype = tuple(meta.shape), meta.dtype

  def __len__(self):
    return len(self.layers)

  def __getitem__(self, i):
    if not 0 <= i < len(self.layers):
      raise IndexError(f"LayerValues: layer {i} of {len(self.layers)}")
    module = self.layers[i].get_submodule(self.path)
    module.to_empty(device="cpu", recurse=False)
    _initialise(module, self.seed, f"layers.{i}.{self.path}" if self.path else f"layers.{i}")
    value = getattr(module, self.name).detach()
    module.to_empty(device="meta", recurse=False)  # emptied in place: no cycle keeps the values
    return value

  def stack(self):
    """The whole stack on the CPU, each layer's value made into its slice."""
    out = torch.empty(self.shape, dtype=self.dtype)
    for i, value in enumerate(self):
      out[i] = value
    return out


def module_seed(seed, name):
  """The seed of module `name`'s initial values: a hash of (seed, name), the same in every process.

  Example:
    >>> module_seed(0, "layers.0.attn.q_proj") == module_seed(0, "layers.0.attn.q_proj")
    True
    >>> module_seed(0, "embed") != module_seed(1, "embed")
    True
  """
  digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
  return int.from_bytes(digest[:8], "little") & (2**63 - 1)
