"""A pipeline schedule as numbers: stages, repeats, micro-batches, iterations and the bubble.

The arithmetic that jaxpar/pipeline.py runs, jaxpar/validate.py checks and `jaxpar train` prints,
kept apart from the schedule's code so that checking a configuration imports no model or kernel.
Bubble fraction (S-1)/(v*M+S-1): GPipe (Huang et al. 2019) with v = 1; the circular / interleaved
schedule (Narayanan et al. 2021) with v model chunks per device.
"""
from __future__ import annotations

import dataclasses

from jaxpar.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The shape of a pipeline schedule."""
    kind: str            # gpipe | circular
    stages: int          # S, the pipeline axis size
    repeats: int         # v, chunks per stage (1 for GPipe)
    microbatches: int    # M
    units: int           # U, stacked layer units of the model

    @property
    def per_chunk(self) -> int:
        """k: units each stage applies per visit."""
        return self.units // (self.stages * self.repeats)

    @property
    def iterations(self) -> int:
        """T = v*M + S - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of every stage: (S-1) / (v*M + S-1)."""
        return (self.stages - 1) / self.iterations


def schedule_of(strategy: Strategy, units: int) -> Schedule:
    o = strategy.options
    repeats = o.pp_repeats if o.pp_schedule == "circular" else 1
    return Schedule(o.pp_schedule, strategy.size("pipeline"), repeats, o.microbatches, units)


def schedule_summary(strategy: Strategy, units: int) -> str:
    """One line for `jaxpar train`: schedule, iteration count and bubble fraction."""
    s = schedule_of(strategy, units)
    if s.stages == 1:
        return "pipeline: none (pipeline=1)"
    chunks = f"{s.stages} stages x {s.repeats} repeats" if s.kind == "circular" else f"{s.stages} stages"
    return (f"pipeline: {s.kind}, {chunks} x {s.per_chunk} unit(s) per chunk, {s.microbatches} micro-batches: "
            f"{s.iterations} iterations, bubble (S-1)/(v*M+S-1) = {s.stages - 1}/{s.iterations} = {s.bubble:.1%}")
