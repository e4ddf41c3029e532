"""`jb.remat`: what the backward of bridged code keeps, recomputes or offloads (docs/remat.md)."""
from torch_xla_jaxbridge._bridge.remat import Preset as Preset
from torch_xla_jaxbridge._bridge.remat import Remat as Remat
from torch_xla_jaxbridge._bridge.remat import RematArg as RematArg
from torch_xla_jaxbridge._bridge.remat import checkpoint_name as checkpoint_name
from torch_xla_jaxbridge._bridge.remat import offloads as offloads
from torch_xla_jaxbridge._bridge.remat import presets as presets
from torch_xla_jaxbridge._bridge.remat import register_preset as register_preset
from torch_xla_jaxbridge._bridge.remat import save_unfused as save_unfused

__all__ = ["Remat", "RematArg", "Preset", "checkpoint_name", "presets", "register_preset",
           "offloads", "save_unfused"]
