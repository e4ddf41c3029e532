"""`jb.spmd`: SPMD sharding with and inside bridged code (docs/spmd.md)."""
from torch_xla_jaxbridge._core.sharding import shard_like as shard_like
from torch_xla_jaxbridge._core.sharding import shardings_of as shardings_of
from torch_xla_jaxbridge._interop.shard_map import shard_map as shard_map
from torch_xla_jaxbridge._integrations.spmd import place_from_cpu as place_from_cpu
from torch_xla_jaxbridge._integrations.spmd import sharding_spec as sharding_spec
from torch_xla_jaxbridge._integrations.spmd import with_sharding_constraint as with_sharding_constraint

__all__ = ["shard_map", "with_sharding_constraint", "place_from_cpu", "sharding_spec",
           "shardings_of", "shard_like"]
