"""SPMD: bridged code on sharded tensors over 4 virtual CPU devices, against eager CPU PyTorch and
the 1-device recipe run; output and gradient shardings; constraints in the lowered HLO; errors.

SPMD is process-global and irreversible, so the 4-device checks run once, in one subprocess
(test/spmd_check.py, which prints its facts as JSON; conftest.py starts it before the first test,
so it runs alongside the rest of the suite); each test asserts on its part.
"""
import pathlib
import shutil

import pytest
import torch

import torch_xla_jaxbridge as jb
from parity import part
from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._integrations import spmd
from torch_xla_jaxbridge.recipes import config, sharding, train

TOL = 1e-4
FSDP_ROW, FSDP_COL = "{devices=[4,1]0,1,2,3}", "{devices=[1,4]0,1,2,3}"


def test_four_devices(facts):
  assert facts["devices"] == 4


def test_call_jax_on_a_sharded_input_keeps_its_sharding(facts):
  found = part(facts, "call_jax")
  assert found["rel_err"] < TOL
  # an IR output has no sharding until the step runs; then it has the propagated one
  assert found["spec_before_sync"] == "" and found["spec"] == FSDP_ROW


@pytest.mark.parametrize("name", ["mlp_dp", "mlp_fsdp", "decoder_dp", "decoder_fsdp"])
def test_bridged_module_matches_eager_cpu(facts, name):
  found = part(facts, name)
  assert found["loss"] == pytest.approx(found["ref_loss"], rel=TOL)
  assert found["out_rel_err"] < TOL
  assert len(found["grads"]) >= 4
  for param, (err, _, _) in found["grads"].items():
    assert err < TOL, param


@pytest.mark.parametrize("name", ["mlp_dp", "decoder_dp"])
def test_data_parallel_output_is_split_over_the_batch(facts, name):
  found = part(facts, name)
  assert found["out_spec"].startswith("{devices=[4,1")
  assert all(grad == "{replicated}" for _, _, grad in found["grads"].values())


@pytest.mark.parametrize("name", ["mlp_fsdp", "decoder_fsdp"])
def test_fsdp_gradients_are_sharded_as_their_parameters(facts, name):
  found = part(facts, name)
  assert found["out_spec"] not in ("", "{replicated}")
  for param, (_, param_spec, grad_spec) in found["grads"].items():
    assert "fsdp" in found["specs"][param], param  # every parameter of these models divides
    assert param_spec in (FSDP_ROW, FSDP_COL, "{devices=[4]0,1,2,3}"), param
    assert grad_spec == param_spec, param


def test_scan_layers_on_sharded_layers(facts):
  found = part(facts, "scan")
  assert found["out_rel_err"] < TOL and found["max_grad_rel_err"] < TOL
  assert found["out_spec"] == FSDP_ROW
  assert len(found["grad_specs"]) == 12
  for param_spec, grad_spec in found["grad_specs"]:  # each layer's own gradient, as its parameter
    assert param_spec != "{replicated}" and grad_spec == param_spec


def test_mark_sharding_in_bridged_code_is_a_constraint_in_the_hlo(facts):
  found = part(facts, "constraints")
  # the mesh's device ids [3, 2, 1, 0], as torch_xla's own mark_sharding gives them
  assert found["torch_xla_spec"] == "{devices=[4,1]3,2,1,0}"
  assert found["bridge_hlo"] == [found["torch_xla_spec"]]
  assert found["bridge_out_spec"] == found["torch_xla_spec"]
  # the gradient is constrained too (JAX's transpose of the constraint)
  assert found["torch_xla_spec"] in found["bridge_grad_hlo"]
  assert found["bridge_grad_spec"] == found["torch_xla_spec"]
  assert found["bridge_rel_err"] < TOL
  assert found["with_gradients_specs"] == ["{devices=[1,4]3,2,1,0}"] * 2
  assert found["hooks_restored"]


def test_with_sharding_constraint_in_a_jax_function(facts):
  found = part(facts, "constraints")
  # (None, "model") on a (data=2, model=2) mesh: split over model, replicated over data
  partial = "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
  assert found["jax_hlo"] == [partial] and found["jax_out_spec"] == partial
  assert found["jax_rel_err"] < TOL


@pytest.mark.parametrize("case, message", [
    ("mesh_too_small", r"Number of device IDs \(2\) must match the global number of devices \(4\)"),
    ("spec_too_short", r"UsageError: xs.mark_sharding in bridged code: partition spec "
                       r"\('d',\) has 1 entries for a tensor of shape \(8, 8\)"),
    ("unknown_axis", r"UsageError: .* names mesh axis 'model', which the mesh does not "
                     r"have; its axes are \('d',\)"),
    ("odd_batch", r"train.batch: 6 does not divide over mesh.fsdp=4; use a multiple of 4"),
])
def test_bad_input_is_a_clear_error(facts, case, message):
  import re

  found = part(facts, "bad_input")
  assert found[case] is not None and re.search(message, found[case]), found[case]


@pytest.fixture(scope="module")
def one_device(recipe_run):
  """The default recipe's first 3 losses on one device (the run test_recipes.py checks too)."""
  return recipe_run()[0]


def test_recipe_fsdp4_matches_the_one_device_run(facts, one_device):
  found = part(facts, "recipe")
  assert found["losses"] == pytest.approx(one_device, rel=TOL)
  assert one_device[2] < one_device[0]
  shardings = found["param_shardings"]
  assert len(shardings) == 39
  assert all(s != "{replicated}" for s in shardings.values())  # every llama-tiny dim divides by 4


def test_recipe_fsdp4_with_a_bridge_module_per_layer_matches_the_one_device_run(facts,
                                                                              recipe_run):
  # loss.backward() and optimizer.step(), a BridgeModule per layer (not stacked)
  one_device, _ = recipe_run("remat.bridge=layers", "remat.stack_layers=false")
  found = part(facts, "recipe_layers")
  assert len(found["param_shardings"]) == 39  # a parameter per layer
  assert found["losses"] == pytest.approx(one_device, rel=TOL)
  assert all(s != "{replicated}" for s in found["param_shardings"].values())


def test_recipe_fsdp4_with_scan_layers_matches_the_one_device_run(facts, recipe_run):
  one_device, _ = recipe_run("remat.scan_layers=true")
  found = part(facts, "recipe_scan")
  assert found["losses"] == pytest.approx(one_device, rel=TOL)
  assert all(s != "{replicated}" for s in found["param_shardings"].values())


def test_recipe_with_flash_on_fsdp2_tensor2_matches_the_one_device_run(facts, recipe_run):
  one_device, _ = recipe_run("model.attention=flash")  # also test_flash_attention.py's run
  found = part(facts, "recipe_flash")
  assert found["losses"] == pytest.approx(one_device, rel=TOL)
  # the kernel runs per device: each layer's forward and backward enter and leave manual sharding
  assert found["full_to_shard"] > 0 and found["shard_to_full"] > 0


def test_recipe_fsdp4_with_stacked_layers_matches_the_one_device_run(facts, one_device):
  found = part(facts, "recipe_stacked")
  assert found["losses"] == pytest.approx(one_device, rel=TOL)
  stacks = {n: s for n, s in found["param_shardings"].items() if n.startswith("layers.")}
  assert len(stacks) == 9  # one stack per name of a decoder layer
  # sharded as one layer's parameter; the layer axis (first) kept whole
  assert all(s.startswith("{devices=[1,") and s != "{devices=[1,1]}" for s in stacks.values())


def test_constraint_without_spmd_says_to_enable_it():
  import numpy as np
  import torch_xla.distributed.spmd as xs

  mesh = xs.Mesh(np.arange(1), (1,), ("d",))
  with pytest.raises(errors.BadArgumentError, match=r"SPMD is not enabled. Call "
                                                    r"torch_xla.runtime.use_spmd\(\)"):
    jb.bridge(lambda x: xs.mark_sharding(x * 1, mesh, ("d",)))(torch.ones(2, device="xla"))


@pytest.mark.parametrize("name, shape, mesh, expected", [
    ("layers.0.attn.q_proj.weight", (64, 32), (4, 1), ("fsdp", None)),
    ("layers.0.mlp.down_proj.weight", (64, 192), (4, 1), (None, "fsdp")),
    ("layers.0.attn.q_proj.weight", (64, 32), (2, 2), ("tensor", "fsdp")),
    ("layers.0.attn.o_proj.weight", (64, 64), (2, 2), ("fsdp", "tensor")),
    ("norm.weight", (6,), (4, 1), (None,)),
    ("embed.weight", (256, 64), (1, 4), (None, "tensor")),
])
def test_param_spec(name, shape, mesh, expected):
  assert sharding.param_spec(name, shape, *mesh) == expected


def test_tiles_match_torch_xla_notation():
  tiles = spmd.Tiles((2, 1, 2), (0, 1, 2, 3), True)
  assert str(tiles) == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
  assert tiles.insert_dim(0).dims == (1, 2, 1, 2)
  assert str(spmd.Tiles((1, 1), (), False)) == "{replicated}"


def test_resume_onto_another_mesh_and_one_device(facts, recipe_run, tmp_path):
  """(4, 1) saves (test_spmd.py's recipe run), (2, 2) resumes from step 1 and saves, one device
  resumes from step 2: each next loss is the uninterrupted one-device run's."""
  found = facts["recipe_resharded"]
  assert "error" not in found, found.get("error")
  uninterrupted = recipe_run()[0]
  assert found["resumed"] == pytest.approx(uninterrupted[1:], rel=1e-4)
  assert "{devices=[2,2]0,1,2,3}" in found["param_shardings"].values()
  # every entry saved from (2, 2) too: partially replicated norm weights included
  assert found["keys_resharded"] == found["keys_fsdp4"]
  assert len([k for k in found["keys_fsdp4"] if k.startswith("model.")]) == 39
  shutil.copytree(pathlib.Path(found["checkpoints"]) / "step_000002",
                  tmp_path / "checkpoints" / "step_000002")
  last = train.train(config.load(["train.steps=3", "train.checkpoint_every=0", "resume=true",
                                  f"out={tmp_path}"]), log=lambda line: None)
  assert last == pytest.approx(uninterrupted[2:], rel=1e-4)
