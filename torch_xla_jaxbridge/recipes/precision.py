"""Float32 master weights: an optimizer that updates float32 copies of low-precision (bfloat16)
parameters and writes each result back in the parameter's dtype, so small updates are not lost to
bfloat16 rounding (`train.master_weights=true`)."""
import torch

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge import errors


def master_weights(params, make_optimizer):
  """The optimizer `make_optimizer(masters)`, built over float32 copies of `params`, with step
  hooks that keep the two in step.

  The masters are the optimizer's parameters, so its state (the AdamW moments) is float32 and LR
  schedulers, `zero_grad` and `state_dict` work as for any optimizer. Before each `step()` every
  parameter's gradient becomes its master's (as float32) and the parameter's own is cleared;
  after it, every parameter takes its master's value in its own dtype. On the XLA device a master
  is sharded as its parameter. `state_dict()` carries the masters under `"master_weights"` and
  `load_state_dict` copies them back, so a resumed run continues from the float32 values.

  Example:
    >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    >>> opt = master_weights(model.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    >>> model(torch.ones(3, 4, dtype=torch.bfloat16)).sum().backward()
    >>> opt.step()
    >>> opt.param_groups[0]["params"][0].dtype, model.weight.dtype, model.weight.grad
    (torch.float32, torch.bfloat16, None)
  """
  params = list(params)
  masters = [torch.nn.Parameter(p.detach().to(torch.float32)) for p in params]
  jb.spmd.shard_like(masters, jb.spmd.shardings_of(params))
  optimizer = make_optimizer(masters)

  def take_gradients(optimizer, args, kwargs):
    for param, master in zip(params, masters):
      master.grad = None if param.grad is None else param.grad.to(torch.float32)
      param.grad = None

  @torch.no_grad()
  def write_back(optimizer, args, kwargs):
    for param, master in zip(params, masters):
      param.copy_(master)

  def save(optimizer, state_dict):
    state_dict["master_weights"] = [master.detach() for master in masters]

  @torch.no_grad()
  def load(optimizer, state_dict):
    state_dict = dict(state_dict)
    if len(state_dict.get("master_weights", ())) != len(masters):
      raise errors.BadArgumentError(
          f"master_weights: the optimizer state holds {len(state_dict.get('master_weights', ()))} "
          f"master weights for {len(masters)} parameters; load a state saved with master weights "
          f"for this model (train.master_weights=true).")
    for master, saved in zip(masters, state_dict.pop("master_weights")):
      master.copy_(saved)
    return state_dict

  optimizer.register_step_pre_hook(take_gradients)
  optimizer.register_step_post_hook(write_back)
  optimizer.register_state_dict_post_hook(save)
  optimizer.register_load_state_dict_pre_hook(load)
  return optimizer
