"""Mamba-2 and hybrid models under every strategy that applies: loss and gradients equal 1 device."""
import pytest

from tests import harness


@pytest.mark.parametrize("model, mesh, devices, options", [
    ("mamba2-tiny", "data=8", 8, {}),
    ("mamba2-tiny", "fsdp=8", 8, {}),
    ("mamba2-tiny", "data=4,tensor=2", 8, {}),
    ("mamba2-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True}),
    ("mamba2-tiny", "context=4", 4, {}),
    ("mamba2-tiny", "data=2,context=2,tensor=2", 8, {"cp_layout": "zigzag"}),
    pytest.param("hybrid-tiny", "context=2,tensor=2", 4, {"attention": "ring"},
                 marks=pytest.mark.slow),   # 25 s; mamba2-tiny under data x context x tensor runs above
    ("hybrid-tiny", "fsdp=8", 8, {}),
])
def test_matches_one_device(model, mesh, devices, options):
    harness.assert_matches_one_device(model, mesh, devices, **options)
