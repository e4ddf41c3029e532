"""Interop with the rest of the ecosystem: custom ops, `jaxify`, DLPack moves, the compile backend."""
