"""Every 8-device strategy in mesh_configs computes what one device computes (float32).

The reference is the same model on one device from the same parameters and the same batch:
loss and every gradient leaf agree to rtol 1e-5, and a 10-step training trajectory to 1e-4.
Expert-parallel strategies (expert > 1) run moe-tiny, whose experts they split; with a dense model
the `expert` axis is one more batch axis (tests/test_cost_vs_hlo.py walks them on llama-tiny).
"""
import numpy as np
import pytest

from jaxpar.core.strategy import catalogue, parse_strategy
from tests import harness
from tests.test_cost_vs_hlo import CATALOGUE, _param, assert_prediction_matches

MODEL = "llama-tiny"
PIPELINE_MODEL = "llama-tiny:layers=8"  # stages x repeats must divide the layer units
MOE_MODEL = "moe-tiny"


def model_for(mesh: str) -> str:
    strategy = parse_strategy(mesh)
    if strategy.size("expert") > 1:
        return MOE_MODEL
    return PIPELINE_MODEL if strategy.size("pipeline") > 1 else MODEL


EIGHT_DEVICE = [s.name for s in harness.distinct(catalogue()) if s.num_devices == 8]  # aliases: once


def test_catalogue_has_the_foundation_strategies():
    for name in ("dp8", "zero1-dp8", "fsdp8", "tp8", "dp2-tp4", "tp4-sp", "dp2-fsdp2-tp2", "fsdp4-tp2-sp",
                 "cp8-ring", "cp4-tp2-ring", "dp2-cp4-zigzag", "cp8-allgather", "pp4-dp2", "pp2-tp2-dp2",
                 "pp4-circular", "ep8", "dp2-ep4", "ep4-tp2", "fsdp2-ep4"):
        assert name in EIGHT_DEVICE


@pytest.mark.parametrize("mesh", EIGHT_DEVICE)
def test_loss_and_gradients_match_one_device(mesh):
    harness.assert_matches_one_device(model_for(mesh), mesh)


# The pipelines' 10-step trajectories compile the longest (15 to 20 s each): `make test-slow` runs them;
# their loss and every gradient are checked above in `make test`.
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.slow) if m.startswith("pp") else m
                                  for m in EIGHT_DEVICE])
def test_training_trajectory_matches_one_device(mesh):
    model = model_for(mesh)
    ref, _ = harness.trajectory(model, "data=1", devices=1)
    got, _ = harness.trajectory(model, mesh)
    assert ref[-1] < ref[0]  # the reference itself learns
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh", [_param(s) for s in CATALOGUE])
def test_catalogue_strategy_prediction_equals_hlo(mesh):
    """tests/test_cost_vs_hlo.py's walk of the catalogue (its docstring says what is compared; strict
    xfails name what is not modelled), run here so that each strategy's step compiles once for the
    trajectory above and this comparison."""
    strategy = parse_strategy(mesh)
    assert_prediction_matches(model_for(mesh), mesh, strategy.num_devices)


def test_tensor_beyond_kv_heads_replicates_them_and_matches_one_device():
    """tensor=8 > kv_heads=2 (llama-tiny:kv_heads=2): K/V heads replicated across tensor ranks
    (Megatron's rule, jaxpar.core.sharding.model_layout) instead of refused; loss and gradients equal one
    device's, and the K/V projection weights are indeed whole on every tensor rank."""
    model = "llama-tiny:kv_heads=2"
    harness.assert_matches_one_device(model, "tensor=8")
    tr = harness.trainer(model, "tensor=8")
    specs = {harness.jax.tree_util.keystr(p): s.spec for p, s in
             harness.jax.tree_util.tree_leaves_with_path(tr.param_shardings)}
    wk = next(spec for path, spec in specs.items() if "'wk'" in path)
    assert "tensor" not in str(wk), wk
