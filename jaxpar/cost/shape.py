"""How one optimizer step is cut up on a device: batch per device, micro-batches, loop trip counts.

    b_loc       sequences per device per step: global_batch / (data * fsdp * expert)  (`batch` rule)
    mb          sequences per micro-batch: b_loc / (grad_accum * M), M = pipeline micro-batches
    s_loc       sequence positions per device: seq / context
    iterations  pipeline schedule iterations per accumulation step: GPipe M + S - 1,
                circular v*M + S - 1 (every stage runs every iteration, bubbles included)
    bubble      idle fraction of a pipelined step: (S - 1) / (v*M + S - 1)  (Narayanan et al. 2021, eq. 2)
    per_chunk   k, unit slots a stage runs per iteration: max of the split (jaxpar/core/schedule.py; an
                uneven split pads the shorter chunks with identity slots, which still execute)
    head_micro  micro-batches whose head and loss each stage runs: ceil(M / S) (jaxpar/pipeline/gpipe.py)
    exec_*      layer executions per device per step (what loop trip counts multiply in the HLO), per
                block kind: attention, Mamba-2, MoE (an attention half, then the experts):
                accum x T x k x blocks per unit under a pipeline
"""
from __future__ import annotations

import dataclasses

from jaxpar.cost.params import block_counts
from jaxpar.core.schedule import schedule_of
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True)
class StepShape:
    b_loc: float
    mb: float
    s_loc: float
    accum: int
    stages: int
    repeats: int
    micro: int
    iterations: int
    bubble: float
    exec_attention: float
    exec_mamba: float
    exec_moe: float = 0.0
    per_chunk: int = 1
    head_micro: int = 1

    @property
    def exec_layers(self) -> float:
        return self.exec_attention + self.exec_mamba + self.exec_moe


def step_shape(m: ModelConfig, st: Strategy, global_batch: int, seq: int) -> StepShape:
    sz, o = st.sizes, st.options
    stages = sz["pipeline"]
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"])
    na, nm, ne = block_counts(m)
    if stages > 1:
        sched = schedule_of(st, m.units)
        v, micro, iters, k = sched.repeats, sched.microbatches, sched.iterations, sched.per_chunk
        slots_per_unit = o.grad_accum * iters * k / m.units   # unit slots run per device, per unit of the model
        head_micro, bubble = sched.head_microbatches, sched.bubble
    else:
        v, micro, iters, k, head_micro, bubble = 1, 1, 1, m.units, 1, 0.0
        slots_per_unit = o.grad_accum
    return StepShape(b_loc=b_loc, mb=b_loc / (o.grad_accum * micro), s_loc=seq / sz["context"],
                     accum=o.grad_accum, stages=stages, repeats=v, micro=micro, iterations=iters,
                     bubble=bubble, exec_attention=slots_per_unit * na, exec_mamba=slots_per_unit * nm,
                     exec_moe=slots_per_unit * ne, per_chunk=k, head_micro=head_micro)


def head_share(shape: StepShape, spread: bool) -> float:
    """The head's FLOPs per device x devices / the step's head FLOPs: S x ceil(M/S)/M where each stage
    runs the head of its share of the micro-batches (`spread`, Software.pp_head_spread;
    jaxpar/pipeline/gpipe.py), S where the last stage runs all M (Megatron), 1 without a pipeline."""
    return shape.head_micro * shape.stages / shape.micro if (spread and shape.stages > 1) else shape.stages

