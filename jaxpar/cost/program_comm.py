"""The gradient sums of jaxpar's own pipelines (jaxpar/pipeline/gpipe.py, one_f_one_b.py), where they depart
from comm_data's: a stage runs with one copy of its (gathered) weights per data (x fsdp) shard, so nothing is
summed over `data` inside the schedule's loop: each shard accumulates its stage's v*k unit slots, and the
copies are summed once per accumulation step after it (`stage_copies`; with the experts split over
`expert`, `moe_stage_copies`; over fsdp, `fsdp_stage_copies`). `data_parallel` applies them to comm_data's
sites, by role. How XLA:CPU's combiner groups those sums is stated per function with the layouts it was
checked on (tests/test_cost_vs_hlo.py, tests/test_verify_scale.py).
"""
from __future__ import annotations

from jaxpar.collectives import AG, AR, RS
from jaxpar.cost import sites
from jaxpar.cost.compiler import Compiler
from jaxpar.cost.held import Held, equal_buffers, head_and_norm, held, unit_norms
from jaxpar.cost.memory import GRAD_BYTES, PARAM_BYTES, grad_bytes
from jaxpar.cost.program_flops import one_f_one_b
from jaxpar.cost.shape import StepShape, chunk_layers
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig



DEPARTING = frozenset({sites.STAGE_WEIGHTS, sites.LOOKUP, sites.FINAL_NORM, sites.LOOP_SUMS, sites.LOOP_SHARDED})
"""The string roles `data_parallel` may change (the tuple roles it reads are the ZeRO shards' sums)."""


def shard_sums(role) -> bool:
    """Whether a site's `role` is the ZeRO shards' sums over the data axes beyond the shard group."""
    return role == sites.LOOP_SHARDED or (type(role) is tuple and role[0] == sites.SHARDED)


def data_parallel(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler,
                  act: int) -> list[tuple]:
    """comm_data's sites (or compiler_comm's in-loop ones) as jaxpar's program issues them: a pipeline
    stage's fsdp gathers move the stored float32 weights (its per-shard copies accumulate their gradients in
    float32 and cast them in the layers: the all-gather's operand is the float32 parameter in the HLO); its
    1F1B gathers the embedding table over fsdp before its loop (jaxpar/pipeline/one_f_one_b.py) in place of
    the sharded lookup; its pipelines' per-shard weight copies sum their gradients as `copies_grads` (ZeRO-3,
    `fsdp_stage_copies`) and, where the sums stay in the loop, as `replicated_sums`; a MoE model's under
    `moe_stage_copies` as `moe_copies_grads`. Routed experts split over `expert` keep comm_data's."""
    if shape.stages == 1:   # (every departure is a pipeline's)
        return ops
    if m.moe_layers and st.sizes["expert"] > 1:
        return moe_copies_grads(m, st, shape, cc) if moe_stage_copies(st, shape) and not cc.hoist else ops
    copies, table = fsdp_stage_copies(st, shape), one_f_one_b(st, shape) and st.zero == 3
    sums: dict[tuple, list[tuple] | None] = {}   # a group's sums in place of its sites (None: the sites stand)
    out = []
    for op in ops:
        kind, axes, execs, n, total, phase, role = op
        if type(role) is str and role not in DEPARTING:   # (the planner's hot path: most sites stand)
            out.append(op)
            continue
        if role == sites.STAGE_WEIGHTS:
            op = (kind, axes, execs, n, total * (PARAM_BYTES / act), phase, role)
        elif table and role == sites.LOOKUP:
            out += table_gathered(m, st, shape, act) if sites.LOOKUP not in sums else []
            sums[sites.LOOKUP] = None
            continue
        elif copies and role == sites.FINAL_NORM:
            continue
        elif (copies and shard_sums(role)) or role == sites.LOOP_SUMS:
            key = (role == sites.LOOP_SUMS, axes)
            if key not in sums:
                sums[key] = (replicated_sums(m, st, shape, cc, axes, held(m, st)) if key[0]
                             else copies_grads(m, st, shape, cc, axes))
                out += sums[key] or []
            if sums[key] is not None:
                continue
        out.append(op)
    return out


def table_gathered(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """jaxpar's 1F1B: the embedding table gathered over fsdp per accumulation step and its gradient
    scattered back (in place of comm_data.embedding_lookup)."""
    table = held(m, st, "zero").emb - sum(head_and_norm(m, st.sizes["tensor"]))
    return (sites.issue(AG, ("fsdp",), shape.accum, [table * act], "forward")
            + sites.issue(RS, ("fsdp",), shape.accum, [table * grad_bytes(st)], "backward"))


def replicated_sums(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...],
                    h: Held) -> list[tuple] | None:
    """The sums over `group` of weights replicated over it (ZeRO-0) in jaxpar's pipelines, where the loop's
    sums are left to the combiner (not hoisted): a group with `context` as `context_grads` (the copies are
    per batch shard: `context` sums stay in the loop), else under `stage_copies` as
    `replicated_copies_grads`; None where the textbook's hold."""
    if cc.hoist or shape.stages == 1:
        return None
    if "context" in group:
        return context_grads(m, st, shape, cc, group, h)
    return replicated_copies_grads(m, st, shape, cc, group, h) if stage_copies(st, shape) else None


def stage_copies(st: Strategy, shape: StepShape) -> bool:
    """jaxpar/pipeline/gpipe.py runs the stages with one copy of the (gathered) stage weights per data (x fsdp)
    shard, so that nothing is summed over `data` inside the schedule's loop (`data` > 1; under context
    parallelism the sums over `context` stay in the loop; with expert > 1 not modelled)."""
    sz = st.sizes
    return shape.stages > 1 and sz["data"] > 1 and sz["expert"] == 1


def moe_stage_copies(st: Strategy, shape: StepShape) -> bool:
    """`stage_copies` with the experts split over `expert` (ZeRO-0, no fsdp or context): `moe_copies_grads`."""
    sz = st.sizes
    return (shape.stages > 1 and sz["data"] > 1 and sz["expert"] > 1 and st.zero == 0 and sz["fsdp"] == 1
            and sz["context"] == 1)


def moe_copies_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler) -> list[tuple]:
    """ZeRO-0 gradient sums of a MoE model in jaxpar's pipeline with per-data-shard weight copies, XLA:CPU.
    In the loop, per unit execution, the weights replicated over `expert` (all but the routed experts) are
    summed over `expert` (its rows are split there too), the norm scales in an op of their own; after the
    loop, once per accumulation step, each data shard's copy of the stage's v*k unit slots, experts
    included, over `data` in one op, the head's and final norm's partial sums with the per-micro-batch
    losses over data x expert, and the embedding's over data x expert (checked: moe-tiny:layers=4 on
    pipeline=2 x expert=2 x data=2, tests/test_cost_vs_hlo.py)."""
    dense, experts = held(m, st, experts=False), held(m, st, experts=True)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    losses = [shape.head_micro * 4] if cc.combine else []
    out = []
    for execs, (norms, norm_arrays), (unit, _) in zip(shape.run_execs, unit_norms(m), dense.runs):   # each run's loop
        out += sites.issue(AR, ("expert",), execs, [norms * GRAD_BYTES] if norm_arrays else [], "backward")
        out += sites.issue(AR, ("expert",), execs, [(unit - norms) * GRAD_BYTES], "backward")
    slots = sum((d + e) * (shape.repeats * k) for (d, _), (e, _), k in zip(dense.runs, experts.runs, shape.run_slots))
    out += sites.issue(AR, ("data",), shape.accum, [slots * GRAD_BYTES], "backward")
    out += sites.issue(AR, ("data", "expert"), shape.accum, [(head + norm) * GRAD_BYTES] + losses, "backward")
    return out + sites.issue(AR, ("data", "expert"), 1, [(dense.emb - head - norm) * GRAD_BYTES], "backward")


def fsdp_stage_copies(st: Strategy, shape: StepShape) -> bool:
    """`stage_copies` of weights gathered over fsdp (FSDP inside the stages, `data` > 1 too)."""
    return stage_copies(st, shape) and st.zero == 3 and st.sizes["fsdp"] > 1


def replicated_copies_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...],
                            h: Held) -> list[tuple]:
    """The sums over `group` of weights replicated over it (ZeRO-0) under `stage_copies`, XLA:CPU: once per
    accumulation step after the schedule's loop, the stage's v*k unit slots (padding included) in one op
    with the head's and final norm's partial sums and the per-micro-batch losses; the embedding's (its
    lookup's scatter-add) apart (with gradient accumulation: in that op, per accumulation step). 1F1B under
    `tensor`: the stage's slots alone, the head's and final norm's with the embedding's. Under `tensor` the head's partial sums (vocab-sharded) are reduced
    on their own, over `group` then over `pipeline` (`head_apart`: its weight gradient's dot contracts over
    both; XLA:CPU's grouping, tests/test_verify_scale.py and the catalogue's pp2-tp2-dp2)."""
    slots = equal_buffers(h.slots(shape) * GRAD_BYTES, h.stack_arrays)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    losses = [shape.head_micro * 4] if cc.combine else []
    apart, emb = head_apart(st, shape), (h.emb - head - norm) * GRAD_BYTES
    if st.options.pp_schedule == "1f1b" and st.sizes["tensor"] > 1:   # the head's and norm's with the embedding's
        out = sites.issue(AR, group, shape.accum, slots, "backward")
        return out + sites.issue(AR, group, shape.accum, [emb + (head + norm) * GRAD_BYTES], "backward")
    out = sites.issue(AR, group, shape.accum, slots
               + [(norm + (0.0 if apart else head)) * GRAD_BYTES] + losses + ([emb] if shape.accum > 1 else []),
               "backward")
    out += sites.issue(AR, group, shape.accum, [head * GRAD_BYTES] if apart and head else [], "backward")
    return out + sites.issue(AR, group, 1, [emb] if shape.accum == 1 else [], "backward")


def context_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...],
                  h: Held) -> list[tuple]:
    """ZeRO-0 gradient sums over a group with `context` in jaxpar's pipelines, XLA:CPU: per
    layer execution in the loop, a unit's weights (with the per-data-shard copies, `stage_copies`, its
    norm scales in an op of their own); the head's and final norm's (with the loss) once per accumulation
    step (1F1B: per steady tick, and with the copies apart), and the embedding's apart (llama-tiny:layers=8 pipeline=2 x
    context=2 x data=2, GPipe and 1F1B, pipeline=2 x context=4: tests/test_cost_vs_hlo.py)."""
    copies = stage_copies(st, shape)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    one_f, out = st.options.pp_schedule == "1f1b", []
    for execs, (unit, arrays), run_norms in zip(shape.run_execs, h.runs, unit_norms(m)):   # each run's loop
        norms, norm_arrays = run_norms if copies else (0, 0)
        out += sites.issue(AR, group, execs, equal_buffers((unit - norms) * GRAD_BYTES, arrays - norm_arrays),
                           "backward")
        out += sites.issue(AR, group, execs, equal_buffers(norms * GRAD_BYTES, norm_arrays), "backward")
    ends = [head * GRAD_BYTES, norm * GRAD_BYTES] if one_f and copies else [(head + norm) * GRAD_BYTES]
    per_micro = shape.accum * (shape.micro if one_f else 1)   # 1F1B: head per tick, lookup per micro-batch
    out += [op for b in ends for op in sites.issue(AR, group, per_micro, [b], "backward")]
    return out + sites.issue(AR, group, per_micro if one_f else 1, [(h.emb - head - norm) * GRAD_BYTES], "backward")


def head_apart(st: Strategy, shape: StepShape) -> bool:
    """Under `stage_copies` of replicated weights with `tensor` > 1, the combiner leaves the LM head's
    gradient reductions (over the data axes, over `pipeline`) apart from the others (`replicated_copies_grads`)."""
    return stage_copies(st, shape) and st.zero != 3 and st.sizes["tensor"] > 1 and st.options.pp_schedule != "1f1b"


def copies_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...]) -> list[tuple]:
    """The sums over `data` under `stage_copies`: once per accumulation step after the schedule's loop
    (not per layer execution: each data x fsdp shard accumulates into its own copy), the stage's v*k unit
    slots' fsdp shards (padding included) together with the embedding's shard; the head's fsdp shard over
    data x pipeline at once (its stages' partial sums and the batch's are one reduction) and the final
    norm over data x fsdp, un-sharded, with the per-micro-batch losses (XLA:CPU's grouping, checked in
    tests/test_verify_scale.py)."""
    f = st.sizes["fsdp"]
    sharded, (head, norm) = held(m, st, "zero"), head_and_norm(m, st.sizes["tensor"])
    emb = sharded.emb - head - norm
    execs = 1 if cc.hoist else shape.accum
    out = sites.issue(AR, group, execs, equal_buffers(sharded.slots(shape) * GRAD_BYTES / f, sharded.stack_arrays)
               + [emb * GRAD_BYTES / f], "backward")
    out += sites.issue(AR, group + ("pipeline",), shape.accum, [head * GRAD_BYTES / f] if head else [], "backward")
    losses = [shape.head_micro * 4] if cc.combine else []
    return out + sites.issue(AR, group + ("fsdp",), shape.accum, [norm * GRAD_BYTES] + losses, "backward")


def expert_stats(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape) -> list[tuple]:
    """comm_expert's balance statistics under `moe_stage_copies`: summed over the axes but `data` in the
    loop, and the stage's v*k unit slots' accumulated statistics over `data` once per accumulation step."""
    if not moe_stage_copies(st, shape):
        return ops
    out = []
    for op in ops:
        if op[6] == sites.STATS:
            per = op[4]
            slots = shape.repeats * chunk_layers(shape, m, "E")   # the stage's MoE layer slots
            out += sites.issue(AR, ("data",), shape.accum, [slots * per], "forward")
            axes = tuple(a for a in op[1] if a != "data")
            op = (op[0], axes, *op[2:]) if axes else None
        if op:
            out.append(op)
    return out
