"""Compare bridged modules against eager CPU PyTorch: outputs and every gradient."""
import copy

import torch
import torch_xla

import torch_xla_jaxbridge as jb


def rel_err(actual, expected):
  actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
  return ((actual - expected).norm() / expected.norm().clamp_min(0.1)).item()  # ~0 grads: abs


def check_module(model, *inputs, dev, train=True, tol=1e-4, remat=None):
  """Runs `model` eagerly on CPU and bridged on XLA; compares outputs, input and param grads."""
  torch.manual_seed(1)
  ref = copy.deepcopy(model).train(train)
  ref_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
  ref_out = ref(*ref_in)
  cotangent = torch.randn_like(ref_out)
  (ref_out * cotangent).sum().backward()

  on_device = copy.deepcopy(model).to(dev)
  if hasattr(on_device, "tie"):
    on_device.tie()
  bridged = jb.BridgeModule(on_device, remat=remat).train(train)
  xla_in = [x.detach().to(dev).requires_grad_(x.is_floating_point()) for x in inputs]
  out = bridged(*xla_in)
  (out * cotangent.to(dev)).sum().backward()
  torch_xla.sync()
  assert rel_err(out, ref_out) < tol
  for x, r in zip(xla_in, ref_in):
    if r.requires_grad:
      assert rel_err(x.grad, r.grad) < tol
  for (name, p), (_, r) in zip(bridged.named_parameters(), ref.named_parameters()):
    assert rel_err(p.grad, r.grad) < tol, name
  return bridged, ref


def part(facts, name):
  """The facts of check `name` from a 4-device check script's JSON, failing with its traceback if
  that check raised."""
  found = facts[name]
  assert "error" not in found, found.get("error")
  return found


def run_checks(checks, facts):
  """Runs each check of a check script into `facts[name]`; a check that raises is reported there as
  its traceback (so each test names its own failure) and the others still run."""
  import traceback

  for name, check in checks.items():
    try:
      facts[name] = check()
    except Exception:
      facts[name] = {"error": traceback.format_exc()}
  return facts
