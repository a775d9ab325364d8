"""jaxpar's own program's compute: where its pipelines recompute more, and run the head elsewhere, than
the textbook step (jaxpar/cost/flops.py) under the strategy's remat policy. `estimate` applies these for
software with `jaxpar_program`.

    recompute       GPipe / circular (jaxpar/pipeline/gpipe.py) run the stages under a vmap, which gives
                    every weight dot a batch dim, so `dots_no_batch` saves none of them and recomputes as
                    `full`; 1F1B (jaxpar/pipeline/one_f_one_b.py) recomputes its chunk from the stashed
                    input in every backward tick (`full`), and inside the chunk the units' own policy
                    reruns again what it drops (`dots_no_batch` as `full`: the same vmap).
                    tests/test_verify_scale.py::test_dots_no_batch_recomputes_as_full_inside_the_pipeline,
                    tests/test_cost_vs_xla.py::test_1f1b_applies_the_units_remat_policy_in_its_chunks
    head            1F1B spreads each steady tick's head over the stages, 1/S of a micro-batch each, so
                    a device runs 1/S of the step's head (`head_share`); GPipe's spread is the software
                    trait `pp_head_spread` (jaxpar/cost/software.py)
    padding         every stage runs its chunk in the same unit slots (the stages run in lockstep), so an
                    uneven split, and a model of several runs, computes its padding slots too
                    (jaxpar/core/schedule.py, jaxpar/pipeline/stages.py: `pipeline_padding`)
"""
from __future__ import annotations

import dataclasses

from jaxpar.cost import flops
from jaxpar.cost.shape import StepShape, chunk_layers
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def one_f_one_b(st: Strategy, shape: StepShape) -> bool:
    """The step runs jaxpar's own 1F1B schedule (jaxpar/pipeline/one_f_one_b.py): a pipeline, pp_schedule 1f1b."""
    return shape.stages > 1 and st.options.pp_schedule == "1f1b"


def recompute_policy(st: Strategy, sh: StepShape) -> str:
    """The remat policy whose recompute jaxpar's layers run (module docstring: `full` in its pipelines
    under `dots_no_batch`, and in 1F1B whatever the policy)."""
    remat = st.options.remat
    if one_f_one_b(st, sh) or (sh.stages > 1 and remat == "dots_no_batch"):
        return "full"
    return remat


def chunk_recompute(fl: flops.StepFlops, m: ModelConfig, st: Strategy, sh: StepShape, global_batch: int, seq: int,
                    kernels: flops.Kernels) -> flops.StepFlops:
    """`fl` plus what 1F1B's chunks rerun inside under the units' own policy (none outside 1F1B or
    without remat), as `kernels` compute the scores and the unit's last projection."""
    remat = st.options.remat
    if not one_f_one_b(st, sh) or remat == "none":
        return fl
    inner = "full" if remat == "dots_no_batch" else remat   # the stages' vmap: no dot without a batch dim
    again = flops.recompute_flops(m, inner, global_batch, seq,
                                  flops.Kernels(causal=kernels.causal, rerun_outputs=kernels.rerun_outputs))
    return dataclasses.replace(fl, recompute=fl.recompute + again.matmul, hardware=fl.hardware + again.matmul,
                               elementwise=fl.elementwise + again.other)


def head_share(st: Strategy, sh: StepShape, textbook: float) -> float:
    """shape.head_share for jaxpar's program: 1 under its 1F1B (each tick's head spread over the stages),
    else the `textbook` share."""
    return 1.0 if one_f_one_b(st, sh) else textbook


def pipeline_padding(fl: flops.StepFlops, m: ModelConfig, sh: StepShape, remat: str, global_batch: int, seq: int,
                     kernels: flops.Kernels) -> flops.StepFlops:
    """`fl` plus the FLOPs of the padding slots jaxpar's pipelines run (module docstring): per block kind,
    S x v x its slots per chunk less its layers, each a layer's forward in every pass (the layers' `remat`
    policy: a full rerun is one pass more); hardware FLOPs, not model FLOPs."""
    if sh.stages == 1 or sh.per_chunk * sh.stages * sh.repeats == m.units:   # no padding slot
        return fl
    block = {"A": lambda: flops.attention_block_flops(m, global_batch, seq, kernels.causal),
             "M": lambda: flops.mamba_block_flops(m, global_batch, seq),
             "E": lambda: flops.moe_block_flops(m, global_batch, seq, kernels.causal)}
    layers = {"A": m.attention_layers, "M": m.mamba_layers, "E": m.moe_layers}
    passes = flops.TRAIN_FACTOR + (1.0 if flops.unit_policy(remat) == "full" else 0.0)
    extra = 0.0
    for b in "AME":
        if padding := sh.stages * sh.repeats * chunk_layers(sh, m, b) - layers[b]:
            extra += padding * block[b]().matmul * passes
    return dataclasses.replace(fl, padding=fl.padding + extra, hardware=fl.hardware + extra)
