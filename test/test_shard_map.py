"""`jb.spmd.shard_map` on the torch_xla mesh: a Pallas kernel (interpret mode) per shard inside a
bridged, FSDP-sharded decoder layer and inside `StackedLayers`, against eager CPU and the 1-device
run; a JAX function with shard_map through `call_jax`; the manual-sharding region in the HLO;
errors.

The 4-device checks run in their own process (test/shard_map_check.py, started by conftest.py at
session start, as test_spmd.py's are); each test asserts on its part.
"""
import re

import jax
import numpy as np
import pytest
import torch
import torch_xla.distributed.spmd as xs

import torch_xla_jaxbridge as jb
from kernels import decoder_case, kernel_decoder
from parity import part
from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._interop import shard_map

TOL = 1e-4


def test_four_devices(shard_map_facts):
  assert shard_map_facts["devices"] == 4


def test_jax_function_with_shard_map_through_call_jax(shard_map_facts):
  found = part(shard_map_facts, "call_jax")
  assert found["rel_err"] < TOL and found["bridged_rel_err"] < TOL
  assert found["grad_x"] < TOL and found["grad_w"] < TOL  # through jax.vjp of the shard_map
  # two sharded inputs, one output, and the psum over "model" inside the manual region
  assert found["hlo"] == {"full_to_shard": 2, "manual": 3, "shard_to_full": 1}
  assert found["all_reduce"]


def test_a_mesh_in_another_device_order_gives_the_same_values(shard_map_facts):
  assert part(shard_map_facts, "permuted_mesh")["rel_err"] < TOL


@pytest.mark.parametrize("name", ["layer", "stacked"])
def test_kernel_in_shard_map_in_fsdp_layers_matches_eager_cpu(shard_map_facts, name):
  found = part(shard_map_facts, name)
  assert found["loss"] == pytest.approx(found["ref_loss"], rel=TOL)
  assert found["out_rel_err"] < TOL
  assert found["grad_count"] == (18 if name == "stacked" else 9)
  assert max(found["grad_errs"]) < TOL
  assert found["sharded"] == 9  # every parameter (or stack) split over "fsdp"


@pytest.mark.parametrize("name", ["layer", "stacked"])
def test_the_lowered_step_holds_the_manual_region(shard_map_facts, name):
  found = part(shard_map_facts, name)
  # the two norms: each splits x and w into shards (4), joins its output (2); in the stack's scan
  # (remat.save_unfused, the scans' default) each norm also hands its saved value out of the
  # region for the backward (2 more)
  joins = {"layer": 2, "stacked": 4}[name]
  assert found["fwd_hlo"] == {"full_to_shard": 4, "manual": 4 + joins, "shard_to_full": joins}
  # the backward adds the norms' backward shard_maps
  assert found["bwd_hlo"]["full_to_shard"] > 4 and found["bwd_hlo"]["shard_to_full"] > 2


def test_the_kernel_is_not_recomputed_in_the_backward(shard_map_facts):
  # interpret mode runs the kernel's grid as a while loop: one per norm in the forward, and no
  # more in the whole step (the backward is the reference math); the stack adds its scan loops
  assert part(shard_map_facts, "layer")["kernel_loops"] == [2, 2]
  assert part(shard_map_facts, "stacked")["kernel_loops"] == [3, 4]


def test_the_sharded_layer_matches_the_one_device_run(shard_map_facts, dev):
  found = part(shard_map_facts, "layer")
  (layer,), x, positions = decoder_case(1)
  model = kernel_decoder(layer).to(dev)  # the kernel through call_jax, no shard_map
  loss = jb.BridgeModule(model)(x.to(dev), positions.to(dev)).pow(2).mean()
  loss.backward()
  assert found["loss"] == pytest.approx(loss.item(), rel=TOL)
  for p, sharded in zip(model.parameters(), found["grads"]):
    expected = p.grad.cpu().flatten()
    assert (torch.tensor(sharded) - expected).norm() <= TOL * max(expected.norm(), 0.1)


def test_each_shard_draws_its_own_random_numbers(shard_map_facts):
  found = part(shard_map_facts, "random")
  assert found["values"] == [0.0, 2.0] and 0.3 < found["kept"] < 0.7
  assert found["distinct_masks"] == 4


@pytest.mark.parametrize("case, message", [
    ("in_rank", r"UsageError: jb.spmd.shard_map\(<lambda>\): in_specs spec \('fsdp',\) has 1 "
                r"entries for a value of shape \(8, 8\); give one entry"),
    ("out_rank", r"out_specs spec \('fsdp',\) has 1 entries for a value of shape \(2, 8\)"),
    ("unknown_axis", r"in_specs spec \('model', None\) names mesh axis 'model', which the mesh "
                     r"does not have; its axes are \('fsdp', 'tensor'\)"),
    ("jax_unknown_axis", r"UsageError: .*names mesh axis 'model'"),
    ("mutation", r"MutationError: .*updated an argument of shape \(2, 8\) in place"),
    ("specs_per_argument", r"in_specs must hold one spec per positional argument \(1 here\)"),
    ("outside_traced_code", r"called on a xla:0 tensor of shape \(8, 8\) outside traced code"),
])
def test_bad_input_is_a_clear_error(shard_map_facts, case, message):
  found = part(shard_map_facts, "bad_input")
  assert found[case] is not None and re.search(message, found[case]), found[case]


def test_without_spmd_it_says_to_enable_it():
  mesh = xs.Mesh(np.arange(1), (1,), ("fsdp",))
  per_shard = jb.spmd.shard_map(lambda t: t * 2, (("fsdp", None),), ("fsdp", None), mesh)
  with pytest.raises(errors.BadArgumentError, match=r"SPMD is not enabled. Call "
                                                    r"torch_xla.runtime.use_spmd\(\)"):
    jb.bridge(per_shard)(torch.ones(2, 2, device="xla"))  # no fallback: a misuse
  with pytest.raises(errors.BadArgumentError, match=r"SPMD is not enabled"):
    jb.call_jax(per_shard, (torch.ones(2, 2, device="xla"),))


def test_a_spec_that_is_not_one_says_what_a_spec_is():
  with pytest.raises(errors.BadArgumentError, match=r"out_specs holds 3; a spec is a tuple of mesh "
                                                    r"axis names or None, one per dimension"):
    jb.spmd.shard_map(lambda t: t, (("fsdp",),), 3)


def test_torch_xla_and_jax_partition_specs_convert_alike():
  P = jax.sharding.PartitionSpec
  specs, exact = shard_map._pspec_tree({"a": ("x", None), "b": [P(("x", "y")), ()]}, "f", "specs")
  assert specs == {"a": P("x", None), "b": [P(("x", "y")), P()]}
  assert exact == {"a": True, "b": [False, True]}  # torch_xla style names every dimension
