"""Two readings of compiled HLO besides the collective tally (jaxpar.hlo), used by `jaxpar comm`.

``dot_flops``
    FLOPs of every ``dot`` per step, loop trip counts included, and as XLA's cost analysis counts
    them (each loop body once): 2 x result elements x contracted elements.
``scatter_like_all_reduces``
    All-reduces whose every result is only dynamic-sliced to this device's 1/n afterwards: the
    reduce-scatters that XLA:CPU does not form (it has no ReduceScatterCreator pass).

Both walk the module with jaxpar.hlo's parser and call graph.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from jaxpar import hlo


def dot_flops(hlo_text: str) -> tuple[float, float]:
    """FLOPs of every ``dot`` per step (trip counts included) and as counted with each loop body
    run once (XLA's cost analysis view): 2 x result elements x contracted elements."""
    computations, entry = hlo._parse_module(hlo_text)  # noqa: SLF001 (shared HLO reader)
    shapes = {i.name: i.shape for instrs in computations.values() for i in instrs}
    once = {name: [_without_trip_count(i) for i in instrs] for name, instrs in computations.items()}
    per_step = _sum_dot_flops(computations, entry, shapes)
    return per_step, _sum_dot_flops(once, entry, shapes)


def _without_trip_count(instr):
    if instr.opcode != "while":
        return instr
    return dataclasses.replace(instr, text=re.sub(r'"known_trip_count":\{"n":"\d+"\}',
                                                  '"known_trip_count":{"n":"1"}', instr.text))


def _sum_dot_flops(computations, entry: str, shapes: dict[str, str]) -> float:
    total = 0.0
    for instr, times, _ in hlo._executed_instructions(computations, entry):  # noqa: SLF001
        if instr.opcode == "dot" and times:
            total += times * _one_dot_flops(instr, shapes)
    return total


def _one_dot_flops(instr, shapes: dict[str, str]) -> float:
    lhs = _operands(instr.text)[0]
    lhs_dims = _dims(shapes[lhs])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.text)
    contracted = math.prod(lhs_dims[int(d)] for d in contracting[1].split(",") if d) if contracting else 1
    return 2.0 * math.prod(_dims(instr.shape)) * contracted


def _dims(shape: str) -> list[int]:
    match = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    return [int(d.strip().removeprefix("<=")) for d in match[1].split(",") if d.strip()] if match else []


def _operands(text: str) -> list[str]:
    """Names of an instruction's operands (``text`` starts with ``opcode(``)."""
    start = text.index("(")
    return re.findall(r"%([\w.\-]+)", text[start:hlo._closing(text, start)])  # noqa: SLF001


# ----------------------------------------------------------------------------------------------
# All-reduces that are reduce-scatters in disguise (XLA:CPU forms no reduce-scatter)
# ----------------------------------------------------------------------------------------------

_PASS_THROUGH = frozenset({"bitcast", "copy", "reshape", "convert"})  # keep every element, in order


def scatter_like_all_reduces(hlo_text: str, axis_names: Sequence[str], device_ids) -> list[hlo.Collective]:
    """The all-reduces whose every result is only ever dynamic-sliced to 1/n (n = group size):
    what GPU/TPU XLA turns into reduce-scatters. ``bytes`` counts those results, per step."""
    computations, entry = hlo._parse_module(hlo_text)  # noqa: SLF001
    users = _users(computations)
    mesh = hlo._MeshIndex.build(axis_names, device_ids)  # noqa: SLF001
    merged: dict[tuple, list] = {}
    for instr, times, _ in hlo._executed_instructions(computations, entry):  # noqa: SLF001
        if instr.opcode != "all-reduce" or not times:
            continue
        axes, n = hlo._communicator(instr, mesh)  # noqa: SLF001
        if not axes or axes == hlo.UNMATCHED_AXES:
            continue
        sliced = sum(hlo._shape_bytes(shape) for name, shape in _results(instr, users)  # noqa: SLF001
                     if _only_sliced(name, _elements(shape), n, users, computations))
        if sliced:
            entry_ = merged.setdefault((axes, hlo.phase_of(hlo._op_name(instr))), [0, 0, 0.0])  # noqa: SLF001
            entry_[0] += times
            entry_[1] += times * sliced
            entry_[2] += times * sliced * 2 * (n - 1) / n
    return [hlo.Collective("all-reduce", axes, c, b, w, phase) for (axes, phase), (c, b, w) in merged.items()]


def _users(computations) -> dict[str, list[tuple]]:
    """Instruction name -> [(user instruction, operand position), ...] (names are module-unique)."""
    out: dict[str, list[tuple]] = {}
    for instrs in computations.values():
        for instr in instrs:
            if "(" not in instr.text:
                continue
            for pos, name in enumerate(_operands(instr.text)):
                out.setdefault(name, []).append((instr, pos))
    return out


def _results(instr, users) -> list[tuple[str, str]]:
    """(name, shape) of each array an all-reduce produces: itself, or its get-tuple-elements."""
    if not instr.shape.startswith("("):
        return [(instr.name, instr.shape)]
    return [(u.name, u.shape) for u, _ in users.get(instr.name, []) if u.opcode == "get-tuple-element"]


def _elements(shape: str) -> int:
    return math.prod(_dims(shape))


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
