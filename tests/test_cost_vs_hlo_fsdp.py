"""FSDP layouts beyond the catalogue, predicted vs compiled (the comparison of tests/test_cost_vs_hlo.py).

The catalogue's dp2-fsdp2-tp2, fsdp4-tp2-sp and fsdp2-ep4 are walked in tests/test_strategies.py; the
rules that made them match are checked here on other layouts, so that they are rules and not fits:
    data x fsdp without `tensor`   the norm weights' gradients all-reduced whole over data x fsdp (in the
                                   layer loop and the final norm's after it), the head's fsdp shard
                                   summed over data with the embedding's (jaxpar/cost/comm_data.py
                                   `_without_norms`); fsdp-major and data-major sizes
    remat under fsdp               o-proj's weight and the norms gathered once in the recomputed forward
                                   (models/transformer.py, models/layers.py), with data x tensor and under
                                   a policy that saves dot outputs (`dots_no_batch`: norms are none)
By default data=2,fsdp=4 and data=2,fsdp=2,tensor=2 under remat full (~2 s a compile); the others
under `-m slow`.
"""
from __future__ import annotations

import pytest

from tests.test_cost_vs_hlo import _case_param, assert_prediction_matches

CASES = [
    ("llama-tiny", "data=2,fsdp=4", 8, {}, None),
    ("llama-tiny", "data=4,fsdp=2", 8, {}, None),
    ("llama-tiny", "fsdp=8", 8, {"remat": "dots_no_batch"}, None),
    ("llama-tiny", "data=2,fsdp=2,tensor=2", 8, {"remat": "full"}, None),
]
DEFAULT = {("llama-tiny", "data=2,fsdp=4", ()), ("llama-tiny", "data=2,fsdp=2,tensor=2", (("remat", "full"),))}


@pytest.mark.parametrize("model, mesh, devices, options", [_case_param(*case, default=DEFAULT) for case in CASES])
def test_fsdp_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)
