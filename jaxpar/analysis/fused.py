"""XLA:TPU's collectives inside fusions: which one a tally counts, what it is, and when it is in flight.

XLA:CPU emits every collective as its own instruction. XLA:TPU (a `--target tpu-...` compile,
jaxpar/analysis/target.py) wraps them in fusions, in two forms read here [seen in libtpu 0.0.52's output]:

Asynchronous collectives
    A collective that overlaps compute becomes several fusions of the calling computation, each holding a
    copy of the same collective instruction (same ``channel_id`` and dimensions; XLA:TPU gives distinct
    collectives one channel id too, e.g. the reduce-scatters of one layer's weight gradients):
    the *start* (its computation's root is ``custom-call(...), custom_call_target="AsyncCollectiveStart"``),
    zero or more *continuations* (``async_collective_fusion``: compute, e.g. a matmul, run while the data
    moves, the collective carried along) and the *done* (``custom_call_target="AsyncCollectiveDone"``).
    The collective runs once: the tally counts the copy in the start (or the first copy when there is no
    start) and skips the others; the overlap report's span is start .. done in the caller's schedule.
Reduce-scatter
    XLA:TPU's reduce-scatter is a fusion whose computation all-reduces and dynamic-slices each result to this
    device's 1/n (computation ``all-reduce-scatter``; XLA:CPU leaves the same pair unfused, and there it
    is an all-reduce). The tally reads it as a reduce-scatter of the all-reduce's buffer.

Phases: a collective inside a fusion may carry no ``op_name``; the fusion's is used.
"""
from __future__ import annotations

import dataclasses
import re

from jaxpar.analysis.hlo_text import Instruction, Module

_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"})
_DONE = 'custom_call_target="AsyncCollectiveDone"'
_LAYOUT = re.compile(r"\{[^{}]*\}")  # a shape's layout: copies of one collective differ in memory space


@dataclasses.dataclass(frozen=True)
class FusedCollective:
    """How the tally reads one collective instruction found inside a fusion computation."""

    counted: bool  # False: a continuation's or done's copy of a collective counted at its start
    kind: str  # the collective it implements ("reduce-scatter" for a fused all-reduce + dynamic-slice)
    at: str  # the fusion instruction, in the calling computation, that issues it
    done: str | None  # the fusion that completes it (asynchronous), in the same computation
    op_name: str | None  # its own op_name, else the fusion's


def fused_collectives(module: Module) -> dict[str, FusedCollective]:
    """Collective instruction name -> its reading, for every collective inside a fusion computation."""
    out: dict[str, FusedCollective] = {}
    for instrs in module.computations.values():
        seen: dict[tuple, str] = {}  # (channel id, dimensions) -> the fusion counted for it
        fusions = [(i, c) for i in instrs if i.opcode == "fusion" and (c := _callee(i, module)) is not None]
        dones = {ch: f.name for f, body in fusions if _holds(body, _DONE) for ch in _channels(body)}
        for fusion, body in fusions:
            scatter = _is_reduce_scatter(body)
            for instr in body:
                if instr.opcode not in _COLLECTIVES:
                    continue
                channel = (_CHANNEL.search(instr.text) or [None, instr.name])[1]
                key = (channel, _LAYOUT.sub("", instr.shape))
                first = key not in seen  # the schedule lists the start first
                kind = "reduce-scatter" if scatter and instr.opcode == "all-reduce" else instr.opcode
                out[instr.name] = FusedCollective(first, kind, fusion.name, dones.get(channel),
                                                  instr.op_name or fusion.op_name)
                seen.setdefault(key, fusion.name)
    return out


def _callee(fusion: Instruction, module: Module) -> list[Instruction] | None:
    match = _CALLS.search(fusion.text)
    return module.computations.get(match[1]) if match else None


def _holds(body: list[Instruction], target: str) -> bool:
    return any(i.opcode == "custom-call" and target in i.text for i in body)


def _channels(body: list[Instruction]) -> set[str]:
    return {m[1] for i in body if i.opcode in _COLLECTIVES and (m := _CHANNEL.search(i.text))}


def _is_reduce_scatter(body: list[Instruction]) -> bool:
    """An all-reduce whose results leave the computation only dynamic-sliced (its root: one dynamic-slice,
    or a tuple of them)."""
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    parts = [by_name.get(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
    return (any(i.opcode == "all-reduce" for i in body) and bool(parts)
            and all(p is not None and p.opcode == "dynamic-slice" for p in parts))
