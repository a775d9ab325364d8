"""Tally the collectives in compiled HLO: kind x mesh axes x bytes x phase, loop trip counts included.

The module is read with jaxpar.analysis.hlo_text (instructions, call graph with loop trip counts, shape
sizes). Every collective instance (plain, combined, asynchronous start/done pairs counted once, XLA:TPU's
fusions as jaxpar.analysis.fused reads them) is sized from its shape, mapped back to the mesh axes its
device groups span (explicit, iota and mesh-axis replica groups; sub-axes in Shardy's notation; groups that
are no product of axes reported as ("?",)), multiplied by how often its computation runs, labelled with a
training phase (its op_name: the optimizer scope, `transpose(` for backward, else forward) and merged into
jaxpar.collectives' ``Collective`` records. Bytes: the result buffer (reduce-scatter: times the group size,
the pre-scatter buffer); ``wire_bytes`` the ring model's. Replica-group ids are partition ids: positions in
the executable's device assignment, not ``Device.id``. docs/analysis.md lists every form handled.

API: ``tally`` (and ``tally_compiled``), the merged collectives; ``collective_ops``, the same per
instruction; ``phase_of``, the phase of an op name.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from jaxpar.analysis.fused import fused_collectives
from jaxpar.analysis.hlo_text import (Instruction, Module, closing_bracket, executed_instructions, is_scalar,
                                      parse_module, result_shape, shape_bytes, tuple_elements)
from jaxpar.collectives import KINDS, OPTIMIZER_SCOPE, PHASES, UNMATCHED_AXES, Collective, wire_factor


class Tally(list):
    """A list of records (``tally``: merged ``Collective``s; ``collective_ops``: ``CollectiveOp``s),
    plus ``warnings``: why some counts may be inexact."""

    def __init__(self, collectives: Iterable[Collective] = (), warnings: Iterable[str] = ()):
        super().__init__(collectives)
        self.warnings = list(warnings)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the module, as the tally reads it (the per-op view of ``tally``)."""

    name: str  # the HLO instruction's name
    kind: str
    axes: tuple[str, ...]  # UNMATCHED_AXES if its device groups span no mesh axes
    group_size: int
    times: int  # executions per step (loop trip counts applied)
    bytes: int  # per execution: the full buffer ("Bytes" in the module docstring)
    scalar_bytes: int  # per execution, the part of ``bytes`` in rank-0 arrays (f32[]: a loss, a norm partial)
    phase: str
    done: str | None = None  # XLA:TPU's asynchronous fusions: the instruction completing it (``name`` starts it)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution (ring algorithm)."""
        return self.bytes * wire_factor(self.kind, self.group_size)


def collective_ops(
    hlo: str | Module,
    axis_names: Sequence[str],
    device_ids: np.ndarray,
    *,
    optimizer_scope: str = OPTIMIZER_SCOPE,
) -> Tally:
    """Every collective instruction that runs (``times > 0``) over more than one device, in module
    order, as a ``CollectiveOp``; ``warnings`` says why some may be inexact (``tally`` sums these).
    ``hlo``: the module text or ``parse_module``'s result; ``device_ids`` as for ``tally``."""
    mesh = _MeshIndex.build(axis_names, device_ids)
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    fused = fused_collectives(module)
    ops: list[CollectiveOp] = []
    warnings: list[str] = []
    for instr, times, notes in executed_instructions(module):
        if instr.opcode in _UNTALLIED_OPCODES:
            warnings.append(f"{instr.opcode} %{instr.name} is not tallied")
        kind = _KIND_OF_OPCODE.get(instr.opcode)
        reading = fused.get(instr.name)
        if kind is None or times == 0 or (reading is not None and not reading.counted):
            continue
        axes, n = _communicator(instr, mesh)
        if not axes:
            continue
        if axes == UNMATCHED_AXES:
            warnings.append(f"{instr.opcode} %{instr.name}: device groups match no mesh axes")
        warnings.extend(notes)
        result = result_shape(instr)
        scalars = sum(shape_bytes(e) for e in tuple_elements(result) if is_scalar(e))
        if reading is None:
            ops.append(CollectiveOp(instr.name, kind, axes, n, times, _buffer_bytes(instr, kind, n), scalars,
                                    phase_of(instr.op_name, optimizer_scope)))
        else:  # XLA:TPU's fused forms (jaxpar.analysis.fused); a fused reduce-scatter's all-reduce holds its buffer
            ops.append(CollectiveOp(reading.at, reading.kind, axes, n, times, shape_bytes(result), scalars,
                                    phase_of(reading.op_name, optimizer_scope), reading.done))
    return Tally(ops, dict.fromkeys(warnings))


def tally(
    hlo_text: str,
    axis_names: Sequence[str],
    device_ids: np.ndarray,
    *,
    optimizer_scope: str = OPTIMIZER_SCOPE,
) -> Tally:
    """Tally the collectives of an HLO module on a mesh: ``collective_ops`` merged by kind, axes
    and phase (counts and bytes summed over instructions and executions).

    ``device_ids`` has the mesh shape (axes in ``axis_names`` order) and holds the id the HLO
    uses for the device at each mesh position (see "Device ids" in the module docstring).
    """
    ops = collective_ops(hlo_text, axis_names, device_ids, optimizer_scope=optimizer_scope)
    merged: dict[tuple[str, tuple[str, ...], str], list] = {}
    for op in ops:
        totals_ = merged.setdefault((op.kind, op.axes, op.phase), [0, 0, 0.0])
        totals_[0] += op.times
        totals_[1] += op.times * op.bytes
        totals_[2] += op.times * op.wire_bytes
    collectives = [Collective(k, axes, c, b, w, phase) for (k, axes, phase), (c, b, w) in merged.items()]
    collectives.sort(key=lambda c: (KINDS.index(c.kind), PHASES.index(c.phase), c.axes))
    return Tally(collectives, ops.warnings)


def tally_compiled(compiled, mesh, *, optimizer_scope: str = OPTIMIZER_SCOPE) -> Tally:
    """Tally a ``jax.stages.Compiled`` whose shardings live on ``mesh`` (a Mesh or AbstractMesh)."""
    shape = tuple(mesh.shape.values())
    positions = np.arange(math.prod(shape)).reshape(shape)
    return tally(compiled.as_text(), mesh.axis_names, positions, optimizer_scope=optimizer_scope)


def phase_of(op_name: str | None, optimizer_scope: str = OPTIMIZER_SCOPE) -> str:
    """Training phase of an op from its metadata op_name (rules in the module docstring)."""
    if not op_name:
        return "other"
    if re.search(rf"\b{re.escape(optimizer_scope)}\b", op_name):
        return "optimizer"
    if "transpose(" in op_name:
        return "backward"
    return "forward"


# ----------------------------------------------------------------------------------------------
# Which instructions are collectives, and their buffers
# ----------------------------------------------------------------------------------------------

_KIND_OF_OPCODE = {kind: kind for kind in KINDS} | {f"{kind}-start": kind for kind in KINDS}
_UNTALLIED_OPCODES = frozenset({"send", "recv", "ragged-all-to-all", "collective-broadcast"})


def _buffer_bytes(instr: Instruction, kind: str, n: int) -> int:
    """Bytes of the full buffer one instance moves: reduced, gathered or pre-scatter."""
    result = shape_bytes(result_shape(instr))
    return result * n if kind == "reduce-scatter" else result


# ----------------------------------------------------------------------------------------------
# Device groups and the mesh axes they span
# ----------------------------------------------------------------------------------------------


class _Span(NamedTuple):
    """A (sub-)axis: coordinates ``0, stride, ..., (size-1)*stride`` of mesh axis ``axis``."""

    axis: int
    stride: int
    size: int


@dataclasses.dataclass(frozen=True)
class _MeshIndex:
    names: tuple[str, ...]
    ids: np.ndarray  # the HLO id at each mesh position
    coords: dict[int, tuple[int, ...]]  # HLO id -> mesh position

    @staticmethod
    def build(axis_names: Sequence[str], device_ids: np.ndarray) -> _MeshIndex:
        ids = np.asarray(device_ids)
        if ids.ndim != len(axis_names):
            raise ValueError(f"device_ids has {ids.ndim} dims but there are {len(axis_names)} axis names")
        coords = {int(ids[pos]): pos for pos in np.ndindex(ids.shape)}
        if len(coords) != ids.size:
            raise ValueError("device_ids holds a device more than once")
        return _MeshIndex(tuple(axis_names), ids, coords)

    def check(self, groups: list[list[int]]) -> None:
        for device in (d for g in groups for d in g if d not in self.coords):
            raise ValueError(f"device id {device} in the HLO is not in the mesh ({self.ids.size} devices)")


def _communicator(instr: Instruction, mesh: _MeshIndex) -> tuple[tuple[str, ...], int]:
    """The mesh axes an instance spans and its group size."""
    if instr.opcode.startswith("collective-permute"):
        return _permute_axes(_source_target_pairs(instr.text), mesh), 2
    groups = _replica_groups(instr.text, mesh)
    mesh.check(groups)
    axes = _axes_spanned(groups, mesh)
    return (UNMATCHED_AXES if axes is None else axes), len(groups[0])


def _replica_groups(text: str, mesh: _MeshIndex) -> list[list[int]]:
    """Device groups of a ``replica_groups=`` attribute in any of its syntaxes."""
    match = re.search(r"\breplica_groups=", text)
    spec = text[match.end():] if match else "{}"
    if spec.startswith("mesh["):
        return _mesh_axes_groups(spec)
    if spec.startswith("["):
        return _iota_ids(spec).tolist()
    groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", spec[1:closing_bracket(spec, 0)])]
    return groups or [mesh.ids.ravel().tolist()]


def _source_target_pairs(text: str) -> list[list[int]]:
    spec = text[re.search(r"\bsource_target_pairs=", text).end():]
    return [_ints(p) for p in re.findall(r"\{([^{}]*)\}", spec[1:closing_bracket(spec, 0)])]


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


_IOTA = re.compile(r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _iota_ids(spec: str) -> np.ndarray:
    """``[dims]<=[reshape]T(perm)``: iota over ``reshape``, transposed by ``perm``, shaped ``dims``."""
    match = _IOTA.match(spec)
    reshape = _ints(match["reshape"])
    perm = _ints(match["perm"]) if match["perm"] else list(range(len(reshape)))
    return np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(_ints(match["dims"]))


_MESH_AXES = re.compile(r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>.*?)\))?\s*\{(?P<refs>[^}]*)\}")


def _mesh_axes_groups(spec: str) -> list[list[int]]:
    """Groups of ``mesh['a'=2,'b'=4] {'b'}``: the devices that vary along the listed (sub-)axes."""
    match = _MESH_AXES.match(spec)
    axes = re.findall(r"'?([^',=\s]+)'?=(\d+)", match["axes"])
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    ids = _mesh_device_ids(match["ids"], sizes)
    spans = []
    for ref in filter(str.strip, match["refs"].split(",")):
        name, pre, size = re.fullmatch(r"\s*'?([^':\s]+)'?(?::\((\d+)\)(\d+))?\s*", ref).groups()
        axis = names.index(name)
        if size is None:
            spans.append(_Span(axis, 1, sizes[axis]))
        else:
            spans.append(_Span(axis, sizes[axis] // (int(pre) * int(size)), int(size)))
    return _groups_along(ids, spans)


def _mesh_device_ids(text: str | None, sizes: list[int]) -> np.ndarray:
    """Device ids of an HLO mesh: iota unless ``device_ids=(...)`` gives them (iota form or a list)."""
    if text is None:
        return np.arange(math.prod(sizes)).reshape(sizes)
    if "<=" in text:
        return _iota_ids(text).reshape(sizes)
    return np.array(_ints(re.sub(r"^\s*\[[\d,]*\]", "", text))).reshape(sizes)


def _groups_along(ids: np.ndarray, spans: Sequence[_Span]) -> list[list[int]]:
    """Partition the devices: same group iff equal coordinates once the spans are zeroed out."""
    coords = np.indices(ids.shape)
    for axis, stride, size in spans:
        coords[axis] -= (coords[axis] // stride % size) * stride
    groups: dict[int, list[int]] = {}
    keys = np.ravel_multi_index(tuple(coords), ids.shape).ravel()
    for key, device in zip(keys.tolist(), ids.ravel().tolist()):
        groups.setdefault(key, []).append(device)
    return list(groups.values())


def _axes_spanned(groups: list[list[int]], mesh: _MeshIndex) -> tuple[str, ...] | None:
    """Labels of the (sub-)axes the groups vary along, or None if they are no such product.

    The group holding the mesh origin shows, per axis, which coordinates a group covers; they
    must form ``0, stride, ..., (size-1)*stride``. The partition those spans induce must then
    equal the given groups.
    """
    origin = int(mesh.ids.flat[0])
    first = next((g for g in groups if origin in g), None)
    if first is None:
        return None
    positions = np.array([mesh.coords[d] for d in first])
    spans = []
    for axis, length in enumerate(mesh.ids.shape):
        values = np.unique(positions[:, axis])
        if len(values) == 1:
            continue
        span = _Span(axis, int(values[1]), len(values))
        evenly_spaced = np.array_equal(values, np.arange(span.size) * span.stride)
        if not evenly_spaced or length % (span.stride * span.size):
            return None
        spans.append(span)
    if {frozenset(g) for g in _groups_along(mesh.ids, spans)} != {frozenset(g) for g in groups}:
        return None
    return tuple(_span_label(span, mesh) for span in spans)


def _span_label(span: _Span, mesh: _MeshIndex) -> str:
    """``name`` for a whole axis, ``name:(pre)size`` for part of one (Shardy's notation)."""
    name, length = mesh.names[span.axis], mesh.ids.shape[span.axis]
    if span.size == length:
        return name
    return f"{name}:({length // (span.stride * span.size)}){span.size}"


def _permute_axes(pairs: list[list[int]], mesh: _MeshIndex) -> tuple[str, ...]:
    """The mesh axes along which some source and its target differ."""
    mesh.check(pairs)
    moved = {
        axis
        for source, target in pairs
        for axis, (a, b) in enumerate(zip(mesh.coords[source], mesh.coords[target]))
        if a != b
    }
    return tuple(mesh.names[axis] for axis in sorted(moved))
