"""What libraries ask to learn whether they are being traced, answered as under torch.compile.

Library code checks whether it is being compiled to take a trace-safe path: Hugging Face's mask
helpers skip `torch.all(mask == 1)` (a value read on the host) when `is_torchdynamo_compiling()`,
and `torch.cond` calls its operator directly when `torch.compiler.is_dynamo_compiling()`. Every
such check in torch and transformers reads `torch.compiler.is_compiling()` or
`is_dynamo_compiling()` at call time (`torch._dynamo.is_compiling`, `torch._utils.is_compiling`
and transformers' `is_torchdynamo_compiling` call the first), so in a thread that traces bridged
code both answer True; other threads, and the same thread outside a trace, get torch's answers.
`torch.jit.is_tracing()` keeps its answer (False, as under torch.compile).
"""
import torch

from torch_xla_jaxbridge._core import patching, tracing


def _is_compiling():
  return _SIGNALS.active() or _SIGNALS.original("is_compiling")()


def _is_dynamo_compiling():
  return _SIGNALS.active() or _SIGNALS.original("is_dynamo_compiling")()


_SIGNALS = patching.Patch(lambda: [torch.compiler],
                          {"is_compiling": _is_compiling,
                           "is_dynamo_compiling": _is_dynamo_compiling})
tracing.register_trace_context(lambda: _SIGNALS)
