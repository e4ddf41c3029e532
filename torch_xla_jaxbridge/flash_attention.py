"""`jb.flash_attention`: a Pallas flash-attention kernel and `sdpa` on it (docs/kernels.md)."""
from torch_xla_jaxbridge._interop.flash_attention import flash_attention as flash_attention
from torch_xla_jaxbridge._interop.flash_attention import sdpa as sdpa

__all__ = ["flash_attention", "sdpa"]
