"""What XLA makes of the textbook's collectives beyond an op's kind and bytes (those compiler.lower
applies): its SPMD partitioner's sums of the norm weights under ZeRO-3, a backend that leaves the gradient
sums in the layer loop (`Compiler.hoist` False: XLA:CPU) and how its combiner groups them there, and the
MoE dispatch form a backend runs. Checked on XLA:CPU, whose compiled steps the tests compare with
(tests/test_cost_vs_hlo.py, tests/test_verify_scale.py). Sites as jaxpar/cost/sites.py records them.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import AG, AR, RS
from jaxpar.cost import sites
from jaxpar.cost.comm_data import embedding_lookup, fsdp_gathers, gradient_sums, shard_axes
from jaxpar.cost.compiler import Compiler, lower, reductions, together
from jaxpar.cost.held import Held, data_axes, equal_buffers, head_and_norm, held, unit_norms
from jaxpar.cost.memory import GRAD_BYTES, grad_bytes
from jaxpar.cost.params import per_model
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def dispatch_form(st: Strategy, cc: Compiler, padded: bool = True) -> str:
    """How MoE token copies travel under expert parallelism (comm_expert.dispatch_bytes): padded (static
    buffers: a stack that pads, `Software.moe_padded`, under moe_kernel = padded), else the grouped kernel's
    ragged all-to-all, or bucketed where the backend has none (Compiler.ragged_all_to_all)."""
    if padded and st.options.moe_kernel == "padded":
        return "padded"
    return "ragged" if cc.ragged_all_to_all else "bucketed"


@per_model
def norms_held(m: ModelConfig) -> Held:
    """The norm weights: each run's unit's pre-norms (their only dim is `embed`) and the final norm."""
    runs = unit_norms(m)
    return Held.of(runs, sum(unit * n for (unit, _), n in zip(runs, m.run_units)), float(m.d_model), 1)


def without_norms(sharded: Held, norms: Held) -> Held:
    runs = tuple((u - v, a - b) for (u, a), (v, b) in zip(sharded.runs, norms.runs))
    return Held.of(runs, sharded.layers - norms.layers, sharded.emb - norms.emb, sharded.emb_arrays - norms.emb_arrays)


def norms_whole(st: Strategy, shape: StepShape, rest: tuple[str, ...]) -> bool:
    """Whether the partitioner sums the norm weights' gradients whole (`norms_summed_whole`): ZeRO-3 with the
    batch over fsdp and other data axes (`rest`), outside a pipeline."""
    return st.zero == 3 and bool(rest) and shape.stages == 1


def norms_summed_whole(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape) -> list[tuple]:
    """comm_data's sites as XLA's SPMD partitioner issues them for the norm weights (a sum over the tokens, a
    reduce with no dot) under ZeRO-3 with the batch over fsdp and other data axes: the whole vector
    all-reduced over every batch axis at once, its fsdp shard sliced out afterwards, where a matrix's
    gradient is reduce-scattered over fsdp and its shard all-reduced over the rest. So the unit's norms
    leave the layer loop's reduce-scatter and the shard sums, and the final norm its reduce-scatter, for
    one all-reduce per step over all the data axes (over fsdp alone the two forms are the same op).
    Checked on XLA:CPU: the catalogue's dp2-fsdp2-tp2, fsdp2-ep4, llama-tiny data=2,fsdp=4 and data=4,fsdp=2."""
    if st.zero != 3 or shape.stages > 1:
        return ops
    axes = data_axes(st)
    if not norms_whole(st, shape, tuple(a for a in axes if a not in shard_axes(st))):
        return ops
    norms, gb, out = norms_held(m), grad_bytes(st), []
    run_norms = iter(norms.runs)   # comm_data issues one unit scatter per run, in order
    for kind, group, execs, n, total, phase, role in ops:
        if role == sites.UNIT_SCATTER:
            unit, arrays = next(run_norms)
            n, total, role = n - arrays, total - unit * gb, sites.WEIGHTS
        elif role == sites.FINAL_NORM:
            out += gradient_sums(axes, norms, 1, gb)
            continue
        elif type(role) is tuple and role[0] == sites.SHARDED:
            n, total = n - norms.arrays, total - norms.full * gb / st.sizes["fsdp"]
        if n:
            out.append((kind, group, execs, n, total, phase, role))
    return out


# ---- the gradient sums in the layer loop (Compiler.hoist False) ---------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
    """The step a data-parallel part is summed in: the compiler, the layout, the step's shape, the bytes per
    element of the activations and of ZeRO-1's parameter gather. Each run of the model is a layer loop of
    its own, of `shape.run_execs` unit executions per step."""
    cc: Compiler
    st: Strategy
    shape: StepShape
    act: int
    gather_bytes: int

    @property
    def after_layers(self) -> int:
        """How often per step the sums after the layer loop (embedding, head, final norm) are issued: once
        per micro-batch. The accumulation loop's carry is the gradient in the parameters' layout, so each
        micro-batch's partial sums are summed inside it, as the layers' are (XLA:CPU: llama-tiny under
        data=8 and data=4 x tensor=2, ZeRO-0 and 1, 4 micro-batches). A pipeline's schedule: once."""
        return self.shape.accum if self.shape.stages == 1 else 1


def data_parallel_in_loop(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                          gather_bytes: int) -> list[tuple]:
    """comm_data.data_parallel as a backend that leaves the gradient sums in the layer loop issues it: per
    unit execution the unit's gradients, their ZeRO shards' reduce-scatters and their replicated weights'
    all-reduces combined per group, and the embedding's, head's and final norm's after the loop, per
    micro-batch (`Loop.after_layers`); without AllReduceFolder the batch axes and `context` apart (`reductions`). MoE under expert > 1: the experts' sums
    over fsdp join the dense weights' op (`one_loop`)."""
    axes = data_axes(st)
    loop = Loop(cc, st, shape, act, gather_bytes)
    if m.moe_layers and st.sizes["expert"] > 1:
        experts = tuple(a for a in axes if a != "expert")
        return one_loop(loop, lower(cc, _in_loop(m, loop, axes, False), st),
                        lower(cc, _in_loop(m, loop, experts, True), st))
    return _in_loop(m, loop, axes, None)


def one_loop(loop: Loop, dense: list[tuple], experts: list[tuple]) -> list[tuple]:
    """`dense` and `experts` sites (lowered), the experts' in-loop sums over fsdp (the partitioner's
    reduce-scatters of the weights it gathered for the expert kernel) in the dense weights' op: the
    combiner makes one op of a layer's sums over fsdp (XLA:CPU: the catalogue's fsdp2-ep4 on moe-tiny). The
    kernel's own sums over the other data axes (shard_map's, at its transpose) stay apart."""
    cc, st = loop.cc, loop.st
    if not (cc.combine and st.zero == 3 and st.sizes["fsdp"] > 1):
        return dense + experts
    keys = {(AR, ("fsdp",), execs) for execs in loop.shape.run_execs}
    dense, out = list(dense), []
    for op in experts:
        i = next((i for i, d in enumerate(dense) if op[:3] == d[:3] and op[:3] in keys and d[5] == op[5]), None)
        if i is None:
            out.append(op)
        else:
            dense[i] = (*dense[i][:4], dense[i][4] + op[4], *dense[i][5:])
    return dense + out


def _groups(cc: Compiler, over: tuple[str, ...], experts: bool | None) -> list[tuple[str, ...]]:
    """The groups the gradients of the weights `experts` selects are summed over: shard_map sums the routed
    experts' over every axis they are replicated on at once; the others' as `reductions` says."""
    return [over] if experts and over else reductions(cc, over)


def loop_sums(group: tuple[str, ...], h: Held, shards: int, loop: Loop, role: str = "") -> list[tuple]:
    """All-reduces of the gradients of the weights `h` (/ `shards`) over `group`: a unit's in each run's layer
    loop, and embedding + head + final norm's after them."""
    gb, out = grad_bytes(loop.st), []
    for execs, (unit, arrays) in zip(loop.shape.run_execs, h.runs):
        out += sites.issue(AR, group, execs, equal_buffers(unit * gb / shards, arrays), "backward", role)
    return out + sites.issue(AR, group, loop.after_layers, equal_buffers(h.emb * gb / shards, h.emb_arrays), "backward",
                             role)


def _in_loop(m: ModelConfig, loop: Loop, axes: tuple[str, ...], experts: bool | None) -> list[tuple]:
    """`data_parallel_in_loop` for the weights `experts` selects, summed over `axes`."""
    if shard_axes(loop.st):
        return _sharded_in_loop(m, loop, axes, experts)
    role = sites.LOOP_SUMS if experts is not True else ""
    h = held(m, loop.st, experts=experts)
    return [op for group in _groups(loop.cc, axes, experts) for op in loop_sums(group, h, 1, loop, role)]


def _sharded_in_loop(m: ModelConfig, loop: Loop, axes: tuple[str, ...], experts: bool | None) -> list[tuple]:
    """ZeRO-1 and ZeRO-3 with the sums in the loop: per unit execution (a pipeline: per accumulation step,
    the stage's v*k unit slots) the shards reduce-scattered, with the replicated weights' (and, as
    `norms_summed_whole` says, the norms') all-reduces, combined (`together`); the head's and final norm's
    scatters after the loop; under `tensor` the head's shard summed over the other data axes on its own."""
    cc, st, shape, act, gb = loop.cc, loop.st, loop.shape, loop.act, grad_bytes(loop.st)
    dense, shard, zero = experts is not True, shard_axes(st), st.zero
    part, kept = held(m, st, "zero", experts), held(m, st, "kept", experts)
    rest = tuple(a for a in axes if a not in shard)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    vectors = dense and norms_whole(st, shape, rest)
    norms = norms_held(m)
    part = without_norms(part, norms) if vectors else part
    out = (hoisted(fsdp_gathers(m, st, shape, act), shape) + embedding_lookup(m, st, shape, act, shard)
           if zero == 3 and dense else [])
    if shape.stages > 1:   # the stage's v*k unit slots, every run's, reduced once per accumulation step
        out += lower(cc, sites.issue(RS, shard, shape.accum, equal_buffers(part.slots(shape) * gb, part.stack_arrays),
                                     "backward", sites.WEIGHTS), st)
    for j, execs in enumerate(shape.run_execs):   # each run's layer loop
        in_loop = [] if shape.stages > 1 else sites.issue(RS, shard, execs, equal_buffers(part.runs[j][0] * gb,
                                                                                          part.runs[j][1]),
                                                          "backward", sites.WEIGHTS)
        for group in _groups(cc, axes, experts):
            in_loop += sites.issue(AR, group, execs, equal_buffers(norms.runs[j][0] * gb, norms.runs[j][1])
                                   if vectors else [], "backward")
        for group in _groups(cc, axes, experts):
            in_loop += sites.issue(AR, group, execs, equal_buffers(kept.runs[j][0] * gb, kept.runs[j][1]), "backward")
        out += together(cc, lower(cc, in_loop, st))
    per = loop.after_layers
    after = (sites.issue(RS, shard, per, [head * gb] if head and dense else [], "optimizer")
             + sites.issue(RS, shard, per, [norm * gb] if dense and not vectors else [], "optimizer", sites.FINAL_NORM))
    out += together(cc, lower(cc, after, st)) if per > 1 else after   # in the accumulation loop: combined
    for group in _groups(cc, axes, experts) if vectors else ():
        out += sites.issue(AR, group, per, [norm * gb], "backward")
    if zero == 1:
        out += embedding_lookup(m, st, shape, act, shard) if dense else []
        out += sites.issue(AG, shard, 1, equal_buffers(part.full * loop.gather_bytes, part.arrays), "optimizer",
                           sites.step(loop.gather_bytes))
    for group in _groups(cc, axes, experts):
        out += sites.issue(AR, group, per, equal_buffers(kept.emb * gb, kept.emb_arrays), "backward")
    apart = head if vectors and st.sizes["tensor"] > 1 else 0.0   # the head's shard on its own (XLA:CPU's grouping)
    if apart:
        part = part._replace(emb=part.emb - head, emb_arrays=part.emb_arrays - 1)
    shards = st.sizes["fsdp"] if zero == 3 else 1
    for group in _groups(cc, rest, experts):
        out += loop_sums(group, part, shards, loop, sites.LOOP_SHARDED if dense else "")
        out += sites.issue(AR, group, per, [apart * gb / st.sizes["fsdp"]] if apart else [], "backward")
    return out


def hoisted(ops: list[tuple], shape: StepShape) -> list[tuple]:
    """`ops` with the head's and final norm's FSDP gather (sites.HEAD_GATHER) once per step outside a pipeline:
    it reads parameters no micro-batch changes, and XLA's while-loop invariant code motion hoists it out of the
    accumulation loop (XLA:CPU: llama-tiny data=2 x fsdp=4, 2 micro-batches; the layers' gathers sit in the
    layer loop, whose index they read, and stay)."""
    if shape.stages > 1:
        return ops
    return [(op[0], op[1], 1, *op[3:]) if op[6] == sites.HEAD_GATHER else op for op in ops]


def sp_norms_in_loop(cc: Compiler, m: ModelConfig, shape: StepShape, final: bool = True) -> list[tuple]:
    """comm_tensor.sp_norms where the sums stay in the layer loop: per layer execution each block's norm
    gradients (an attention or MoE block's two, a Mamba-2 block's one), and the final norm's after the loop,
    per micro-batch (with the combiner, together with the label-logit sum of the head's tokens: a pipeline
    stage's head micro-batches'; `final` False: the final norm's sum is elsewhere, 1F1B's per tick)."""
    ax, d = ("tensor",), m.d_model
    tokens = shape.b_loc / shape.accum * shape.s_loc
    if shape.stages > 1:
        tokens = shape.head_micro * shape.mb * shape.s_loc
    out = sites.issue(AR, ax, shape.exec_attention + shape.exec_moe, [d * GRAD_BYTES] * 2, "backward")
    out += sites.issue(AR, ax, shape.exec_mamba, [d * GRAD_BYTES], "backward")
    last = [d * GRAD_BYTES] + ([tokens * 4] if cc.combine else [])
    per = shape.accum if shape.stages == 1 else 1   # per micro-batch, as compiler_comm.Loop.after_layers
    return out + (sites.issue(AR, ax, per, last, "optimizer") if final else [])


def norms_in_loop(ops: list[tuple], cc: Compiler, m: ModelConfig, shape: StepShape) -> list[tuple]:
    """`ops` with the norms' sums under sequence parallelism as a backend that leaves them in the layer loop
    issues them (`sp_norms_in_loop`)."""
    out = []
    for op in ops:
        if op[6] in (sites.SP_NORMS, sites.SP_LAYER_NORMS):
            out += sp_norms_in_loop(cc, m, shape, final=op[6] == sites.SP_NORMS)
        else:
            out.append(op)
    return out
