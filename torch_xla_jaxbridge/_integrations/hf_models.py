"""Hugging Face model code that cannot be traced as written, run in an equivalent traceable form
inside bridged code.

Mixtral's sparse mixture of experts picks the experts each token uses with `nonzero()` and
`torch.where(mask)`, whose output shapes depend on the data; a trace cannot follow them. Inside
bridged code the block instead runs every expert on every token and weights each result by the
token's routing weight (zero for experts it did not pick): the same values, with the experts'
compute multiplied by `num_experts / top_k`. Outside bridged code nothing changes.
"""
import sys

import torch

from torch_xla_jaxbridge._core import patching, tracing

_MIXTRAL = "transformers.models.mixtral.modeling_mixtral"


def dense_mixture_of_experts(block, hidden_states: torch.Tensor):
  """Mixtral's `MixtralSparseMoeBlock.forward` without data-dependent shapes: returns
  `(hidden_states, router_logits)` as the original does.

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
  if block.training and block.jitter_noise > 0:
    hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
        1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
  hidden_states = hidden_states.view(-1, width)
  router_logits = block.gate(hidden_states)
  weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
  weights, selected = torch.topk(weights, block.top_k, dim=-1)
  weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden_states.dtype)
  combine = torch.zeros(hidden_states.shape[0], block.num_experts, dtype=hidden_states.dtype,
                        device=hidden_states.device).scatter(1, selected, weights)
  out = torch.zeros_like(hidden_states)
  for index, expert in enumerate(block.experts):
    out = out + expert(hidden_states) * combine[:, index, None]
  return out.reshape(batch, length, width), router_logits


def _mixtral_forward(block, hidden_states):
  if _DENSE.active() and tracing.is_traced(hidden_states):
    return dense_mixture_of_experts(block, hidden_states)
  return _DENSE.original("forward")(block, hidden_states)


def _mixtral_blocks():
  module = sys.modules.get(_MIXTRAL)
  return [module.MixtralSparseMoeBlock] if module is not None else []


_DENSE = patching.Patch(_mixtral_blocks, {"forward": _mixtral_forward})
tracing.register_trace_context(lambda: _DENSE)
