"""How one optimizer step is cut up on a device: batch per device, micro-batches, loop trip counts.

    b_loc       sequences per device per step: global_batch / (data * fsdp * expert)  (`batch` rule)
    mb          sequences per micro-batch: b_loc / (grad_accum * M), M = pipeline micro-batches
    s_loc       sequence positions per device: seq / context
    iterations  pipeline schedule iterations per accumulation step: GPipe M + S - 1,
                circular v*M + S - 1 (every stage runs every iteration, bubbles included)
    bubble      idle fraction of a pipelined step: (S - 1) / (v*M + S - 1)  (Narayanan et al. 2021, eq. 2)
    exec_*      layer executions per device per step (what loop trip counts multiply in the HLO), per
                block kind: attention, Mamba-2, MoE (an attention half, then the experts)
"""
from __future__ import annotations

import dataclasses

from jaxpar.cost.params import block_counts
from jaxpar.strategy import Strategy
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

    @property
    def exec_layers(self) -> float:
        return self.exec_attention + self.exec_mamba + self.exec_moe


def step_shape(m: ModelConfig, st: Strategy, global_batch: int, seq: int) -> StepShape:
    sz, o = st.sizes, st.options
    stages = sz["pipeline"]
    v = o.pp_repeats if (stages > 1 and o.pp_schedule == "circular") else 1
    micro = o.microbatches if stages > 1 else 1
    iters = v * micro + stages - 1 if stages > 1 else 1
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"])
    per_chunk = o.grad_accum * iters / (stages * v)
    na, nm, ne = block_counts(m)
    return StepShape(b_loc=b_loc, mb=b_loc / (o.grad_accum * micro), s_loc=seq / sz["context"],
                     accum=o.grad_accum, stages=stages, repeats=v, micro=micro, iterations=iters,
                     bubble=(stages - 1) / iters if stages > 1 else 0.0,
                     exec_attention=per_chunk * na, exec_mamba=per_chunk * nm,
                     exec_moe=per_chunk * ne)
