"""The sealed compatibility layer: every private entry point of another library the package uses.

One module per library (`torch_private`, `torch_xla_private`, `jax_private`, `torchax_private`;
JAX's lowering rules and primitives in `jax_lowering_private`, its jaxprs read and rebuilt in
`jaxpr_private`), one named function per entry
point, each with why it is needed, what breaks if it changes and the public alternative.
Nothing else in the package reads a private attribute of another library's object or imports
another library's private module (`test/test_architecture.py` checks it); `test/test_compat.py`
checks each entry point.
"""
