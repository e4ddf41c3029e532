"""Optimizers whose step is one JAX call: every parameter of a group updated by one graph node.

torch's optimizers add a few LazyTensor ops per parameter to every step (host time per parameter:
docs/performance.md); here the update of a whole parameter group
is one `call_jax`, traced once, and each parameter then takes the new value's data.
"""
import torch

from torch_xla_jaxbridge import _compat, call, errors


def _sgd_update(params, grads, buffers, lr, *, momentum, dampening, weight_decay, nesterov,
                maximize):
  """torch.optim.SGD's update rule on lists of arrays; returns (new params, new momentum buffers)."""
  new_params, new_buffers = [], []
  for i, (p, g) in enumerate(zip(params, grads)):
    g = -g if maximize else g
    if weight_decay:
      g = g + weight_decay * p
    if momentum:
      buf = g if buffers[i] is None else momentum * buffers[i] + (1 - dampening) * g
      new_buffers.append(buf)
      g = g + momentum * buf if nesterov else buf
    new_params.append((p - lr.astype(p.dtype) * g).astype(p.dtype))
  return new_params, (new_buffers if momentum else None)


class SGD(torch.optim.Optimizer):
  """`torch.optim.SGD` (same arguments and update rule) whose step is one graph node per group.

  For parameters on the XLA device. The learning rate travels as a device scalar, so a schedule
  that changes it does not re-trace; the other hyperparameters are part of the trace. Momentum
  buffers live in `state[p]["momentum_buffer"]` as in torch, so `state_dict()` is compatible.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step()
  """

  def __init__(self, params, lr: float = 1e-3, momentum: float = 0, dampening: float = 0,
               weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False):
    if lr < 0 or momentum < 0 or weight_decay < 0:
      raise errors.BadArgumentError(
          f"SGD: lr, momentum and weight_decay must be >= 0; got lr={lr}, momentum={momentum}, "
          f"weight_decay={weight_decay}.")
    if nesterov and (momentum <= 0 or dampening != 0):
      raise errors.BadArgumentError("SGD: nesterov=True needs momentum > 0 and dampening = 0.")
    super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                  weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))
    self._lr_tensors = {}

  @torch.no_grad()
  def step(self, closure=None):
    """Updates every parameter that has a gradient; returns the closure's loss, if given."""
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    for group in self.param_groups:
      params = [p for p in group["params"] if p.grad is not None]
      if params:
        self._step_group(group, params)
    return loss

  def _step_group(self, group, params):
    for p in params:
      if not p.is_xla or p.grad.is_sparse:
        raise errors.BadArgumentError(
            f"SGD: a parameter of shape {tuple(p.shape)} is on {p.device}"
            f"{' with a sparse gradient' if p.grad.is_sparse else ''}; jb.optim.SGD updates "
            f"XLA tensors with dense gradients. Use torch.optim.SGD for the others.")
    momentum = group["momentum"]
    if momentum:
      # per parameter, as torch: one that first gets a gradient later starts its own buffer then
      states = [self.state[p] for p in params]
      buffers = [s.get("momentum_buffer") for s in states]
    else:  # torch keeps no state without momentum
      states, buffers = [], [None] * len(params)
    new_params, new_buffers = call.call_jax(
        _sgd_update, (params, [p.grad for p in params], buffers, self._lr(group, params[0])),
        dict(momentum=momentum, dampening=group["dampening"],
             weight_decay=group["weight_decay"], nesterov=group["nesterov"],
             maximize=group["maximize"]), name="sgd_step")
    replace = _compat.xlac()._replace_xla_tensor
    for p, new in zip(params, new_params):
      replace(p, new)
    torch.autograd.graph.increment_version(params)  # in-place updates, as far as autograd knows
    for state, buf in zip(states, new_buffers or ()):
      state["momentum_buffer"] = buf

  def _lr(self, group, like):
    """The group's learning rate as a 0-d f32 XLA tensor, made once per value."""
    value = float(group["lr"])
    cached = self._lr_tensors.get(id(group))
    if cached is None or cached[0] != value:
      cached = self._lr_tensors[id(group)] = (value, torch.tensor(value, device=like.device))
    return cached[1]
