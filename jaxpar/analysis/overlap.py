"""Which collectives can hide behind compute in a compiled step: the overlap report of `jaxpar comm`.

A compiled (scheduled) HLO module lists each computation's instructions in the order they run. A
collective is *asynchronous* when XLA split it into a start and a done (``all-gather-start`` ...
``all-gather-done``; ``all-reduce-start``, ``collective-permute-start``, ``async-start`` wrapping a
reduce-scatter or all-to-all, with optional ``-update`` steps between). Whatever the schedule puts
between its start and its done runs while the data moves: the collective is *overlapped* when a
matmul (a ``dot``/``convolution``, a fusion holding one, or a GEMM custom-call) sits there, and
*exposed* otherwise (a synchronous collective is always exposed: the device waits for it).

XLA:TPU (a `--target tpu-...` compile) issues asynchronous collectives as fusions: a start, continuations that carry
the collective beside compute, and a done (jaxpar/analysis/fused.py); the span is start .. done alike.

The cost model's overlap terms (jaxpar/cost/time.py, software presets in jaxpar/cost/software.py)
use the same notion: a collective class is hidden up to the compute that runs while it is in flight.

XLA:CPU, where these analyses run, has no asynchronous collectives: every collective is a single
synchronous instruction, so the report says that nothing overlaps in its executable. What can still be
read there is the *decomposed structure* that lets an accelerator overlap: collective-permutes whose
chunk a matmul reads, or whose partial sum a matmul just produced (the rings of a collective matmul,
jaxpar/ops/collective_matmul.py, and of ring attention). ``decomposed`` lists, per computation holding
collective-permutes, how many there are, how many matmuls, and how many permutes are within a few
data-flow steps of a matmul.

The report (``overlap_report``) is a dict, part of the ``comm`` JSON object (docs/design.md):
    {"asynchronous": bool,
     "rows": [{"kind", "axes", "phase", "ops", "runs", "async_runs", "overlapped_runs", "bytes",
               "overlapped_bytes"}],            per kind x axes x phase, runs and bytes per step
     "decomposed": [{"computation", "runs", "axes", "permutes", "matmuls", "permutes_at_matmul"}]}
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from jaxpar.analysis.hlo_text import Instruction, Module, executed_instructions, parse_module
from jaxpar.analysis.tally import collective_ops

_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(gemm|matmul|cublas)', re.IGNORECASE)


def matmul_instructions(module: Module) -> set[str]:
    """Names of the instructions that compute a matmul: dots and convolutions, GEMM custom-calls, and
    fusions (XLA wraps dots in them) whose computation holds one."""
    comps = module.computations
    memo: dict[str, bool] = {}

    def holds(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # (a cycle cannot hold a dot that is not found elsewhere)
            memo[name] = any(_is_matmul_here(i) or any(holds(c) for c in _CALLS.findall(i.text) if c in comps)
                             for i in comps[name])
        return memo[name]

    out = set()
    for instrs in comps.values():
        for i in instrs:
            if _is_matmul_here(i) or (i.opcode == "fusion" and (m := _CALLS.search(i.text)) and holds(m[1])):
                out.add(i.name)
    return out


def _is_matmul_here(i: Instruction) -> bool:
    return i.opcode in ("dot", "convolution") or (i.opcode == "custom-call" and bool(_GEMM_TARGET.search(i.text)))


def _async_span(instrs: list[Instruction], k: int) -> list[Instruction] | None:
    """The instructions scheduled between the start at position k and its done (None: no done found)."""
    chain = {instrs[k].name}
    for j in range(k + 1, len(instrs)):
        op = instrs[j]
        if (op.opcode.endswith("-update") or op.opcode.endswith("-done")) and chain & set(op.operands):
            if op.opcode.endswith("-done"):
                return instrs[k + 1:j]
            chain.add(op.name)
    return None


def _fused_span(instrs: list[Instruction], k: int, done: str | None) -> list[Instruction] | None:
    """XLA:TPU's asynchronous fusions (jaxpar.analysis.fused): what runs between the start at position k
    and its done, the continuation fusions (a matmul carried with the collective) included."""
    names = [i.name for i in instrs]
    return instrs[k + 1:names.index(done)] if done in names[k + 1:] else None


def overlap_report(hlo: str | Module, axis_names: Sequence[str], device_ids: np.ndarray) -> dict:
    """The overlap report of a compiled module (module docstring); ``device_ids`` as for
    jaxpar.analysis.tally.tally."""
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    ops = {op.name: op for op in collective_ops(module, axis_names, device_ids)}
    matmuls = matmul_instructions(module)
    rows: dict[tuple, dict] = {}
    asynchronous = False
    for instrs in module.computations.values():
        for k, instr in enumerate(instrs):
            op = ops.get(instr.name)
            if op is None:
                continue
            span = _async_span(instrs, k) if instr.opcode.endswith("-start") else _fused_span(instrs, k, op.done)
            is_async = span is not None
            asynchronous |= is_async
            hidden = is_async and any(i.name in matmuls for i in span)
            row = rows.setdefault((op.kind, op.axes, op.phase), dict(
                kind=op.kind, axes=list(op.axes), phase=op.phase, ops=0, runs=0, async_runs=0,
                overlapped_runs=0, bytes=0, overlapped_bytes=0))
            row["ops"] += 1
            row["runs"] += op.times
            row["bytes"] += op.times * op.bytes
            row["async_runs"] += op.times if is_async else 0
            row["overlapped_runs"] += op.times if hidden else 0
            row["overlapped_bytes"] += op.times * op.bytes if hidden else 0
    return {"asynchronous": asynchronous, "rows": list(rows.values()),
            "decomposed": decomposed(module, ops, matmuls)}


def decomposed(module: Module, ops: dict, matmuls: set[str], hops: int = 3) -> list[dict]:
    """Per computation holding collective-permutes: their count and axes, the matmuls there, and how
    many permutes send a chunk that a matmul reads or a partial sum that a matmul produced (within
    `hops` data-flow steps, not counting other permutes)."""
    runs = {}
    for instr, times, _ in executed_instructions(module):
        runs.setdefault(instr.name, times)
    out = []
    for name, instrs in module.computations.items():
        permutes = [i for i in instrs if i.name in ops and ops[i.name].kind == "collective-permute"]
        if not permutes:
            continue
        by_name = {i.name: i for i in instrs}
        users: dict[str, list[str]] = {}
        for i in instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i.name)
        is_permute = {p.name for p in permutes}
        forward = lambda n: [u for u in users.get(n, []) if u not in is_permute]
        backward = lambda n: [o for o in (by_name[n].operands if n in by_name else []) if o not in is_permute]
        at_matmul = sum(_near(p.name, forward, matmuls, hops) or _near(p.name, backward, matmuls, hops)
                        for p in permutes)
        axes = sorted({a for p in permutes for a in ops[p.name].axes})
        out.append(dict(computation=name, runs=runs.get(permutes[0].name, 0), axes=axes, permutes=len(permutes),
                        matmuls=sum(i.name in matmuls for i in instrs), permutes_at_matmul=at_matmul))
    return out


def _near(start: str, step, targets: set[str], hops: int) -> bool:
    frontier = {start}
    for _ in range(hops):
        frontier = {n for name in frontier for n in step(name)}
        if frontier & targets:
            return True
    return False


def format_overlap(report: dict) -> str:
    """The overlap report as text (appended to `jaxpar comm`'s table)."""
    lines = ["overlap (compiled schedule):"]
    if not report["asynchronous"]:
        lines.append("  no asynchronous collectives: every collective runs alone, the device waits for it "
                     "(XLA:CPU schedules them synchronously; a GPU/TPU compile with an xla_preset issues "
                     "start/done pairs)")
    else:
        head = f"  {'kind':<20}{'axes':<16}{'phase':<11}{'runs':>7}{'async':>7}{'overlapped':>12}{'hidden bytes':>14}"
        lines += [head]
        for r in report["rows"]:
            share = r["overlapped_bytes"] / r["bytes"] if r["bytes"] else 0.0
            lines.append(f"  {r['kind']:<20}{','.join(r['axes']):<16}{r['phase']:<11}{r['runs']:>7}"
                         f"{r['async_runs']:>7}{r['overlapped_runs']:>12}{share:>13.0%}")
    for d in report["decomposed"]:
        lines.append(f"  decomposed: %{d['computation']} (runs {d['runs']}x per step): {d['permutes']} "
                     f"collective-permutes over {','.join(d['axes'])}, {d['matmuls']} matmuls; "
                     f"{d['permutes_at_matmul']} of the permutes feed or follow a matmul")
    return "\n".join(lines)

