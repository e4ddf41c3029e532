"""The bridge: torch code traced once per signature, forward and backward as `jax.vjp` halves."""
