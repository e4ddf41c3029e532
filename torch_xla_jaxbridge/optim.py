"""Optimizers whose step is one JAX call, and learning-rate schedules for them.

torch's optimizers add a few LazyTensor ops per parameter to every step (host time per parameter:
docs/performance.md); here the update of a parameter group (`SGD`) or of the whole step with its
gradient clipping (`AdamW`) is one `call_jax`, traced once, and each parameter then takes the new
value's data. Values that change from step to step (learning rate, step counts) travel as device
inputs, so schedules never re-trace.
"""
import math
from typing import Callable, Optional

import torch

from torch_xla_jaxbridge import _compat, call, errors, runtime


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


class _OwnsItsState(torch.optim.Optimizer):
  """The step updates the state tensors in place, as torch's optimizers do; `load_state_dict`
  copies the XLA tensors it would share with the given dict (torch keeps them when device and
  dtype match), so a state dict loaded from another optimizer starts a state of its own."""

  def load_state_dict(self, state_dict):
    given = {id(v) for s in state_dict["state"].values() for v in s.values()
             if isinstance(v, torch.Tensor)}
    super().load_state_dict(state_dict)
    for p_state in self.state.values():
      for key, value in p_state.items():
        if id(value) in given and value.is_xla:
          p_state[key] = value.clone()


class SGD(_OwnsItsState):
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
    loss = _closure_loss(closure)
    for group in self.param_groups:
      params = [p for p in group["params"] if p.grad is not None]
      if params:
        self._step_group(group, params)
    return loss

  def _step_group(self, group, params):
    _check_xla("SGD", params)
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
    _take_values(params, new_params)
    for state, buf in zip(states, new_buffers or ()):
      _take_state(state, "momentum_buffer", buf)

  def _lr(self, group, like):
    """The group's learning rate as a 0-d f32 XLA tensor, made once per value."""
    value = float(group["lr"])
    cached = self._lr_tensors.get(id(group))
    if cached is None or cached[0] != value:
      cached = self._lr_tensors[id(group)] = (value, torch.tensor(value, device=like.device))
    return cached[1]


def _closure_loss(closure):
  """What `Optimizer.step(closure)` returns: the closure's loss, computed with gradients on."""
  if closure is None:
    return None
  with torch.enable_grad():
    return closure()


def _check_xla(name, params, real=False, grads=True):
  """Refuses parameters the one-node update cannot hold: not on XLA, a sparse gradient (`grads`:
  read from `p.grad`), or (with `real`: an update that is not linear in the gradient) a complex
  dtype."""
  for p in params:
    sparse = grads and p.grad.is_sparse
    if not p.is_xla or sparse or (real and p.is_complex()):
      what = (" with a sparse gradient" if sparse else
              f" of dtype {p.dtype}" if real and p.is_complex() else "")
      raise errors.BadArgumentError(
          f"{name}: a parameter of shape {tuple(p.shape)} is on {p.device}{what}; jb.optim.{name} "
          f"updates real XLA tensors with dense gradients. Use torch.optim.{name} for the others.")


def _take_values(params, new_values):
  """Each parameter takes its new value's device data (no copy), as an in-place update would:
  the step's program writes it over the old buffer."""
  for p, new in zip(params, new_values):
    _compat.replace_data(p, new)
  torch.autograd.graph.increment_version(params)  # in-place updates, as far as autograd knows


def _take_state(state, key, new):
  """`state[key]` takes `new`'s value in place, as torch's optimizers update their state (holders
  of `state_dict()` see it; its buffer is written over); a first value is stored as it is."""
  old = state.get(key)
  if old is None or not old.is_xla or old.shape != new.shape or old.dtype != new.dtype:
    state[key] = new
  else:
    _compat.replace_data(old, new)


_ROW = 7  # scalars per parameter in AdamW's device input; see _adamw_update


def _adamw_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, scalars, *, amsgrad,
                  maximize, clip):
  """torch.optim.AdamW's update, after `clip_grad_norm_` when `clip`, on lists of arrays.

  `scalars` (f32): per parameter -lr / (1 - beta1**step), (1 - beta2**step)**0.5,
  1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps; then max_grad_norm. Returns the new
  params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (None where not amsgrad) and the gradients'
  global 2-norm before clipping.
  """
  jnp = runtime.jax_module().numpy
  f32 = jnp.float32
  grads = [g.astype(f32) for g in grads]
  norms = jnp.stack([jnp.sqrt(jnp.sum(g * g)) for g in grads])  # as clip_grad_norm_: the norm
  grad_norm = jnp.sqrt(jnp.sum(norms * norms))                  # of the per-tensor norms
  if clip:
    scale = jnp.minimum(scalars[-1] / (grad_norm + 1e-6), 1.0)
    grads = [g * scale for g in grads]
  rows = scalars[:-1].reshape(-1, _ROW)
  new_params, new_avgs, new_sqs, new_maxes = [], [], [], []
  for i, (p, g, m, v, v_max) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs,
                                              max_exp_avg_sqs)):
    neg_step_size, bias_correction2_sqrt, decay, one_minus_beta1, beta2, one_minus_beta2, eps = (
        rows[i, k] for k in range(_ROW))
    g = -g if maximize[i] else g
    m = m.astype(f32) + one_minus_beta1 * (g - m.astype(f32))   # exp_avg.lerp_(g, 1 - beta1)
    v = v.astype(f32) * beta2 + one_minus_beta2 * g * g         # .mul_(beta2).addcmul_(g, g, ...)
    if amsgrad[i]:
      v_max = jnp.maximum(v_max.astype(f32), v)
    denom = jnp.sqrt(v_max if amsgrad[i] else v) / bias_correction2_sqrt + eps
    new_params.append((p.astype(f32) * decay + neg_step_size * m / denom).astype(p.dtype))
    new_avgs.append(m.astype(exp_avgs[i].dtype))
    new_sqs.append(v.astype(exp_avg_sqs[i].dtype))
    new_maxes.append(v_max.astype(max_exp_avg_sqs[i].dtype) if amsgrad[i] else None)
  return new_params, new_avgs, new_sqs, new_maxes, grad_norm


class AdamW(_OwnsItsState):
  """`torch.optim.AdamW` (same arguments, update rule and `state_dict()`), with gradient clipping
  by global norm, whose whole step is one graph node.

  One `call_jax` updates every parameter of every group: the clipping norm needs all gradients
  before any update, so norm, clipping and updates are one computation. `max_grad_norm` (None: no
  clipping) clips as `torch.nn.utils.clip_grad_norm_` over all groups would; `p.grad` is left
  unscaled. After each step `grad_norm` holds the gradients' 2-norm before clipping, an XLA
  tensor computed in the step's graph (reading it waits for that graph, nothing more).
  Learning rate, betas, eps, weight decay and each parameter's step count travel as one device
  input, so torch's LR schedulers (and `warmup_cosine` / `warmup_linear` / `warmup_constant` with
  `LambdaLR`) never re-trace; `amsgrad` and `maximize` are part of the trace. The state is
  torch's: per parameter `step` (a CPU float32 tensor), `exp_avg`, `exp_avg_sq`, and
  `max_exp_avg_sq` with amsgrad, so state dicts load into `torch.optim.AdamW` and back.

  Example:
    >>> import torch, torch_xla, torch_xla_jaxbridge as jb
    >>> model = torch.nn.Linear(4, 2).to("xla")
    >>> opt = jb.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> schedule = torch.optim.lr_scheduler.LambdaLR(opt, jb.optim.warmup_cosine(10, 100))
    >>> model(torch.ones(3, 4, device="xla")).sum().backward()
    >>> opt.step(); schedule.step(); torch_xla.sync()
    >>> round(opt.grad_norm.item(), 4)  # before clipping: sqrt(2 * 3**2 * 4 + 2 * 3**2)
    9.4868
  """

  def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
               max_grad_norm: Optional[float] = None):
    if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
      raise errors.BadArgumentError(
          f"AdamW: needs lr, eps, weight_decay >= 0 and 0 <= beta < 1; got lr={lr}, eps={eps}, "
          f"weight_decay={weight_decay}, betas={tuple(betas)}.")
    if max_grad_norm is not None and not max_grad_norm > 0:
      raise errors.BadArgumentError(
          f"AdamW: max_grad_norm={max_grad_norm}; give a positive norm, or None for no clipping.")
    super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  amsgrad=amsgrad, maximize=maximize))
    self.max_grad_norm = max_grad_norm
    self.grad_norm: Optional[torch.Tensor] = None
    self._train_step = None  # set by jb.train_step for the one step() call it makes

  def __setstate__(self, state):
    super().__setstate__(state)
    self.__dict__.setdefault("_train_step", None)
    for group in self.param_groups:  # a state dict of another optimizer may lack these
      group.setdefault("amsgrad", False)
      group.setdefault("maximize", False)
    for p_state in self.state.values():  # our own CPU count, whatever the loaded one was
      if "step" in p_state:
        p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

  def state_dict(self):
    """torch.optim.AdamW's layout; `step` counts are copies (a consumer that increments its steps
    in place, as torch does, leaves this optimizer's alone)."""
    saved = super().state_dict()
    saved["state"] = {k: {**v, "step": v["step"].clone()} for k, v in saved["state"].items()}
    return saved

  @torch.no_grad()
  def step(self, closure=None):
    """Updates every parameter that has a gradient; returns the closure's loss, if given."""
    if self._train_step is not None:  # jb.train_step's update, made in the step's own node
      run, self._train_step = self._train_step, None
      return run()
    loss = _closure_loss(closure)
    params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
    _check_xla("AdamW", params, real=True)
    self.grad_norm = None
    if params:
      states, scalars, flags = self._prepare(params)
      scalars = scalars.to(params[0].device)  # one transfer
      results = call.call_jax(
          _adamw_update,
          (params, [p.grad for p in params], *self._state_arrays(states, flags), scalars), flags,
          name="adamw_step")
      self._take(params, states, results)
    return loss

  def _prepare(self, params):
    """For one step of `params` (in `param_groups` order, each with a gradient): their states
    (step counts advanced), the step's scalars (a CPU tensor: learning rate, betas, eps, weight
    decay and bias corrections per parameter, then max_grad_norm) and `_adamw_update`'s static
    flags. `jb.train_step` calls it too."""
    selected = {id(p) for p in params}
    states, scalars, amsgrad, maximize = [], [], [], []
    for group in self.param_groups:
      lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
      beta1, beta2 = (float(b) for b in group["betas"])
      for p in group["params"]:
        if id(p) not in selected:
          continue
        state = self._state(p, group["amsgrad"])
        step = float(state["step"]) + 1
        state["step"] = torch.tensor(step, dtype=torch.float32)
        scalars += [-(lr / (1 - beta1**step)), (1 - beta2**step)**0.5, 1 - lr * weight_decay,
                    1 - beta1, beta2, 1 - beta2, eps]
        states.append(state)
        amsgrad.append(bool(group["amsgrad"]))
        maximize.append(bool(group["maximize"]))
    scalars.append(float(self.max_grad_norm or 0.0))
    flags = dict(amsgrad=tuple(amsgrad), maximize=tuple(maximize),
                 clip=self.max_grad_norm is not None)
    return states, torch.tensor(scalars, dtype=torch.float32), flags

  @staticmethod
  def _state_arrays(states, flags):
    """`_adamw_update`'s state arguments: exp_avgs, exp_avg_sqs, max_exp_avg_sqs (None without
    amsgrad)."""
    return ([s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] if a else None for s, a in zip(states, flags["amsgrad"])])

  def _take(self, params, states, results):
    """Parameters and states take the values `_adamw_update` returned; sets `grad_norm`."""
    new_params, avgs, sqs, new_maxes, self.grad_norm = results
    _take_values(params, new_params)
    for state, m, v, v_max in zip(states, avgs, sqs, new_maxes):
      _take_state(state, "exp_avg", m)
      _take_state(state, "exp_avg_sq", v)
      if v_max is not None:
        _take_state(state, "max_exp_avg_sq", v_max)

  def _state(self, p, amsgrad):
    """The parameter's state, made as torch makes it on its first step."""
    state = self.state[p]
    if not state:
      state["step"] = torch.tensor(0.0, dtype=torch.float32)
      state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
      state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if amsgrad and "max_exp_avg_sq" not in state:
      state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def warmup_cosine(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.0) -> Callable[[int], float]:
  """The learning-rate factor for `torch.optim.lr_scheduler.LambdaLR`: linear warmup over
  `warmup_steps` ((step + 1) / (warmup_steps + 1)), then cosine decay from 1 to `min_ratio` at
  `total_steps`.

  Example:
    >>> factor = warmup_cosine(3, 13)
    >>> [round(factor(step), 2) for step in (0, 1, 2, 3, 8, 13, 20)]
    [0.25, 0.5, 0.75, 1.0, 0.5, 0.0, 0.0]
  """
  return _warmup_then("warmup_cosine", warmup_steps, total_steps, min_ratio,
                      lambda progress: 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_linear(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.0) -> Callable[[int], float]:
  """The learning-rate factor for `LambdaLR`: linear warmup as `warmup_cosine`, then linear decay
  from 1 to `min_ratio` at `total_steps`.

  Example:
    >>> factor = warmup_linear(1, 5, min_ratio=0.2)
    >>> [round(factor(step), 2) for step in (0, 1, 3, 5)]
    [0.5, 1.0, 0.6, 0.2]
  """
  return _warmup_then("warmup_linear", warmup_steps, total_steps, min_ratio,
                      lambda progress: 1 - progress)


def warmup_constant(warmup_steps: int) -> Callable[[int], float]:
  """The learning-rate factor for `LambdaLR`: linear warmup as `warmup_cosine`, then 1.

  Example:
    >>> [warmup_constant(1)(step) for step in (0, 1, 100)]
    [0.5, 1.0, 1.0]
  """
  return _warmup_then("warmup_constant", warmup_steps, warmup_steps, 1.0, lambda progress: 1.0)


def _warmup_then(name, warmup_steps, total_steps, min_ratio, decay):
  if not 0 <= warmup_steps <= total_steps or not 0 <= min_ratio <= 1:
    raise errors.BadArgumentError(
        f"{name}: needs 0 <= warmup_steps <= total_steps and 0 <= min_ratio <= 1; got "
        f"warmup_steps={warmup_steps}, total_steps={total_steps}, min_ratio={min_ratio}.")

  def factor(step: int) -> float:
    if step < warmup_steps:
      return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * decay(progress)

  return factor
