"""Hugging Face model code that cannot be traced as written, run in an equivalent traceable form
inside bridged code.

The sparse mixture-of-experts blocks of Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3 and Granite-MoE
pick the tokens each expert sees with `nonzero()`, `torch.where(mask)` or `.tolist()`, whose
results depend on the data; a trace cannot follow them. Inside bridged code each block instead
runs every expert on every token and weights each result by the token's routing weight for that
expert (zero for experts it did not pick): the same values, with the experts' compute multiplied
by `num_experts / top_k`. Outside bridged code nothing changes. One rule per block: the module,
the class, the method replaced, and its dense form.
"""
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from torch_xla_jaxbridge._core import patching, tracing

_MODELS = "transformers.models."


def dense_experts(selected: torch.Tensor, weights: torch.Tensor, experts: int,
                  expert_output: Callable[[int], torch.Tensor]) -> torch.Tensor:
  """`sum_e expert_output(e) * w[:, e]`, where `w[t, e]` is token `t`'s routing weight for
  expert `e` (`weights[t, j]` where `selected[t, j] == e`, else 0), in expert order as the
  blocks' loops add them.

  Example:
    >>> selected, weights = torch.tensor([[1], [0]]), torch.tensor([[0.5], [2.0]])
    >>> dense_experts(selected, weights, 2, lambda e: torch.full((2, 1), e + 1.0)).tolist()
    [[1.0], [2.0]]
  """
  combine = torch.zeros(selected.shape[0], experts, dtype=weights.dtype,
                        device=weights.device).scatter(1, selected, weights)
  out: torch.Tensor | None = None
  for index in range(experts):
    term = expert_output(index) * combine[:, index, None]
    out = term if out is None else out + term
  assert out is not None, "a layer has experts"
  return out


def _softmax_top_k(block, logits, dtype):
  """Mixtral's, Qwen2-MoE's and OLMoE's routing: softmax, top k, renormalized where the block
  says so (Mixtral always), cast to the hidden states' dtype."""
  weights = F.softmax(logits, dim=1, dtype=torch.float)
  weights, selected = torch.topk(weights, block.top_k, dim=-1)
  if getattr(block, "norm_topk_prob", True):
    weights = weights / weights.sum(dim=-1, keepdim=True)
  return selected, weights.to(dtype)


def dense_mixture_of_experts(block, hidden_states: torch.Tensor):
  """`forward` of Mixtral's, Qwen2-MoE's and OLMoE's sparse blocks without data-dependent shapes:
  returns `(hidden_states, router_logits)` as the originals do (Qwen2-MoE's shared expert
  included).

  Example:
    >>> import types
    >>> experts = [torch.nn.Linear(4, 4) for _ in range(3)]
    >>> block = types.SimpleNamespace(gate=torch.nn.Linear(4, 3), experts=experts, top_k=2,
    ...                               num_experts=3, training=False, jitter_noise=0)
    >>> out, logits = dense_mixture_of_experts(block, torch.ones(1, 2, 4))
    >>> out.shape, logits.shape
    (torch.Size([1, 2, 4]), torch.Size([2, 3]))
  """
  batch, length, width = hidden_states.shape
  if block.training and getattr(block, "jitter_noise", 0) > 0:
    hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
        1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
  hidden_states = hidden_states.view(-1, width)
  router_logits = block.gate(hidden_states)
  selected, weights = _softmax_top_k(block, router_logits, hidden_states.dtype)
  out = dense_experts(selected, weights, block.num_experts,
                      lambda e: block.experts[e](hidden_states))
  if hasattr(block, "shared_expert"):  # Qwen2-MoE
    gate = F.sigmoid(block.shared_expert_gate(hidden_states))
    out = out + gate * block.shared_expert(hidden_states)
  return out.reshape(batch, length, width), router_logits


def dense_deepseek_experts(block, hidden_states, topk_indices, topk_weights):
  """DeepSeek-V3's `DeepseekV3MoE.moe` (its routed experts) without data-dependent shapes.

  Example:
    >>> import types
    >>> block = types.SimpleNamespace(experts=[torch.nn.Identity(), torch.nn.Identity()])
    >>> dense_deepseek_experts(block, torch.ones(2, 3), torch.tensor([[1], [0]]),
    ...                        torch.tensor([[0.5], [2.0]])).tolist()
    [[0.5, 0.5, 0.5], [2.0, 2.0, 2.0]]
  """
  out = dense_experts(topk_indices, topk_weights, len(block.experts),
                      lambda e: block.experts[e](hidden_states))
  return out.type(hidden_states.dtype)


def dense_granite_experts(block, layer_input):
  """Granite-MoE's `GraniteMoeMoE.forward` (experts as stacked weights, `ParallelExperts`)
  without data-dependent shapes: `(hidden_states, router_logits)`.

  Example:
    >>> import types
    >>> experts = types.SimpleNamespace(weight=torch.ones(2, 4, 3))
    >>> block = types.SimpleNamespace(
    ...     router=types.SimpleNamespace(layer=torch.nn.Linear(3, 2), top_k=1),
    ...     input_linear=experts, output_linear=types.SimpleNamespace(weight=torch.ones(2, 3, 2)),
    ...     activation=torch.nn.Identity(), input_size=3)
    >>> out, logits = dense_granite_experts(block, torch.ones(1, 2, 3))
    >>> out.shape, logits.shape
    (torch.Size([1, 2, 3]), torch.Size([2, 2]))
  """
  batch, length, width = layer_input.shape
  tokens = layer_input.reshape(-1, width)
  router = block.router
  logits = router.layer(tokens).float()
  top_logits, selected = logits.topk(router.top_k, dim=1)
  gates = torch.softmax(top_logits, dim=1).type_as(tokens)

  def expert(e):
    first, second = F.linear(tokens, block.input_linear.weight[e]).chunk(2, dim=-1)
    return F.linear(block.activation(first) * second, block.output_linear.weight[e])

  out = dense_experts(selected, gates, logits.shape[1], expert)
  return out.view(batch, length, block.input_size), logits


def _rule(module: str, cls: str, method: str, dense: Callable) -> None:
  """While bridged code is traced, `module.cls.method` runs `dense` on traced inputs."""
  def replacement(block, hidden_states, *rest):
    if patch.active() and tracing.is_traced(hidden_states):
      return dense(block, hidden_states, *rest)
    return patch.original(method)(block, hidden_states, *rest)

  patch = patching.Patch(lambda: [getattr(sys.modules.get(_MODELS + module), cls, None)],
                         {method: replacement})
  tracing.register_trace_context(lambda: patch)


_rule("mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "forward", dense_mixture_of_experts)
_rule("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "forward",
      dense_mixture_of_experts)
_rule("olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "forward", dense_mixture_of_experts)
_rule("deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "moe", dense_deepseek_experts)
_rule("granitemoe.modeling_granitemoe", "GraniteMoeMoE", "forward", dense_granite_experts)
