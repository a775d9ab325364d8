"""A pipeline schedule as numbers: stages, repeats, micro-batches, the stage split, iterations, bubble.

The arithmetic that jaxpar/pipeline/gpipe.py runs, jaxpar/core/validate.py checks, jaxpar/cost/shape.py costs and
`jaxpar train` prints, kept apart from the schedule's code so that checking a configuration imports no
model or kernel. Bubble fraction (S-1)/(v*M+S-1): GPipe (Huang et al. 2019) with v = 1; the circular /
interleaved schedule (Narayanan et al. 2021) with v model chunks per device. jaxpar's 1F1B runs
M + 2(S-1) lockstep ticks: S-1 of forwards only, M of a forward and a backward, S-1 of backwards only
(jaxpar/pipeline/one_f_one_b.py), so each stage runs M + S - 1 forwards and as many backwards, GPipe's bubble
(S-1)/(M+S-1) (Narayanan et al. 2021, 2.2.1: 1F1B's bubble equals GPipe's; it bounds the memory);
interleaved 1F1B (pp_repeats = v) the circular schedule's (S-1)/(v*M+S-1).

The split: the U stacked layer units are cut into S*v chunks in execution order (chunk c = r*S + s is
stage s's chunk in repeat r), of sizes `split`. Every chunk runs in k = max(split) unit slots (the
stages run in lockstep, one program on every device); a shorter chunk's last slots are padding, run
as the identity. By default the chunks are even (k = U / (S*v)) when S*v divides U; otherwise
k = ceil(U / (S*v)) and the first and last chunks are one unit lighter, then the second and
second-to-last, and so on, as Llama 3 405B's 126 layers on 16 stages (7, 8 x 14, 7; Dubey et al.
2024, "The Llama 3 Herd of Models", 3.3.2). `pp_stages = "2,3,3,2"` gives the split explicitly.

A model of several runs (models/config.py: 3 dense units, then 58 MoE) is split the same way over all its
units in layer order; each chunk runs its share of every run, run by run, in k_j slots of run j (the
largest share of run j in any chunk), so the chunk's slots are sum_j k_j and the rest padding.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

from jaxpar.errors import ConfigError
from jaxpar.core.inputs import parse_int
from jaxpar.core.rules import spec_entry
from jaxpar.core.strategy import Strategy
from jaxpar.core.timetable import V_SHAPED, Times


@functools.cache   # the cost model asks it for every candidate a planner prices
def default_split(units: int, chunks: int) -> tuple[int, ...]:
    """`units` over `chunks` chunks: even when possible, else the ends one unit lighter, outside in."""
    k = -(-units // chunks)
    sizes = [k] * chunks
    ends = [i for pair in zip(range(chunks), reversed(range(chunks))) for i in pair]
    for c in list(dict.fromkeys(ends))[:chunks * k - units]:
        sizes[c] -= 1
    return tuple(sizes)


def parse_split(text, units: int, chunks: int, what: str) -> tuple[int, ...]:
    """The `pp_stages` option: comma-separated unit counts, one per chunk, summing to `units`."""
    try:
        sizes = tuple(parse_int(p) for p in str(text).split(","))
    except ValueError:
        sizes = ()
    if not isinstance(text, str) or not sizes or min(sizes) < 1:
        raise ConfigError(f"option pp_stages={text!r} must list positive unit counts separated by commas, "
                          "e.g. pp_stages=\"2,3,3,2\"")
    if len(sizes) != chunks:
        raise ConfigError(f"option pp_stages={text!r} lists {len(sizes)} chunk(s), {what} runs {chunks}")
    if sum(sizes) != units:
        raise ConfigError(f"option pp_stages={text!r} sums to {sum(sizes)} units, the model has {units}")
    return sizes


ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipe-v")   # the backward split into B and W (jaxpar/core/timetable.py)


def chunks_per_stage(kind: str, pp_repeats: int) -> int:
    """v: the layer chunks a stage holds: pp_repeats under circular or 1f1b, 2 in a V, else 1."""
    return pp_repeats if kind in ("circular", "1f1b") else 2 if kind in V_SHAPED else 1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The shape of a pipeline schedule."""
    kind: str            # gpipe | circular | 1f1b | zb-h1 | zb-v | dualpipe-v (ZERO_BUBBLE)
    stages: int          # S, the pipeline axis size
    repeats: int         # v, chunks per stage (1 for GPipe)
    microbatches: int    # M
    runs: tuple[int, ...]         # stacked units of each run of the model, in layer order (U in all)
    split: tuple[int, ...] = ()   # units of chunk r*S + s; () = default_split
    part: bool = False            # one run's share of a model of several runs (`for_run`): never in place

    def __post_init__(self):
        if not self.split:
            object.__setattr__(self, "split", default_split(self.units, self.stages * self.repeats))

    @property
    def units(self) -> int:
        """U: the model's stacked units, every run's."""
        return sum(self.runs)

    def run_split(self, j: int) -> tuple[int, ...]:
        """Units of run j in each chunk (0 where a chunk holds none of it)."""
        return self._run_splits[j]

    @functools.cached_property   # the cost model reads it several times per estimate
    def _run_splits(self) -> tuple[tuple[int, ...], ...]:
        cuts, out = [0, *itertools.accumulate(self.split)], []
        for first, n in zip(itertools.accumulate(self.runs, initial=0), self.runs):
            out.append(tuple(max(0, min(b, first + n) - max(a, first)) for a, b in zip(cuts, cuts[1:])))
        return tuple(out)

    def for_run(self, j: int) -> Schedule:
        """The schedule of run j alone: its units, its share of each chunk (itself for a one-run model)."""
        if len(self.runs) == 1:
            return self
        return dataclasses.replace(self, runs=(self.runs[j],), split=self.run_split(j), part=True)

    @functools.cached_property
    def run_slots(self) -> tuple[int, ...]:
        """k_j: the slots of run j in every chunk (its largest share of one)."""
        return tuple(max(self.run_split(j)) for j in range(len(self.runs)))

    @property
    def per_chunk(self) -> int:
        """k: unit slots each stage runs per visit, every run's (one run: the largest chunk; the others
        padded to it)."""
        return max(self.split) if len(self.runs) == 1 else sum(self.run_slots)

    @property
    def even(self) -> bool:
        """One run, every chunk the same size (no padding slots, weights viewed without moving them)."""
        return not self.part and len(self.runs) == 1 and len(set(self.split)) == 1

    @property
    def slots(self) -> int:
        """Unit slots run per micro-batch, padding included: S * v * k."""
        return self.stages * self.repeats * self.per_chunk

    @property
    def stage_split(self) -> tuple[int, ...]:
        """Units per stage (its chunks summed over repeats)."""
        return tuple(sum(self.split[r * self.stages + s] for r in range(self.repeats)) for s in range(self.stages))

    @property
    def iterations(self) -> int:
        """T = v*M + S - 1 stage forwards per step (and as many backwards); 1F1B: M + S - 1 of its
        M + 2(S-1) ticks run a forward (jaxpar/pipeline/one_f_one_b.py)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of every stage: (S-1) / (v*M + S-1), 1F1B's (v = 1) as GPipe's; a zero-bubble
        schedule's stated idle over its step at T_F = T_B = T_W (`stated_idle`: a step's work 3M)."""
        if self.kind in ZERO_BUBBLE:
            idle = stated_idle(self.kind, self.stages, Times())[0]
            return idle / (3 * self.microbatches + idle)
        return (self.iterations - self.repeats * self.microbatches) / self.iterations

    @property
    def head_microbatches(self) -> int:
        """Micro-batches each stage runs the head and loss on: ceil(M / S) (padding weighs 0)."""
        return -(-self.microbatches // self.stages)


_LAST: list = [None, (), None]   # the strategy, runs and schedule last asked for: a candidate asks several times


def schedule_of(strategy: Strategy, runs: tuple[int, ...] | int) -> Schedule:
    """The schedule of a resolved strategy for a model of `runs` stacked units per run (ModelConfig.run_units;
    an int: one run). An explicit split is checked by jaxpar.core.validate first."""
    runs = (runs,) if isinstance(runs, int) else tuple(runs)
    if _LAST[0] is not strategy or _LAST[1] != runs:
        _LAST[:] = strategy, runs, _schedule_of(strategy, runs)
    return _LAST[2]


@functools.lru_cache(maxsize=4096)   # the cost model asks for it several times per candidate
def _schedule_of(strategy: Strategy, runs: tuple[int, ...]) -> Schedule:
    o = strategy.options
    repeats = chunks_per_stage(o.pp_schedule, o.pp_repeats)
    stages = strategy.size("pipeline")
    text = getattr(o, "pp_stages", "")
    split = parse_split(text, sum(runs), stages * repeats, o.pp_schedule) if text != "" else ()
    return Schedule(o.pp_schedule, stages, repeats, o.microbatches, runs, split)


def split_label(split: tuple[int, ...]) -> str:
    """Units per chunk as `2+3+3+2`; beyond 8 chunks as runs, `7+8x14+7` or `1x80`, so the line stays short."""
    if len(split) <= 8:
        return "+".join(map(str, split))
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "+".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def schedule_summary(strategy: Strategy, runs: tuple[int, ...] | int) -> str:
    """One line for `jaxpar train`: schedule, split, iteration count and bubble fraction."""
    s = schedule_of(strategy, runs)
    if s.stages == 1:
        return "pipeline: none (pipeline=1)"
    chunks = (f"{s.stages} stages x 2 chunks in a V" if s.kind in V_SHAPED else
              f"{s.stages} stages x {s.repeats} repeats" if s.repeats > 1 else f"{s.stages} stages")
    split = split_label(s.split)
    k = (f"k={s.per_chunk} slots" if len(s.runs) == 1
         else f"k={'+'.join(map(str, s.run_slots))} slots of its {len(s.runs)} runs")
    pad = f" ({k} per chunk, {s.slots - s.units} padding)" if not s.even else ""
    if s.kind in ZERO_BUBBLE:
        idle, formula = stated_idle(s.kind, s.stages, Times())
        return (f"pipeline: {s.kind}, {chunks}, units per chunk {split_label(s.split)} = {s.units}, {s.microbatches} "
                f"micro-batches: bubble idle / (3M + idle) at T_F = T_B = T_W, idle {formula} = {idle:g}: "
                f"{s.bubble:.1%} (jaxpar/core/timetable.py; `jaxpar schedule` draws it)")
    formula = "(S-1)/(M+S-1)" if s.repeats == 1 else "(S-1)/(v*M+S-1)"
    idle = s.iterations - s.repeats * s.microbatches
    steps = (f"{s.iterations + s.repeats * s.stages - 1} ticks, {s.iterations} forwards and {s.iterations} backwards "
             "per stage" if s.kind == "1f1b" else f"{s.iterations} iterations")
    return (f"pipeline: {s.kind}, {chunks}, units per chunk {split} = {s.units}{pad}, {s.microbatches} "
            f"micro-batches: {steps}, bubble {formula} = {idle}/{s.iterations} "
            f"= {s.bubble:.1%}")


def stored_spec(spec, shape: tuple[int, ...], strategy: Strategy, runs: tuple[int, ...] = ()):
    """At-rest PartitionSpec of a stacked weight [U, ...] (its `layers` dim first) under `strategy`, in a model
    of `runs` units per run (() = one run, this weight's).

    With an even split `layers` stays on `pipeline` (each device holds its stage's units, in place for
    the schedule). Otherwise `pipeline` moves to the first later dim it divides, with that dim's other
    axes (jit needs even shards; the memory per device stays 1/S), and jaxpar/pipeline/gpipe.py's stage view
    moves the units to their stages once per step; replicated over `pipeline` if no dim fits.
    `spec` is a jax.sharding.PartitionSpec; the result is one too."""
    stages = strategy.size("pipeline")
    dims = list(spec) + [None] * (len(shape) - len(spec))
    first = () if dims[0] is None else (dims[0],) if isinstance(dims[0], str) else tuple(dims[0])
    if stages == 1 or "pipeline" not in first or schedule_of(strategy, runs or shape[0]).even:
        return spec
    dims[0] = spec_entry(tuple(a for a in first if a != "pipeline"))
    for i in range(1, len(dims)):
        axes = () if dims[i] is None else (dims[i],) if isinstance(dims[i], str) else tuple(dims[i])
        n = stages
        for a in axes:
            n *= strategy.size(a)
        if shape[i] % n == 0:
            dims[i] = spec_entry(axes + ("pipeline",))
            break
    while dims and dims[-1] is None:
        dims.pop()
    return type(spec)(*dims)  # a PartitionSpec, built from the one given: this module imports no JAX



# ---- the zero-bubble schedules' arithmetic as their sources state it (jaxpar/core/timetable.py lays them out) --

def stated_idle(kind: str, stages: int, times) -> tuple[float, str]:
    """(a stage's idle time per step when the step ends in a synchronization, the source's formula) for
    `kind` on S = `stages` stages with per-stage pass times `times` (timetable.Times: T_F, T_B the input
    gradient alone, T_W). The papers state the zero-bubble schedules' bubble at T_F = T_B = T_W; their zero
    (ZB-H2, ZB-V) holds only with the optimizer's post-validation, which lets the next step's first stage
    start before the last finishes; jaxpar's step synchronizes (gradient clipping), which adds the time the
    last stage waits for its first input: (S-1) T_F, and (S-1) T_F / 2 in a V of half-size chunks."""
    S, f, b, w = stages, times.f, times.b, times.w
    if kind in ("gpipe", "1f1b"):
        return (S - 1) * (f + b + w), "(S-1)(T_F+T_B+T_W): Narayanan et al. 2021, 2.2.1"
    if kind == "zb-h1":
        return (S - 1) * (f + b - w), "(S-1)(T_F+T_B-T_W): Qi et al. 2024, Zero Bubble Pipeline Parallelism, 2.1"
    if kind == "zb-h2":
        return (S - 1) * f, "0 (Qi et al. 2024, 2.2, at T_F=T_B=T_W, post-validated) + the synchronized start (S-1)T_F"
    if kind == "zb-v":
        return (S - 1) * f / 2, ("0 (Qi et al. 2024, Pipeline Parallelism with Controllable Memory, at T_F=T_B=T_W, "
                                 "post-validated) + the synchronized start (S-1)T_F/2")
    chunk_f, chunk_b, chunk_w = f / 2, (b + w) / 2, w / 2   # dualpipe-v: DualPipe's F, full B and W of one chunk
    return ((S - 1) * (chunk_f + chunk_b + chunk_b - 3 * chunk_w),
            "(PP/2-1)(F&B+B-3W), PP = 2S chunks: deepseek-ai/DualPipe README")


def stated_activations(kind: str, stages: int, microbatches: int) -> tuple[int, str]:
    """(peak chunk activations a stage holds, the source's claim): a chunk is a stage's layers, or half of
    them in a V (zb-v, dualpipe-v)."""
    S, M = stages, microbatches
    claims = {"gpipe": (M, "every micro-batch (Huang et al. 2019)"),
              "1f1b": (min(S, M), "S on the first stage (Narayanan et al. 2021)"),
              "zb-h1": (min(S, M), "S on every stage: 1F1B's peak (Qi et al. 2024, 2.1)"),
              "zb-h2": (min(2 * S - 1, M), "2S-1 (Qi et al. 2024, 2.2)"),
              "zb-v": (min(2 * S, 2 * M), "2S half-size chunks: 1F1B's peak (Qi et al. 2024, controllable memory)"),
              "dualpipe-v": (2 * S + 1, "PP+1 chunks, PP = 2S (deepseek-ai/DualPipe README)")}
    return claims[kind]
