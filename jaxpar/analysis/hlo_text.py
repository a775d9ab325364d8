"""Read the text of a compiled HLO module: its computations and instructions, the call graph with
loop trip counts, and the byte sizes of shapes.

The input is the optimized, SPMD-partitioned, per-device HLO module that
``jax.jit(f).lower(...).compile().as_text()`` prints. jaxpar.analysis.tally tallies its collectives
and jaxpar.analysis.patterns reads dot FLOPs and disguised reduce-scatters off it, both through this
reader.

HLO text handled ([seen]: in jax 0.12 CPU output; [XLA]: only in XLA's source and tests)
------------------------------------------------------------------------------------------
Module
    ``HloModule ...`` header, then computations ``[ENTRY] %name (params) -> shape {`` ... ``}``
    [seen]; ``%`` and the signature may be left out, as in hand-written HLO. One instruction
    per line: ``[ROOT] %name = SHAPE opcode(operands), attr=value, ...``. Other top-level
    sections (``FileNames``, ``StackFrames``, ...) are skipped [seen].
Shapes
    ``f32[4,8]{1,0}`` (layout ignored), scalars ``f32[]``, tuples ``(f32[4], f32[4])`` with
    XLA's ``/*index=5*/`` comments [seen]; nested tuples and dynamic dims ``f32[<=8]`` [XLA].
    Element sizes for pred, s/u 1..64, f16, bf16, f32, f64, c64, c128, f8* and f4e2m1fn;
    sub-byte arrays round up to whole bytes. ``result_shape`` finds the buffers a collective
    produces in its sync and async-start forms (the tally's "Collectives" lists them).
Loops and calls
    The call graph is walked from ENTRY through ``calls=``, ``to_apply=``, ``body=``,
    ``condition=``, ``branch_computations={...}``, ``true_computation=``,
    ``false_computation=`` and ``called_computations={...}``. A ``while`` with
    ``backend_config={..."known_trip_count":{"n":"80"}...}`` [seen] runs its body n times and its
    condition n+1 times; nested loops multiply and a computation reached along several paths
    sums them. ``async-update`` / ``async-done`` run nothing (their ``async-start`` ran the wrapped
    computation). Two cases come with a note on why the count may be inexact: a ``while``
    without a known trip count (body counted once) and a ``conditional`` (every branch counted once).

API
    ``parse_module`` (a ``Module``: ``Instruction``s by computation, and the ENTRY's name),
    ``executed_instructions`` (each reachable instruction with its runs per step and those notes),
    ``shape_bytes``, ``tuple_elements``, ``is_scalar``, ``result_shape`` and ``closing_bracket``.
"""

from __future__ import annotations

import dataclasses
import graphlib
import math
import re
from collections.abc import Iterator
from typing import NamedTuple

# ----------------------------------------------------------------------------------------------
# Reading the module text
# ----------------------------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.+)$")
_OPCODE = re.compile(r"([\w\-]+)\(")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``name = shape text``."""

    name: str
    shape: str  # the result shape, e.g. "f32[4,8]{1,0}" or "(f32[4], s32[])"
    opcode: str
    text: str  # everything after the shape: opcode, operands, attributes

    @property
    def operands(self) -> list[str]:
        """Names of the operands (what ``opcode(...)`` lists)."""
        if "(" not in self.text:
            return []
        start = self.text.index("(")
        return re.findall(r"%([\w.\-]+)", self.text[start:closing_bracket(self.text, start)])

    @property
    def op_name(self) -> str | None:
        """The ``metadata={op_name="..."}`` jax gave the op, if any."""
        match = re.search(r'\bop_name="((?:[^"\\]|\\.)*)"', self.text)
        return match[1] if match else None


class Module(NamedTuple):
    """A parsed HLO module."""

    computations: dict[str, list[Instruction]]  # each computation's instructions, by name
    entry: str  # the name of the ENTRY computation


def parse_module(hlo_text: str) -> Module:
    """The instructions of each computation, by name, and the name of the ENTRY computation."""
    computations: dict[str, list[Instruction]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = header["name"]
                computations[current] = []
                entry = current if header["entry"] else entry
        elif line.lstrip().startswith("}"):
            current = None
        elif match := _INSTRUCTION.match(line):
            computations[current].append(_parse_instruction(match["name"], match["rest"]))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)


def _parse_instruction(name: str, rest: str) -> Instruction:
    if rest.startswith("("):
        end = closing_bracket(rest, 0) + 1
        shape, text = rest[:end], rest[end:].lstrip()
    else:
        shape, _, text = rest.partition(" ")
    opcode = _OPCODE.match(text)
    return Instruction(name, shape, opcode[1] if opcode else "", text)


def closing_bracket(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]`` (any of ``([{``, nested)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 80]!r}")


# ----------------------------------------------------------------------------------------------
# Call graph: how many times each computation runs per execution of ENTRY
# ----------------------------------------------------------------------------------------------

_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCH_ATTRS = ("true_computation", "false_computation", "branch_computations")


class _Call(NamedTuple):
    callee: str
    times: int  # runs of the callee per run of the calling instruction
    note: str | None  # why ``times`` may be inexact


def _calls(instr: Instruction, module: Module | None = None, loops: bool = True) -> list[_Call]:
    """The computations an instruction runs, with how often (`loops` False: each loop body once)."""
    if instr.opcode in ("async-update", "async-done"):
        return []  # the matching async-start already ran the wrapped computation
    trip = None if loops else 1
    if instr.opcode == "while" and loops:
        trip = _trip_count(instr)
        trip = _counted_loop_trips(instr, module) if trip is None and module else trip
    calls = []
    for attr, value in _CALLED.findall(instr.text):
        times, note = 1, None
        if attr in ("body", "condition") and trip is None:
            note = f"while %{instr.name} has no known_trip_count: its body is counted once"
        elif attr == "body":
            times = trip
        elif attr == "condition":
            times = trip + 1
        elif attr in _BRANCH_ATTRS:
            note = f"conditional %{instr.name}: each branch is counted as taken"
        calls.extend(_Call(callee, times, note) for callee in re.findall(r"%?([\w.\-]+)", value))
    return calls


def _trip_count(instr: Instruction) -> int | None:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.text)
    return int(match[1]) if match else None


_INT_CONSTANT = re.compile(r"^constant\((-?\d+)\)")


def _counted_loop_trips(loop: Instruction, module: Module) -> int | None:
    """The trip count of a counted loop that carries no ``known_trip_count`` (XLA:TPU keeps it elsewhere):
    condition ``ROOT compare(get-tuple-element(p, index=k), constant(N)), direction=LT``, body element k
    ``add(get-tuple-element(p, index=k), constant(s))`` with s > 0, initial element k a constant (through
    copies): ceil((N - start) / s) trips.
    None when the loop is not of that form."""
    comps = module.computations
    cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.text)
    body = re.search(r"\bbody=%?([\w.\-]+)", loop.text)
    if not (cond and body and cond[1] in comps and body[1] in comps) or "direction=LT" not in comps[cond[1]][-1].text:
        return None
    cond_by, body_by = ({i.name: i for i in comps[c]} for c in (cond[1], body[1]))
    index, limit = (cond_by.get(o) for o in comps[cond[1]][-1].operands[:2])
    k = _tuple_index(index)
    bound = _constant(limit, cond_by)
    body_root = comps[body[1]][-1]
    if k is None or bound is None or body_root.opcode != "tuple" or len(body_root.operands) <= k:
        return None
    add = body_by.get(body_root.operands[k])
    steps = [_constant(body_by.get(o), body_by) for o in add.operands] if add is not None and add.opcode == "add" else []
    step = next((c for c in steps if c is not None and c > 0), None)
    if step is None:
        return None
    caller = next((c for c in comps.values() if loop in c), [])
    by_name = {i.name: i for i in caller}
    init = by_name.get(loop.operands[0]) if loop.operands else None
    start = _constant(by_name.get(init.operands[k]), by_name) if init and init.opcode == "tuple" else None
    return None if start is None else max(-(-(bound - start) // step), 0)


def _tuple_index(instr: Instruction | None) -> int | None:
    match = instr and instr.opcode == "get-tuple-element" and re.search(r"\bindex=(\d+)", instr.text)
    return int(match[1]) if match else None


def _constant(instr: Instruction | None, by_name: dict) -> int | None:
    """The integer a constant holds, seen through copies and bitcasts."""
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert"):
        instr = by_name.get(instr.operands[0]) if instr.operands else None
    match = instr is not None and _INT_CONSTANT.match(instr.text)
    return int(match[1]) if match else None


def executed_instructions(module: Module, loops: bool = True) -> Iterator[tuple[Instruction, int, set[str]]]:
    """Each instruction reachable from ENTRY, with its runs per step (loop trip counts applied; `loops` False:
    each loop body run once, as XLA's cost analysis counts) and notes on why that count may be inexact."""
    computations, entry = module
    calls = {name: [c for instr in instrs for c in _calls(instr, module, loops)] for name, instrs in computations.items()}
    callers: dict[str, set[str]] = {entry: set()}
    pending = [entry]
    while pending:
        caller = pending.pop()
        for call in calls[caller]:
            if call.callee not in computations:
                raise ValueError(f"%{caller} calls undefined computation %{call.callee}")
            if call.callee not in callers:
                callers[call.callee] = set()
                pending.append(call.callee)
            callers[call.callee].add(caller)
    times = dict.fromkeys(callers, 0) | {entry: 1}
    notes: dict[str, set[str]] = {name: set() for name in callers}
    for name in graphlib.TopologicalSorter(callers).static_order():  # callers before callees
        for call in calls[name]:
            times[call.callee] += times[name] * call.times
            notes[call.callee] |= notes[name] | ({call.note} if call.note else set())
        for instr in computations[name]:
            yield instr, times[name], notes[name]


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_ELEMENT_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "token": 0,
}  # fmt: skip


def result_shape(instr: Instruction) -> str:
    """The shape of the buffers a collective produces, for sync and async-start forms."""
    if not instr.opcode.endswith("-start"):
        return instr.shape
    elements = tuple_elements(instr.shape)
    if instr.opcode == "all-reduce-start" and not elements[0].startswith("("):
        return instr.shape  # native all-reduce-start: its shape is the result
    return elements[1]  # (operands, results, [contexts...])


def tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape; a non-tuple shape is its own only element."""
    shape = _INDEX_COMMENT.sub("", shape)
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        depth += (char in "([{") - (char in ")]}")
        if (char == "," and depth == 1) or depth == 0:
            elements.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [e for e in elements if e]


def shape_bytes(shape: str) -> int:
    """Bytes of all arrays in a (possibly tuple) shape (sub-byte arrays round up to whole bytes)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        elements = math.prod(int(d.strip().removeprefix("<=")) for d in dims.split(",") if d.strip())
        total += -(-_element_bits(dtype) * elements // 8)
    return total


def is_scalar(shape: str) -> bool:
    """Whether a shape is one rank-0 array, such as ``f32[]``."""
    match = _ARRAY.match(shape.strip())
    return bool(match) and not match[2].strip()


def _element_bits(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 8
    if dtype not in _ELEMENT_BITS:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return _ELEMENT_BITS[dtype]
