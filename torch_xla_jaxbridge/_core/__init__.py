"""The core call path: a JAX function or torch code as one cached node of the LazyTensor graph."""
