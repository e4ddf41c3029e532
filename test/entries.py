"""The package's ways in, for tests that run one model through each of them."""
import torch_xla_jaxbridge as jb

ENTRIES = ("bridge_modules", "BridgeModule", "bridge")


def bridged(entry, model, class_name):
  """`model` as a caller calls it through `entry`: its submodules of class `class_name` bridged
  in place (`bridge_modules`), the whole model wrapped (`BridgeModule`), or a function calling
  it bridged (`bridge`)."""
  if entry == "bridge_modules":
    jb.bridge_modules(model, [class_name])
    return model
  if entry == "BridgeModule":
    return jb.BridgeModule(model)
  return jb.bridge(lambda x: model(x))
