"""Context parallelism at model level on 4 devices (8-device CP strategies are in the catalogue
walk of test_strategies.py): llama-tiny loss and gradients equal the 1-device run."""
import pytest

from tests import harness

MODEL = "llama-tiny"


@pytest.mark.parametrize("mesh", ["context=4", "context=2,tensor=2"])
@pytest.mark.parametrize("attention", ["ring", "allgather"])
def test_context_parallel_matches_one_device(mesh, attention):
    harness.assert_matches_one_device(MODEL, mesh, 4, attention=attention, cp_layout="zigzag")
