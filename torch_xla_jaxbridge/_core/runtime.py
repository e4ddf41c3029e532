"""Device selection and the safe import of JAX and torchax next to torch_xla.

torch_xla must create its PJRT client before JAX touches an accelerator, or the two fight over
the device. Everything in the package imports JAX through `jax_module()`, and with it torchax,
keeping the process as plain torch_xla leaves it (`process_state_kept`).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import random
import types
from typing import Any, Iterator

from torch_xla_jaxbridge._compat import torch_xla_private, torchax_private
from torch_xla_jaxbridge._core import threads

# A JAX pytree: tuples, lists, dicts (and registered nodes) of leaves, nested; any leaf type.
PyTree = Any

_ACCELERATOR_HINTS = ("PJRT_DEVICE", "TPU_NUM_DEVICES", "GPU_NUM_DEVICES", "NEURON_RT_VISIBLE_CORES")


def default_to_cpu() -> None:
  """Sets `PJRT_DEVICE=CPU` when the user chose no device and no TPU runtime is installed.

  Example:
    >>> default_to_cpu()  # before `import torch_xla`; a no-op once PJRT_DEVICE is set
  """
  if any(hint in os.environ for hint in _ACCELERATOR_HINTS):
    return
  if importlib.util.find_spec("libtpu") is None:
    os.environ["PJRT_DEVICE"] = "CPU"


@threads.once
def jax_module() -> types.ModuleType:
  """Returns the `jax` module, imported after torch_xla's PJRT client exists.

  Example:
    >>> jax = jax_module()
    >>> jax.numpy.ones(2).shape
    (2,)
  """
  torch_xla_private.init_computation_client()
  with process_state_kept(), gc_paused():
    import jax

    torchax_private.import_keeping_torch_state()
  return jax


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
  """Inside the block JAX and torchax may be imported and set up; after it, what they change in
  the process is as before: NumPy's and Python's global random streams (importing JAX draws from
  NumPy's), environment variables (JAX's backend and torchax set some), torch's fast path for
  multi-head attention (torchax turns it off). torch's device registry is kept by
  `torchax_private.import_keeping_torch_state`.

  Example:
    >>> import numpy
    >>> before = numpy.random.get_state()[1].sum()
    >>> with process_state_kept():
    ...   _ = numpy.random.rand(3)
    >>> bool(numpy.random.get_state()[1].sum() == before)
    True
  """
  import numpy
  import torch

  numpy_state, python_state = numpy.random.get_state(), random.getstate()
  environ, fast_path = dict(os.environ), torch.backends.mha.get_fastpath_enabled()
  try:
    yield
  finally:
    numpy.random.set_state(numpy_state)
    random.setstate(python_state)
    for name in set(os.environ) - set(environ):
      del os.environ[name]
    os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
    torch.backends.mha.set_fastpath_enabled(fast_path)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
  """Inside the block Python's cyclic garbage collector does not run; after it, it runs again
  if it was on. Importing JAX and tracing a step allocate hundreds of thousands of objects that
  stay alive, and the collections they set off took half of JAX's import and a fifth of a
  32-layer step's trace (docs/performance.md); what they leave is collected after the block.

  Example:
    >>> import gc
    >>> with gc_paused():
    ...   inside = gc.isenabled()
    >>> inside, gc.isenabled()
    (False, True)
  """
  was_on = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_on:
      gc.enable()


@threads.once
def lowering_platform() -> str:
  """The JAX platform name that matches torch_xla's device: 'cpu', 'tpu', 'cuda' or 'neuron'.

  Example:
    >>> lowering_platform()  # with PJRT_DEVICE=CPU
    'cpu'
  """
  import torch_xla.runtime as xr

  device = (xr.device_type() or "CPU").upper()
  return {"CPU": "cpu", "TPU": "tpu", "CUDA": "cuda", "GPU": "cuda", "NEURON": "neuron"}.get(
      device, device.lower())
