"""Two readings of compiled HLO besides the collective tally (jaxpar.analysis.tally), used by `jaxpar comm`.

``dot_flops``
    FLOPs of every ``dot`` per step, loop trip counts included, and as XLA's cost analysis counts
    them (each loop body once): 2 x result elements x contracted elements.
``scatter_like_all_reduces``
    All-reduces whose every result is only dynamic-sliced to this device's 1/n afterwards: the
    reduce-scatters that XLA:CPU does not form (it has no ReduceScatterCreator pass).

Both walk the module with jaxpar.analysis.hlo_text's reader: ``parse_module`` and ``executed_instructions``
(the call graph, trip counts applied), and the second reads the all-reduces off the tally's ``collective_ops``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from jaxpar.analysis.hlo_text import Module, executed_instructions, parse_module, shape_bytes
from jaxpar.analysis.tally import collective_ops
from jaxpar.collectives import UNMATCHED_AXES, Collective, wire_factor


def dot_flops(hlo_text: str) -> tuple[float, float]:
    """FLOPs of every ``dot`` per step (trip counts included) and as counted with each loop body
    run once (XLA's cost analysis view): 2 x result elements x contracted elements."""
    module = parse_module(hlo_text)
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    once = {name: [_without_trip_count(i) for i in instrs] for name, instrs in module.computations.items()}
    return _sum_dot_flops(module, shapes), _sum_dot_flops(Module(once, module.entry), shapes)


def _without_trip_count(instr):
    if instr.opcode != "while":
        return instr
    return dataclasses.replace(instr, text=re.sub(r'"known_trip_count":\{"n":"\d+"\}',
                                                  '"known_trip_count":{"n":"1"}', instr.text))


def _sum_dot_flops(module: Module, shapes: dict[str, str]) -> float:
    total = 0.0
    for instr, times, _ in executed_instructions(module):
        if instr.opcode == "dot" and times:
            total += times * one_dot_flops(instr, shapes)
    return total


def one_dot_flops(instr, shapes: dict[str, str]) -> float:
    lhs = instr.operands[0]
    lhs_dims = dims(shapes[lhs])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.text)
    contracted = math.prod(lhs_dims[int(d)] for d in contracting[1].split(",") if d) if contracting else 1
    return 2.0 * math.prod(dims(instr.shape)) * contracted


def dims(shape: str) -> list[int]:
    match = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    return [int(d.strip().removeprefix("<=")) for d in match[1].split(",") if d.strip()] if match else []


# ----------------------------------------------------------------------------------------------
# All-reduces that are reduce-scatters in disguise (XLA:CPU forms no reduce-scatter)
# ----------------------------------------------------------------------------------------------

_PASS_THROUGH = frozenset({"bitcast", "copy", "reshape", "convert"})  # keep every element, in order


def scatter_like_all_reduces(hlo_text: str, axis_names: Sequence[str], device_ids) -> list[Collective]:
    """The all-reduces whose every result is only ever dynamic-sliced to 1/n (n = group size):
    what GPU/TPU XLA turns into reduce-scatters. ``bytes`` counts those results, per step."""
    module = parse_module(hlo_text)
    computations = module.computations
    users = _users(computations)
    by_name = {i.name: i for instrs in computations.values() for i in instrs}
    merged: dict[tuple, list] = {}
    for op in collective_ops(module, axis_names, device_ids):
        instr = by_name[op.name]
        if instr.opcode != "all-reduce" or op.axes == UNMATCHED_AXES:
            continue
        n = op.group_size
        sliced = sum(shape_bytes(shape) for name, shape in _results(instr, users)
                     if _only_sliced(name, _elements(shape), n, users, computations))
        if sliced:
            entry_ = merged.setdefault((op.axes, op.phase), [0, 0, 0.0])
            entry_[0] += op.times
            entry_[1] += op.times * sliced
            entry_[2] += op.times * sliced * wire_factor("all-reduce", n)
    return [Collective("all-reduce", axes, c, b, w, phase) for (axes, phase), (c, b, w) in merged.items()]


def _users(computations) -> dict[str, list[tuple]]:
    """Instruction name -> [(user instruction, operand position), ...] (names are module-unique)."""
    out: dict[str, list[tuple]] = {}
    for instrs in computations.values():
        for instr in instrs:
            if "(" not in instr.text:
                continue
            for pos, name in enumerate(instr.operands):
                out.setdefault(name, []).append((instr, pos))
    return out


def _results(instr, users) -> list[tuple[str, str]]:
    """(name, shape) of each array an all-reduce produces: itself, or its get-tuple-elements."""
    if not instr.shape.startswith("("):
        return [(instr.name, instr.shape)]
    return [(u.name, u.shape) for u, _ in users.get(instr.name, []) if u.opcode == "get-tuple-element"]


def _elements(shape: str) -> int:
    return math.prod(dims(shape))


def _only_sliced(name: str, elements: int, n: int, users, computations, exits: tuple[str, ...] = ()) -> bool:
    """Whether every use of ``name`` is a dynamic-slice keeping elements/n, through bitcasts,
    copies, reshapes and converts, into fusions and out of them again (``exits``: the fusions whose
    result ``name`` becomes if it is the root of their fused computation)."""
    uses = users.get(name, [])
    if not uses:
        return bool(exits) and _only_sliced(exits[-1], elements, n, users, computations, exits[:-1])
    for user, pos in uses:
        if user.opcode == "dynamic-slice":
            ok = pos == 0 and _elements(user.shape) * n == elements
        elif user.opcode in _PASS_THROUGH:
            ok = _only_sliced(user.name, elements, n, users, computations, exits)
        elif user.opcode == "fusion":
            param = _fusion_parameter(user, pos, computations)
            ok = param is not None and _only_sliced(param, elements, n, users, computations, exits + (user.name,))
        else:
            ok = False
        if not ok:
            return False
    return True


def _fusion_parameter(fusion, pos: int, computations) -> str | None:
    called = re.search(r"\bcalls=%?([\w.\-]+)", fusion.text)
    for instr in computations.get(called[1], []) if called else []:
        if instr.opcode == "parameter" and re.match(rf"parameter\({pos}\)", instr.text):
            return instr.name
    return None
