"""Pipeline parallelism's collectives: the sends between stages, per schedule iteration (Narayanan et al.
2021). Sites as jaxpar/cost/sites.py records them. What jaxpar's own pipelines issue besides (the head
spread over the stages, the boundary sums, an uneven split's weight moves, 1F1B's head and recomputes) is
program_pipeline.py's."""
from __future__ import annotations

from jaxpar.collectives import AG, PERMUTE
from jaxpar.cost import sites
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def pipeline_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int,
                      scatter_gather: bool = False) -> list[tuple]:
    """The stage-to-stage sends (Narayanan et al. 2021; jaxpar/pipeline/gpipe.py, one_f_one_b.py): one
    collective-permute of the stage state (a micro-batch's residual stream) per schedule iteration forward,
    and its transpose backward (GPipe M+S-1, circular v*M+S-1 iterations; 1F1B's v*M+S-1 ticks shift the
    state up and as many the cotangent down). The state is split over `tensor` under SP; with Megatron's
    scatter/gather (`scatter_gather`: Narayanan 2021, 4.1) it is split for the send and all-gathered over
    `tensor` on arrival. What jaxpar's own pipelines add: program_pipeline.py."""
    sp, sizes = st.options.sequence_parallel, st.sizes
    split = sp or scatter_gather
    x = shape.mb * shape.s_loc * m.d_model * act
    n = shape.iterations * shape.accum
    sent = x / sizes["tensor"] if split else x
    ax = ("pipeline",)
    out = sites.issue(PERMUTE, ax, n, [sent], "forward") + sites.issue(PERMUTE, ax, n, [sent], "backward")
    if split and not sp and sizes["tensor"] > 1:
        out += sites.issue(AG, ("tensor",), n, [x], "forward") + sites.issue(AG, ("tensor",), n, [x], "backward")
    return out
