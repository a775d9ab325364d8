"""Pipeline schedules as timetables: which pass each stage runs, on which micro-batch and chunk, and when.

A schedule is, per stage, an ordered list of passes: F (a chunk's forward), B (its input gradient, which
the previous chunk waits for), W (its weight gradient, which nothing waits for) or BW (the two together,
as 1F1B runs them). `simulate` starts every pass as soon as its stage is free and its inputs are there:
F(m, c) after F(m, c-1), B(m, c) after B(m, c+1) (the last chunk's after its own F: the loss), W after
its B; sends cost nothing. What is left idle between passes is the bubble.

Orders (stages s = 0..S-1, micro-batches 0..M-1):
  gpipe       every forward, then every backward (Huang et al. 2019).
  1f1b        S-1-s forwards to warm up, then one forward and one backward in turn (Narayanan et al. 2021).
  zb-h1       1F1B's order with each backward split, stage s's W run s micro-batches after its B: S in
              flight on every stage (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", 2.1, Figure 3).
  zb-h2       greedy: of what is ready, B, then F while fewer than 2S-1 are in flight, Ws in the gaps
              (the paper's 2.2 and its scheduler's rule).
  zb-v        two chunks per stage in a V (stage s holds chunks s and 2S-1-s), the same greedy rule with
              2S half-size chunks in flight, 1F1B's memory (Qi et al. 2024, "Pipeline Parallelism with
              Controllable Memory"; torchtitan's ScheduleZBVZeroBubble). At T_F = T_B = T_W and a synchronized
              step it idles the least a V can, (S-1) T_F / 2; it does not reach the post-validated zero.
  dualpipe-v  DualPipe's V variant, its eight steps as deepseek-ai/DualPipe's dualpipev.py runs them
              (a forward of one micro-batch beside a backward of another, started together; M >= 2S).
The papers' formulas: jaxpar/core/schedule.py (`stated_idle`, `stated_activations`); the derivations and
the figures: docs/pipelines.md; drawn by `jaxpar schedule`.
"""
from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError

KINDS = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v")
STATIC = ("gpipe", "1f1b", "zb-h1", "dualpipe-v")   # the rest laid out by the greedy rule
V_SHAPED = ("zb-v", "dualpipe-v")                   # two chunks per stage in a V: stage s holds chunks s, 2S-1-s


@dataclasses.dataclass(frozen=True)
class Times:
    """Seconds (or any unit) of one stage's passes over one micro-batch: the forward, the input gradient
    and the weight gradient. A chunk of a stage holding v chunks takes 1/v of them."""
    f: float = 1.0
    b: float = 1.0
    w: float = 1.0


@dataclasses.dataclass(frozen=True)
class Pass:
    kind: str      # F | B | W | BW
    mb: int        # micro-batch
    chunk: int     # chunk in execution order, 0..S*v-1
    paired: bool = dataclasses.field(default=False, compare=False)   # starts with the next pass (DualPipe's F&B)


@dataclasses.dataclass(frozen=True)
class Slot:
    stage: int
    start: float
    end: float
    op: Pass


@dataclasses.dataclass(frozen=True)
class Timetable:
    kind: str
    stages: int
    microbatches: int
    chunks: int                 # S*v
    slots: tuple[Slot, ...]
    work: float                 # busy time of one stage (every stage's is the same)

    @property
    def makespan(self) -> float:
        return max(s.end for s in self.slots)

    def span(self, stage: int) -> tuple[float, float]:
        mine = [s for s in self.slots if s.stage == stage]
        return min(s.start for s in mine), max(s.end for s in mine)

    @property
    def idle(self) -> float:
        """A stage's idle time when the step synchronizes at its end (gradient clipping): makespan - work."""
        return self.makespan - self.work

    @property
    def idle_between(self) -> float:
        """The largest idle time between a stage's own first and last pass: the bubble with the optimizer
        step's synchronization moved out of the step (Qi et al.'s post-validation)."""
        return max(b - a for a, b in map(self.span, range(self.stages))) - self.work

    @property
    def bubble(self) -> float:
        """Idle share of the synchronized step: (makespan - work) / makespan."""
        return self.idle / self.makespan

    def peak_in_flight(self, stage: int) -> int:
        """Most chunk activations the stage holds at once: from the start of a forward to the end of its W
        (or BW), when the weight gradient has read them."""
        events = [(s.start, 1) if s.op.kind == "F" else (s.end, -1)
                  for s in self.slots if s.stage == stage and s.op.kind in ("F", "W", "BW")]
        held = peak = 0
        for _, d in sorted(events):
            held += d
            peak = max(peak, held)
        return peak


def placement(kind: str, stages: int) -> tuple[int, ...]:
    """The stage of each chunk: one per stage, or two in a V (chunk c on stage c, chunk 2S-1-c on c)."""
    if kind in V_SHAPED:
        return tuple(range(stages)) + tuple(reversed(range(stages)))
    return tuple(range(stages))


def check(kind: str, stages: int, microbatches: int) -> None:
    """One-line errors for a schedule this module cannot lay out, before any work."""
    if kind not in KINDS:
        raise ConfigError(f"pp_schedule={kind!r} has no timetable; choose one of {', '.join(KINDS)}")
    if stages < 2 or microbatches < 1:
        raise ConfigError(f"a timetable needs stages >= 2 and microbatches >= 1 (got stages={stages}, "
                          f"microbatches={microbatches})")
    if kind == "dualpipe-v" and microbatches < 2 * stages:
        raise ConfigError(f"dualpipe-v needs microbatches >= 2 x stages (DualPipe's dualpipev.py), got "
                          f"microbatches={microbatches} with stages={stages}")


def duration(op: Pass, t: Times, per_stage: int) -> float:
    """A pass's time on one chunk: the stage's time over its chunks (1 or 2)."""
    full = {"F": t.f, "B": t.b, "W": t.w, "BW": t.b + t.w}[op.kind]
    return full / per_stage


def needs(op: Pass, chunks: int) -> Pass | None:
    """The pass `op` waits for on another chunk (or its own F), or None."""
    if op.kind == "F":
        return Pass("F", op.mb, op.chunk - 1) if op.chunk > 0 else None
    if op.kind in ("B", "BW"):
        if op.chunk == chunks - 1:
            return Pass("F", op.mb, op.chunk)
        return Pass("B", op.mb, op.chunk + 1)
    return Pass("B", op.mb, op.chunk)


def static_orders(kind: str, stages: int, m: int) -> list[list[Pass]]:
    """Each stage's passes in the order the schedule's source runs them (gpipe, 1f1b, zb-h1, dualpipe-v)."""
    if kind == "dualpipe-v":
        return [dualpipe_v(r, stages, m) for r in range(stages)]
    if kind == "zb-h1":
        return [zb_h1(s, stages, m) for s in range(stages)]
    orders = []
    for s in range(stages):
        warm = m if kind == "gpipe" else min(stages - 1 - s, m)
        order = [Pass("F", i, s) for i in range(warm)]
        for i in range(m - warm):
            order += [Pass("F", warm + i, s), Pass("BW", i, s)]
        order += [Pass("BW", i, s) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def zb_h1(s: int, stages: int, m: int) -> list[Pass]:
    """Stage s of ZB-H1: 1F1B's S-1-s warm-up forwards, then a forward, an input gradient and a W in turn,
    the W s micro-batches late, so every stage holds S micro-batches in flight (the first stage's 1F1B
    count) and the later stages' deferred Ws do not hold up the input gradients the earlier ones wait
    for; the rest after the last B (Qi et al. 2024, 2.1 and Figure 3)."""
    warm, lag = min(stages - 1 - s, m), s
    order = [Pass("F", i, s) for i in range(warm)]
    w = 0
    for k in range(m):
        if warm + k < m:
            order.append(Pass("F", warm + k, s))
        order.append(Pass("B", k, s))
        if k >= lag:
            order.append(Pass("W", w, s))
            w += 1
    return order + [Pass("W", i, s) for i in range(w, m)]


def dualpipe_v(rank: int, stages: int, m: int) -> list[Pass]:
    """Rank `rank`'s passes in DualPipe-V's eight steps (deepseek-ai/DualPipe, dualpipev.py `step`): phase 0
    is chunk `rank`, phase 1 chunk 2S-1-`rank`; a backward "with zero bubble" defers its W to a queue that
    `W` steps empty in order; an overlapped forward-and-backward pair is listed forward first."""
    chunk = (rank, 2 * stages - 1 - rank)
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queue: list[Pass] = []
    out: list[Pass] = []

    def f(p, paired=False):
        out.append(Pass("F", nxt["F", p], chunk[p], paired))
        nxt["F", p] += 1

    def b(p, zb=False):
        op = Pass("B" if zb else "BW", nxt["B", p], chunk[p])
        nxt["B", p] += 1
        out.append(op)
        if zb:
            queue.append(Pass("W", op.mb, op.chunk))

    def w():
        out.append(queue.pop(0))

    after, before = stages - rank - 1, rank + 1
    for _ in range(2 * after):
        f(0)
    for _ in range(before):
        f(0), f(1)
    for _ in range(after):
        b(1, zb=True), w(), f(1)
    for i in range(m - 2 * stages + rank + 1):
        f(0, paired=not (i == 0 and rank == stages - 1)), b(1)   # dualpipev.py leaves this one pair apart
        f(1, paired=True), b(0)
    for _ in range(after):
        b(1), f(1, paired=True), b(0)
    zb = False
    for i in range(before):
        zb = zb or (i == before // 2 and rank % 2 == 1)
        b(1, zb)
        zb = zb or (i == before // 2 and rank % 2 == 0)
        b(0, zb)
    for _ in range(after):
        w(), b(0, zb=True)
    for _ in range(before):
        w()
    return out


def greedy_limit(kind: str, stages: int) -> int:
    """Chunk activations a greedy stage may hold: 2S-1 (ZB-H2), 2S half-size chunks (ZB-V: 1F1B's memory)."""
    return {"zb-h2": 2 * stages - 1, "zb-v": 2 * stages}[kind]


def _key(op: Pass) -> tuple[str, int, int]:
    return ("B" if op.kind == "BW" else op.kind), op.mb, op.chunk


class _Stage:
    """One stage's state while `simulate` lays the timetable out: its free time and what it may run next."""

    def __init__(self, s: int, held: list[int], order: list[Pass] | None, limit: int):
        self.s, self.held, self.order, self.limit = s, held, order, limit
        self.free, self.next_f, self.next_b = 0.0, {c: 0 for c in held}, {c: 0 for c in held}
        self.waiting_w: list[Pass] = []
        self.in_flight = 0

    def candidates(self, m: int) -> list[Pass]:
        """What the stage may run next, in priority order: its static order's head; or (greedy) the next B of
        each chunk, then the next F of each chunk (the deeper first) while it holds fewer than its limit,
        and a W only when memory or the end leaves nothing else (`simulate` also fits Ws into idle gaps)."""
        if self.order is not None:
            return self.order[:1]
        out = [Pass("B", self.next_b[c], c) for c in sorted(self.held) if self.next_b[c] < m]
        if self.in_flight < self.limit:
            out += [Pass("F", self.next_f[c], c) for c in sorted(self.held, reverse=True) if self.next_f[c] < m]
        if self.in_flight >= self.limit or not out:
            out += self.waiting_w[:1]
        return out

    def ran(self, op: Pass, end: float) -> None:
        self.free = end
        if self.order is not None:
            self.order.pop(0)
            return
        if op.kind == "F":
            self.next_f[op.chunk] += 1
            self.in_flight += 1
        elif op.kind == "B":
            self.next_b[op.chunk] += 1
            self.waiting_w.append(Pass("W", op.mb, op.chunk))
        else:
            self.waiting_w.pop(0)
            self.in_flight -= 1


def _earliest(state: list[_Stage], ended: dict, chunks: int, m: int):
    """(start, stage, pass) of the pass that can start first: a candidate whose inputs have all been laid
    out (a paired F waits for its partner B's input too). No later choice can start earlier, since every
    pass not yet laid out ends after this start."""
    best = None
    for st in state:
        for op in st.candidates(m):
            deps = [d for d in (needs(op, chunks), needs(st.order[1], chunks) if op.paired else None) if d]
            if all(_key(d) in ended for d in deps):
                start = max([st.free] + [ended[_key(d)] for d in deps])
                if best is None or start < best[0]:
                    best = (start, st, op)
            if st.order is not None:   # a static stage runs its order's head or waits for it
                break
    return best


def _ready_by(op: Pass, start: float, ended: dict, chunks: int) -> bool:
    dep = needs(op, chunks)
    return dep is None or ended.get(_key(dep), float("inf")) <= start


def simulate(kind: str, stages: int, microbatches: int, times: Times = Times()) -> Timetable:
    """Lay out `kind` on `stages` stages and `microbatches` micro-batches: every pass starts when its stage is
    free and what it needs has ended. A greedy stage (zb-h2, zb-v) runs, of what is ready then, a B first,
    then an F (the deeper chunk first) while it holds fewer than `greedy_limit` activations, and a W where
    one fits in the time it would otherwise wait, where memory is full, or at the end."""
    check(kind, stages, microbatches)
    place, m = placement(kind, stages), microbatches
    chunks, per_stage = len(place), len(place) // stages
    static = static_orders(kind, stages, m) if kind in STATIC else [None] * stages
    limit = greedy_limit(kind, stages) if kind not in STATIC else 0
    state = [_Stage(s, [c for c in range(chunks) if place[c] == s], static[s], limit) for s in range(stages)]
    ended: dict[tuple[str, int, int], float] = {}
    slots: list[Slot] = []

    def run(st: _Stage, op: Pass, start: float) -> None:
        slots.append(Slot(st.s, start, start + duration(op, times, per_stage), op))
        ended[_key(op)] = slots[-1].end
        st.ran(op, slots[-1].end)

    total = sum(map(len, static)) if kind in STATIC else 3 * chunks * m
    while len(slots) < total:
        found = _earliest(state, ended, chunks, m)
        if found is None:
            raise RuntimeError(f"{kind} deadlocked after {len(slots)} of {total} passes (a bug in its order)")
        start, st, op = found
        if st.order is None:   # greedy: the first in priority of what is ready at `start`, Ws in the gap before
            op = next(o for o in st.candidates(m) if _ready_by(o, start, ended, chunks))
            while op.kind != "W" and st.waiting_w and st.free + duration(st.waiting_w[0], times, per_stage) <= start:
                run(st, st.waiting_w[0], st.free)
        run(st, op, start)
    return Timetable(kind, stages, m, chunks, tuple(slots), m * (times.f + times.b + times.w))


def text(t: Timetable, tick: float | None = None) -> str:
    """The timetable as rows of cells, one per stage and `tick` (the shortest pass): F, B, W or X (B and W
    together) and the micro-batch, lower case on a V's second chunk; `.` idle."""
    tick = tick or min(s.end - s.start for s in t.slots)
    width = len(str(t.microbatches - 1)) + 1
    ticks = round(t.makespan / tick)
    rows = []
    for stage in range(t.stages):
        cells = ["." * width] * ticks
        for s in (s for s in t.slots if s.stage == stage):
            letter = "X" if s.op.kind == "BW" else s.op.kind
            letter = letter.lower() if s.op.chunk >= t.stages else letter
            for i in range(round(s.start / tick), round(s.end / tick)):
                cells[i] = f"{letter}{s.op.mb:<{width - 1}}"
        rows.append(f"stage {stage:<3}" + " ".join(cells))
    return "\n".join(rows)
