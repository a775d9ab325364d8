"""Pipeline x expert parallelism (jaxpar/pipeline/gpipe.py and one_f_one_b.py with the MoE kernel, jaxpar/ops/moe.py,
inside the stages): loss, every gradient and the router metrics equal one device's, GPipe, circular, 1F1B and
interleaved 1F1B, uneven splits; the planner takes the layouts.

The router's auxiliary losses are made of per-layer sums over the batch (models/moe.py: `router_stats`), which
the pipeline adds up over micro-batches (bubbles masked) before it turns them into losses: so the load-balance
loss, a product of two batch means, is the whole batch's, as on one device, not a mean of per-micro-batch losses.
1F1B runs a micro-batch's backward before the last forward: it seeds every backward with the cotangent of the
whole batch's statistics, collected by a forward pass first; a 10% error in that cotangent moves the router's
gradient by 1e-3 relative, a hundred times the tolerance.
Capacity mode (capacity_factor=1.0) drops copies, so `moe_dropped_fraction` and the load extremes are not trivial.

Each case compiles once: `(loss, metrics, gradients)` of `Trainer._loss_and_grads` in one jit.
"""
import functools

import jax
import numpy as np
import pytest

from jaxpar.planning.planner import check_plannable
from jaxpar.core.schedule import schedule_of
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import gather
from jaxpar.models.config import parse_model
from jaxpar.models.moe import AUX_FIELDS
from tests import harness

MODEL = "moe-tiny:layers=5,capacity_factor=1.0"   # 5 units: 2+3 on 2 stages, 1+1+2+1 on 2 stages x 2 repeats

CASES = {
    # weight copies per data shard (the vmap over them wraps the expert kernel's shard_map too), uneven GPipe
    "gpipe-uneven-ep2-dp2": ("pipeline=2,expert=2,data=2", dict(microbatches=2)),
    # every batch row of a stage on `expert` (no copies), circular with padding slots, M > S
    "circular-uneven-ep4": ("pipeline=2,expert=4", dict(microbatches=4, pp_schedule="circular", pp_repeats=2)),
    # 1F1B: the backward of micro-batch 0 before the forward of micro-batch 3, uneven 2+3
    "1f1b-uneven-ep4": ("pipeline=2,expert=4", dict(microbatches=4, pp_schedule="1f1b")),
    # interleaved 1F1B with weight copies per data shard and padding slots
    "1f1b-v2-uneven-ep2-dp2": ("pipeline=2,expert=2,data=2", dict(microbatches=4, pp_schedule="1f1b", pp_repeats=2)),
}
# slow: make test keeps MoE inside a pipeline with 1F1B (every row on expert, uneven stages); tests/test_pipeline.py
# keeps GPipe's weight copies per data shard and the circular schedule's padding slots on a dense model
SLOW_CASES = {"1f1b-v2-uneven-ep2-dp2", "circular-uneven-ep4", "gpipe-uneven-ep2-dp2"}
CASE_PARAMS = [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]


@functools.cache
def run(mesh: str, devices: int = 8, **options):
    """(trainer, loss, router metrics, gradients in layer order) of one batch from the reference parameters."""
    tr = harness.trainer(MODEL, mesh, devices, **options)
    state = tr.state_from_params(harness.reference_params(MODEL))
    loss, metrics, grads = jax.jit(tr._loss_and_grads)(state.params, tr.batch(harness.source(MODEL), 0))
    return tr, float(loss), {k: float(v) for k, v in metrics.items()}, gather(tr.reorder(grads, inverse=True))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_loss_gradients_and_router_metrics_match_one_device(case):
    mesh, options = CASES[case]
    _, ref_loss, ref_metrics, ref_grads = run("data=1", devices=1)
    tr, loss, metrics, grads = run(mesh, **options)
    sched = schedule_of(tr.strategy, tr.model_cfg.units)
    assert not sched.even and tr.layout.size("experts") > 1          # what the case is meant to cover
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert metrics.keys() == ref_metrics.keys() == set(AUX_FIELDS)
    assert ref_metrics["moe_dropped_fraction"] > 0 and ref_metrics["moe_load_max"] > 1.0   # not trivial
    for name in AUX_FIELDS:
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, err_msg=name)
    ref = dict(harness.leaves_with_paths(ref_grads))
    got = dict(harness.leaves_with_paths(grads))
    assert got.keys() == ref.keys()
    for path, g in got.items():
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * np.max(np.abs(ref[path])), err_msg=path)


def test_planner_takes_pipeline_x_expert():
    """`plan` and `estimate` rank pipeline x expert layouts, every schedule."""
    from jaxpar.cost.estimate import estimate  # noqa: PLC0415
    model = parse_model("moe-tiny:layers=4")
    for options in (dict(microbatches=4), dict(microbatches=4, pp_schedule="circular", pp_repeats=2),
                    dict(microbatches=4, pp_schedule="1f1b"), dict(microbatches=4, pp_schedule="1f1b", pp_repeats=2)):
        st = parse_strategy("pipeline=2,expert=2,data=2").with_options(**options).resolved(8)
        check_plannable(model, st, 64, 256)
        est = estimate(model, st, "h100-sxm", 64, 256)
        kinds = {(c.kind, c.axes) for c in est.collectives}
        assert {("all-to-all", ("expert",)), ("collective-permute", ("pipeline",))} <= kinds
