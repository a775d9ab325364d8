"""The gradient sums of jaxpar's own pipelines (jaxpar/pipeline/gpipe.py, one_f_one_b.py), where they depart
from the textbook's per-layer reductions of jaxpar/cost/comm_data.py. A stage runs with one copy of its
(gathered) weights per data (x fsdp) shard, so nothing is summed over `data` inside the schedule's loop:
each shard accumulates its stage's v*k unit slots, and the copies are summed once per accumulation step
after it (`stage_copies`; with the experts split over `expert`, `moe_stage_copies`; over fsdp,
`fsdp_stage_copies`). How XLA:CPU's combiner groups those sums is stated per function with the layouts
it was checked on (tests/test_cost_vs_hlo.py, tests/test_verify_scale.py). `data_parallel` is jaxpar's
program's data parallelism: the textbook's with these `departures`. Records as comm.py's.
"""
from __future__ import annotations

import functools

from jaxpar.cost import comm_data
from jaxpar.cost.compiler import AR, Compiler, site
from jaxpar.cost.held import Held, equal_buffers, head_and_norm, held, unit_norms
from jaxpar.cost.memory import GRAD_BYTES, PARAM_BYTES
from jaxpar.cost.shape import StepShape, one_f_one_b
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                  gather_bytes: int) -> list[tuple]:
    """jaxpar's program's data parallelism: comm_data.data_parallel with `departures`; a MoE model's under
    `moe_stage_copies` (the loop's sums left to the combiner, not hoisted) is `moe_copies_grads` whole."""
    if m.moe_layers and moe_stage_copies(st, shape) and not cc.hoist:
        return moe_copies_grads(m, st, shape, cc)
    return comm_data.data_parallel(m, st, shape, act, cc, gather_bytes, departures(m, st, shape, cc))


def departures(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler) -> comm_data.Departures:
    """Where jaxpar's program departs from the textbook's data parallelism (comm_data.Departures): its
    pipelines' replicated weights summed as `replicated_sums`, their fsdp shards as `copies_grads` under
    `fsdp_stage_copies`; a stage's fsdp gathers move the stored float32 weights (PARAM_BYTES); jaxpar's
    1F1B gathers the embedding table over fsdp before its loop (jaxpar/pipeline/one_f_one_b.py) in place
    of the sharded lookup."""
    return comm_data.Departures(
        replicated_sums=functools.partial(replicated_sums, m, st, shape, cc),
        sharded_sums=functools.partial(copies_grads, m, st, shape, cc) if fsdp_stage_copies(st, shape) else None,
        stage_gather_bytes=PARAM_BYTES, table_gathered=one_f_one_b(st, shape))


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
    norms, norm_arrays = unit_norms(m)
    execs, slots = shape.exec_layers / len(m.pattern), shape.repeats * shape.per_chunk
    head, norm = head_and_norm(m, st.sizes["tensor"])
    losses = [shape.head_micro * 4] if cc.combine else []
    out = site(cc, AR, ("expert",), execs, [norms * GRAD_BYTES] if norm_arrays else [], "backward")
    out += site(cc, AR, ("expert",), execs, [(dense.unit - norms) * GRAD_BYTES], "backward")
    out += site(cc, AR, ("data",), shape.accum, [(dense.unit + experts.unit) * slots * GRAD_BYTES], "backward")
    out += site(cc, AR, ("data", "expert"), shape.accum, [(head + norm) * GRAD_BYTES] + losses, "backward")
    return out + site(cc, AR, ("data", "expert"), 1, [(dense.emb - head - norm) * GRAD_BYTES], "backward")


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
    slots = shape.repeats * shape.per_chunk
    head, norm = head_and_norm(m, st.sizes["tensor"])
    losses = [shape.head_micro * 4] if cc.combine else []
    apart, emb = head_apart(st, shape), (h.emb - head - norm) * GRAD_BYTES
    if st.options.pp_schedule == "1f1b" and st.sizes["tensor"] > 1:   # the head's and norm's with the embedding's
        out = site(cc, AR, group, shape.accum, equal_buffers(h.unit * slots * GRAD_BYTES, h.unit_arrays), "backward")
        return out + site(cc, AR, group, shape.accum, [emb + (head + norm) * GRAD_BYTES], "backward")
    out = site(cc, AR, group, shape.accum, equal_buffers(h.unit * slots * GRAD_BYTES, h.unit_arrays)
               + [(norm + (0.0 if apart else head)) * GRAD_BYTES] + losses + ([emb] if shape.accum > 1 else []),
               "backward")
    out += site(cc, AR, group, shape.accum, [head * GRAD_BYTES] if apart and head else [], "backward")
    return out + site(cc, AR, group, 1, [emb] if shape.accum == 1 else [], "backward")


def context_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...],
                  h: Held) -> list[tuple]:
    """ZeRO-0 gradient sums over a group with `context` in jaxpar's pipelines, XLA:CPU: per
    layer execution in the loop, a unit's weights (with the per-data-shard copies, `stage_copies`, its
    norm scales in an op of their own); the head's and final norm's (with the loss) once per accumulation
    step (1F1B: per steady tick, and with the copies apart), and the embedding's apart (llama-tiny:layers=8 pipeline=2 x
    context=2 x data=2, GPipe and 1F1B, pipeline=2 x context=4: tests/test_cost_vs_hlo.py)."""
    execs = shape.exec_layers / len(m.pattern)
    norms, norm_arrays = unit_norms(m) if stage_copies(st, shape) else (0, 0)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    one_f = st.options.pp_schedule == "1f1b"
    out = site(cc, AR, group, execs, equal_buffers((h.unit - norms) * GRAD_BYTES, h.unit_arrays - norm_arrays),
               "backward")
    out += site(cc, AR, group, execs, equal_buffers(norms * GRAD_BYTES, norm_arrays), "backward")
    ends = [head * GRAD_BYTES, norm * GRAD_BYTES] if one_f and norms else [(head + norm) * GRAD_BYTES]
    per_micro = shape.accum * (shape.micro if one_f else 1)   # 1F1B: head per tick, lookup per micro-batch
    out += [op for b in ends for op in site(cc, AR, group, per_micro, [b], "backward")]
    return out + site(cc, AR, group, per_micro if one_f else 1, [(h.emb - head - norm) * GRAD_BYTES], "backward")


def head_apart(st: Strategy, shape: StepShape) -> bool:
    """Under `stage_copies` of replicated weights with `tensor` > 1, the combiner leaves the LM head's
    gradient reductions (over the data axes, over `pipeline`) apart from the others (`replicated_copies_grads`)."""
    return stage_copies(st, shape) and st.zero != 3 and st.sizes["tensor"] > 1 and st.options.pp_schedule != "1f1b"


def copies_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, group: tuple[str, ...],
                 sharded: Held, head: float, norm: float) -> list[tuple]:
    """The sums over `data` under `stage_copies`: once per accumulation step after the schedule's loop
    (not per layer execution: each data x fsdp shard accumulates into its own copy), the stage's v*k unit
    slots' fsdp shards (padding included) together with the embedding's shard; the head's fsdp shard over
    data x pipeline at once (its stages' partial sums and the batch's are one reduction) and the final
    norm over data x fsdp, un-sharded, with the per-micro-batch losses (XLA:CPU's grouping, checked in
    tests/test_verify_scale.py)."""
    f, slots = st.sizes["fsdp"], shape.repeats * shape.per_chunk
    emb = sharded.emb - head - norm
    execs = 1 if cc.hoist else shape.accum
    out = site(cc, AR, group, execs, equal_buffers(sharded.unit * slots * GRAD_BYTES / f, sharded.unit_arrays)
               + [emb * GRAD_BYTES / f], "backward")
    out += site(cc, AR, group + ("pipeline",), shape.accum, [head * GRAD_BYTES / f] if head else [], "backward")
    losses = [shape.head_micro * 4] if cc.combine else []
    return out + site(cc, AR, group + ("fsdp",), shape.accum, [norm * GRAD_BYTES] + losses, "backward")
