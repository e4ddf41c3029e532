"""Prints, as JSON, what a training script's process can see of torch's, JAX's and the host's
global state after a few training steps: `plain` (torch_xla only) or `bridged` (the same steps
with the package's entry points). test_runtime runs both in fresh processes and compares.

  python test/process_state_check.py plain|bridged
"""
import gc
import json
import logging
import os
import random
import sys
import threading
import warnings

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm

LOGGERS = sorted(logging.root.manager.loggerDict)  # the loggers that exist before the package


def train(bridged):
  """Four steps of a small model (forward, backward, SGD): plain, or bridged four ways."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
  model = model.to("xla")
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  scale = (lambda x: x * 2)
  if bridged:
    import torch_xla_jaxbridge as jb

    jb.bridge_modules(model, ["Linear"])
    scale = jb.bridge(scale)
  for _ in range(3):
    x = torch.ones(2, 4, device="xla")
    loss = scale(model(x)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
  x = torch.ones(2, 4, device="xla")
  if bridged:  # a fourth step, as one node
    jb.train_step(lambda x: model(x).square().mean(), jb.optim.SGD(model.parameters(), lr=0.1))(x)
  else:
    model(x).square().mean().backward()
    opt.step()
  torch_xla.sync()


def pinned_batches():
  """A `DataLoader(pin_memory=True)` iterated here and in another thread: batches or the error."""
  loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=True)
  seen = {}

  def iterate(where):
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no accelerator is found"
        seen[where] = [batch.tolist() for batch in loader]
    except Exception as e:  # noqa: BLE001  (the error is the observation)
      seen[where] = f"{type(e).__name__}: {e}"[:200]

  iterate("calling thread")
  worker = threading.Thread(target=iterate, args=("other thread",))
  worker.start()
  worker.join()
  return seen


def state():
  from torch.overrides import _get_current_function_mode_stack
  from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

  accelerator = torch.accelerator.current_accelerator()
  observed = {
      "accelerator": str(accelerator), "accelerator available": torch.accelerator.is_available(),
      "privateuse1 name": torch._C._get_privateuse1_backend_name(),
      "torch.jax": hasattr(torch, "jax"), "mha fast path": torch.backends.mha.get_fastpath_enabled(),
      "default dtype": str(torch.get_default_dtype()), "default device": str(torch.get_default_device()),
      "function modes": len(_get_current_function_mode_stack()),
      "dispatch modes": len(_get_current_dispatch_mode_stack()),
      "autocast": [torch.is_autocast_enabled(d) for d in ("cpu", "xla")],
      "grad enabled": torch.is_grad_enabled(), "matmul precision": torch.get_float32_matmul_precision(),
      "environment": dict(os.environ),
      "threads": sorted(t.name for t in threading.enumerate() if not t.daemon),
      "loggers": {n: (logging.getLogger(n).level, len(logging.getLogger(n).handlers),
                      logging.getLogger(n).propagate) for n in ["" ] + LOGGERS},
      "warning filters": len(warnings.filters),
      "recursion limit": sys.getrecursionlimit(),
      "garbage collector": [gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()],
      "random draws": [torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random(),
                       xm.get_rng_state()],
      "pinned batches": pinned_batches(),
  }
  import jax  # after everything: JAX's options as a fresh import of JAX has them, or as changed

  observed["jax config"] = {k: repr(v) for k, v in sorted(jax.config.values.items())}
  return observed


if __name__ == "__main__":
  random.seed(0)
  np.random.seed(0)
  train(sys.argv[1] == "bridged")
  print(json.dumps(state()))
