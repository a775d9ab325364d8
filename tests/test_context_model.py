"""Context parallelism at model level on 4 devices (8-device CP strategies are in the catalogue
walk of test_strategies.py): llama-tiny loss and gradients equal the 1-device run."""
import numpy as np
import pytest

from tests import harness

MODEL = "llama-tiny"


@pytest.mark.parametrize("mesh", ["context=4", "context=2,tensor=2"])
@pytest.mark.parametrize("attention", ["ring", "allgather"])
def test_context_parallel_matches_one_device(mesh, attention):
    ref_loss, ref_grads = harness.loss_and_grads(MODEL, "data=1", devices=1)
    loss, grads = harness.loss_and_grads(MODEL, mesh, 4, attention=attention, cp_layout="zigzag")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref = dict(harness.leaves_with_paths(ref_grads))
    for path, g in harness.leaves_with_paths(grads):
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * np.max(np.abs(ref[path])), err_msg=path)
