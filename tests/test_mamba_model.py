"""Mamba-2 and hybrid models under every strategy that applies: loss and gradients equal 1 device."""
import numpy as np
import pytest

from tests import harness


@pytest.mark.parametrize("model, mesh, devices, options", [
    ("mamba2-tiny", "data=8", 8, {}),
    ("mamba2-tiny", "fsdp=8", 8, {}),
    ("mamba2-tiny", "data=4,tensor=2", 8, {}),
    ("mamba2-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True}),
    ("mamba2-tiny", "context=4", 4, {}),
    ("mamba2-tiny", "data=2,context=2,tensor=2", 8, {"cp_layout": "zigzag"}),
    ("hybrid-tiny", "context=2,tensor=2", 4, {"attention": "ring"}),
    ("hybrid-tiny", "fsdp=8", 8, {}),
])
def test_matches_one_device(model, mesh, devices, options):
    ref_loss, ref_grads = harness.loss_and_grads(model, "data=1", devices=1)
    loss, grads = harness.loss_and_grads(model, mesh, devices, **options)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref = dict(harness.leaves_with_paths(ref_grads))
    got = dict(harness.leaves_with_paths(grads))
    assert got.keys() == ref.keys()
    for path, g in got.items():
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * np.max(np.abs(ref[path])), err_msg=path)
