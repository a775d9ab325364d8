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
    run_execs   per run of the model (models/config.py runs), executions of its unit per device per step:
                accum x units of the run, or accum x T x k_j under a pipeline
    run_slots   per run, the unit slots of a pipeline stage's chunk, k_j (the run's units without one)
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from jaxpar.core.schedule import schedule_of
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


class StepShape(NamedTuple):
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
    run_execs: tuple[float, ...] = ()
    run_slots: tuple[int, ...] = ()

    @property
    def exec_layers(self) -> float:
        return self.exec_attention + self.exec_mamba + self.exec_moe


def step_shape(m: ModelConfig, st: Strategy, global_batch: int, seq: int) -> StepShape:
    sz, o = st.sizes, st.options
    stages = sz["pipeline"]
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"])
    if stages > 1:
        sched = schedule_of(st, m.run_units)
        v, micro, iters, k = sched.repeats, sched.microbatches, sched.iterations, sched.per_chunk
        slots = sched.run_slots
        head_micro, bubble = sched.head_microbatches, sched.bubble
    else:
        v, micro, iters, k, head_micro, bubble = 1, 1, 1, m.units, 1, 0.0
        slots = m.run_units
    per = o.grad_accum * iters
    execs = tuple(per * n for n in slots)   # unit executions per device, per run
    na, nm, ne = (per * n for n in block_slots(slots, m.runs))
    return StepShape(b_loc=b_loc, mb=b_loc / (o.grad_accum * micro), s_loc=seq / sz["context"],
                     accum=o.grad_accum, stages=stages, repeats=v, micro=micro, iterations=iters,
                     bubble=bubble, exec_attention=na, exec_mamba=nm, exec_moe=ne, per_chunk=k,
                     head_micro=head_micro, run_execs=execs, run_slots=slots)


def chunk_layers(shape, m: ModelConfig, letters: str = "AME") -> int:
    """Layers of the block kinds `letters` in a pipeline stage's chunk of unit slots, every run's: sum_j k_j
    x those blocks of run j's unit (`shape`: a StepShape or a core.schedule.Schedule, their `run_slots`)."""
    counts = block_slots(shape.run_slots, m.runs)
    return sum(counts["AME".index(b)] for b in letters)


@functools.cache   # the planner's hot path: a few (slots, runs) per model
def block_slots(slots: tuple[int, ...], runs: tuple) -> tuple[int, int, int]:
    """(attention, Mamba-2, MoE) blocks in `slots[j]` units of each run j: sum_j slots_j x its unit's blocks."""
    return tuple(sum(k * r.unit.count(b) for k, r in zip(slots, runs)) for b in "AME")


def head_share(shape: StepShape, spread: bool) -> float:
    """The head's FLOPs per device x devices / the step's head FLOPs: S x ceil(M/S)/M where each stage
    runs the head of its share of the micro-batches (`spread`, Software.pp_head_spread;
    jaxpar/pipeline/gpipe.py), S where the last stage runs all M (Megatron), 1 without a pipeline."""
    return shape.head_micro * shape.stages / shape.micro if (spread and shape.stages > 1) else shape.stages

