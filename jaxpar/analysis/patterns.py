"""Two readings of compiled HLO besides the collective tally (jaxpar.analysis.tally), used by `jaxpar comm`.

``dot_flops``
    FLOPs of every ``dot`` and ``convolution`` per step, loop trip counts included, and as XLA's cost
    analysis counts them (each loop body once).
``scatter_like_all_reduces``
    All-reduces whose every result is only dynamic-sliced to this device's 1/n afterwards: the
    reduce-scatters that XLA:CPU does not form (it has no ReduceScatterCreator pass).

Both walk the module with jaxpar.analysis.hlo_text's reader: ``parse_module`` and ``executed_instructions``
(the call graph, trip counts applied), and the second reads the all-reduces off the tally's ``collective_ops``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

from jaxpar.analysis.hlo_text import Module, executed_instructions, parse_module, shape_bytes
from jaxpar.analysis.tally import collective_ops
from jaxpar.collectives import UNMATCHED_AXES, Collective, wire_factor


def dot_flops(hlo_text: str) -> tuple[float, float]:
    """FLOPs of every ``dot`` and ``convolution`` per step (trip counts included) and as counted with each
    loop body run once (XLA's cost analysis view). XLA:TPU writes most dots as convolutions."""
    module = parse_module(hlo_text)
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    return _sum_dot_flops(module, shapes, True), _sum_dot_flops(module, shapes, False)


def _sum_dot_flops(module: Module, shapes: dict[str, str], loops: bool) -> float:
    total = 0.0
    for instr, times, _ in executed_instructions(module, loops):
        if instr.opcode == "dot" and times:
            total += times * one_dot_flops(instr, shapes)
        elif instr.opcode == "convolution" and times:
            total += times * convolution_flops(instr, shapes)
    return total


def one_dot_flops(instr, shapes: dict[str, str]) -> float:
    """2 x result elements x contracted elements."""
    lhs = instr.operands[0]
    lhs_dims = dims(shapes[lhs])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.text)
    contracted = math.prod(lhs_dims[int(d)] for d in contracting[1].split(",") if d) if contracting else 1
    return 2.0 * math.prod(dims(instr.shape)) * contracted


def convolution_flops(instr, shapes: dict[str, str]) -> float:
    """2 x multiply-adds of a convolution as XLA's HloCostAnalysis counts them: input features per group x
    output features x batch per group x, per spatial dimension, the (output, kernel) position pairs that
    land on an input element (padding, stride and base dilation applied)."""
    lhs, out = dims(shapes[instr.operands[0]]), dims(instr.shape)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.text)
    lhs_labels, out_labels = labels[1], labels[3]
    window = re.search(r"window=\{([^}]*)\}", instr.text)
    fields = dict(f.split("=", 1) for f in window[1].split()) if window else {}
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    per_dim = {k: v.split("x") for k, v in fields.items()}
    positions = 1
    for n, d in enumerate(spatial):
        get = lambda key, default: per_dim[key][n] if key in per_dim else default  # noqa: E731
        low = int(get("pad", "0_0").split("_")[0])
        positions *= _valid_positions(int(get("size", "1")), out[out_labels.index(d)], lhs[lhs_labels.index(d)],
                                      int(get("stride", "1")), low, int(get("rhs_dilate", "1")), int(get("lhs_dilate", "1")))
    groups = re.search(r"feature_group_count=(\d+)", instr.text)
    batch_groups = re.search(r"batch_group_count=(\d+)", instr.text)
    features = lhs[lhs_labels.index("f")] // (int(groups[1]) if groups else 1)
    batch = lhs[lhs_labels.index("b")] // (int(batch_groups[1]) if batch_groups else 1)
    return 2.0 * features * out[out_labels.index("f")] * batch * positions


def _valid_positions(kernel: int, outputs: int, inputs: int, stride: int, pad_low: int, dilation: int,
                     base_dilation: int) -> int:
    """The (output, kernel) index pairs of one spatial dimension whose input index is a real element."""
    count = 0
    for k in range(kernel):
        first = k * dilation - pad_low                      # the dilated input index of output 0
        if base_dilation == 1:                              # 0 <= o * stride + first < inputs
            lo, hi = max(0, -(first // stride)), min(outputs - 1, (inputs - 1 - first) // stride)
            count += max(0, hi - lo + 1)
        else:
            count += sum(1 for o in range(outputs) if (u := o * stride + first) % base_dilation == 0
                         and 0 <= u // base_dilation < inputs)
    return count


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
