"""`jb.dlpack`: zero-copy moves between XLA tensors, CPU tensors and `jax.Array`s (docs/dlpack.md)."""
from torch_xla_jaxbridge._interop.dlpack import cpu_to_xla as cpu_to_xla
from torch_xla_jaxbridge._interop.dlpack import jax_to_xla as jax_to_xla
from torch_xla_jaxbridge._interop.dlpack import to_cpu as to_cpu
from torch_xla_jaxbridge._interop.dlpack import to_xla as to_xla
from torch_xla_jaxbridge._interop.dlpack import xla_to_cpu as xla_to_cpu
from torch_xla_jaxbridge._interop.dlpack import xla_to_jax as xla_to_jax

__all__ = ["xla_to_jax", "jax_to_xla", "xla_to_cpu", "cpu_to_xla", "to_cpu", "to_xla"]
