"""Device selection and the safe import of JAX next to torch_xla.

torch_xla must create its PJRT client before JAX touches an accelerator, or the two fight over
the device. Everything in the package imports JAX through `jax_module()`.
"""
import importlib.util
import os

from torch_xla_jaxbridge._compat import torch_xla_private
from torch_xla_jaxbridge._core import threads

_ACCELERATOR_HINTS = ("PJRT_DEVICE", "TPU_NUM_DEVICES", "GPU_NUM_DEVICES", "NEURON_RT_VISIBLE_CORES")


def default_to_cpu():
  """Sets `PJRT_DEVICE=CPU` when the user chose no device and no TPU runtime is installed.

  Example:
    >>> default_to_cpu()  # before `import torch_xla`; a no-op once PJRT_DEVICE is set
  """
  if any(hint in os.environ for hint in _ACCELERATOR_HINTS):
    return
  if importlib.util.find_spec("libtpu") is None:
    os.environ["PJRT_DEVICE"] = "CPU"


@threads.once
def jax_module():
  """Returns the `jax` module, imported after torch_xla's PJRT client exists.

  Example:
    >>> jax = jax_module()
    >>> jax.numpy.ones(2).shape
    (2,)
  """
  torch_xla_private.init_computation_client()
  import jax

  return jax


@threads.once
def lowering_platform():
  """The JAX platform name that matches torch_xla's device: 'cpu', 'tpu', 'cuda' or 'neuron'.

  Example:
    >>> lowering_platform()  # with PJRT_DEVICE=CPU
    'cpu'
  """
  import torch_xla.runtime as xr

  device = (xr.device_type() or "CPU").upper()
  return {"CPU": "cpu", "TPU": "tpu", "CUDA": "cuda", "GPU": "cuda", "NEURON": "neuron"}.get(
      device, device.lower())
