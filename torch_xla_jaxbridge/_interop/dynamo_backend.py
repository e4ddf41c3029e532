"""The `jaxbridge` torch.compile backend: each captured FX graph runs as one bridged JAX call.

Dynamo hands the backend a graph of torch ops; the graph is bridged (`BridgeModule`): torchax
traces it into a JAX function once per input signature, and each call adds the forward half of its
`jax.vjp` to the LazyTensor graph as one node (the backward half runs in torch's backward). CPU
inputs move to the XLA device through DLPack without copying, and results move back the same way
when no input was an XLA tensor (`dlpack.to_xla` / `to_cpu`: gradients move back through DLPack
too).
"""
import torch

from torch_xla_jaxbridge._bridge.module import BridgeModule
from torch_xla_jaxbridge._compat import torch_private
from torch_xla_jaxbridge._core import runtime
from torch_xla_jaxbridge._interop import dlpack

BACKEND_NAME = "jaxbridge"


def jaxbridge_backend(graph_module, example_inputs):
  """Dynamo backend: `torch.compile(fn, backend="jaxbridge")` (registered on import).

  Training works: gradients come from `jax.vjp` of the whole graph (Dynamo's graph is bridged
  before AOTAutograd would see it). A graph break splits the function into several bridged graphs
  with eager torch code between them.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> f = torch.compile(lambda x: torch.sin(x) * 2, backend="jaxbridge")
    >>> f(torch.ones(3)).device.type
    'cpu'
  """
  bridged = BridgeModule(graph_module)

  def run(*args):
    jax = runtime.jax_module()
    on_xla = any(isinstance(a, torch.Tensor) and a.is_xla  # type: ignore[attr-defined]
                 for a in args)
    moved = [dlpack.to_xla(a) if _is_cpu_tensor(a) else a for a in args]
    outputs = bridged(*moved)
    if on_xla:
      return outputs
    # the bridged call saves its inputs and residuals, never its outputs: an in-place change to
    # a result is as safe as in eager torch
    return jax.tree.map(
        lambda t: dlpack.to_cpu(t, check_in_place=False) if isinstance(t, torch.Tensor) else t,
        outputs, is_leaf=lambda t: isinstance(t, torch.Tensor))

  return run


def _is_cpu_tensor(value):
  return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def register():
  """Registers the backend under the name "jaxbridge" (done when the package is imported).

  Example:
    >>> register()
    >>> "jaxbridge" in torch.compiler.list_backends()
    True
  """
  torch_private.register_compile_backend(jaxbridge_backend, BACKEND_NAME)
