"""Predicted collectives of data parallelism, ZeRO-1 and FSDP (ZeRO-3): gradient reductions, parameter
gathers and the sharded embedding lookup, per device per step (jaxpar/cost/comm.py merges every
parallelism's; its docstring states the conventions: `Collective` records, counts times layer
executions, `Compiler` traits from jaxpar/cost/compiler.py). Where a program departs from these sums
(jaxpar's own pipelines, with their per-shard weight copies: jaxpar/cost/program_comm.py `departures`),
it says how in a `Departures`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpar.cost.compiler import (A2A, AG, AR, RS, Compiler, reductions, site, together, weight_buckets,
                                  weight_buffers)
from jaxpar.cost.held import DATA_LIKE, Held, equal_buffers, head_and_norm, held, norm_vectors, unit_norms
from jaxpar.cost.memory import PARAM_BYTES, TOKEN_BYTES, grad_bytes
from jaxpar.cost.params import zero_rules, zero_split
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


Sums = list[tuple]


@dataclasses.dataclass(frozen=True, slots=True)
class Departures:
    """Where a program's data-parallel collectives depart from the textbook's, for the weights other than
    routed experts (the defaults: none). `replicated_sums(group, held)`: a replicated weight set's gradient
    sums over `group` (None: the textbook's); `sharded_sums(group, sharded, head, norm)`: the ZeRO-3 shards'
    sums over the data axes beyond fsdp, in place of the textbook's (and the final norm summed there, not
    scattered); `stage_gather_bytes`: bytes per element of a pipeline stage's fsdp gathers (None: the
    compute dtype's); `table_gathered`: the embedding table gathered over fsdp and its gradient scattered,
    in place of `embedding_lookup`."""
    replicated_sums: Callable[[tuple[str, ...], Held], Sums | None] | None = None
    sharded_sums: Callable[[tuple[str, ...], Held, float, float], Sums] | None = None
    stage_gather_bytes: int | None = None
    table_gathered: bool = False


TEXTBOOK = Departures()


# ---- data parallelism, ZeRO-1, FSDP (ZeRO-3) ---------------------------------------------------------

def embedding_lookup(m: ModelConfig, st: Strategy, shape: StepShape, act: int, shard: tuple[str, ...],
                      cc: Compiler) -> list[tuple]:
    """Embedding table sharded on its model dim over `shard` (ZeRO-3 parameters, ZeRO-1 moments):
    the token ids are all-gathered to look rows up locally and the rows go back to batch sharding by an
    all-to-all; backward (and under ZeRO-1, where only the gradient is sharded, only backward) the
    row gradients take the reverse all-to-all, after which the embedding gradient needs no reduction."""
    ids = shape.b_loc * st.group(shard) * shape.s_loc * TOKEN_BYTES
    rows = shape.b_loc * shape.s_loc * m.d_model * act
    out = site(cc, AG, shard, shape.accum, [ids / shape.accum], "forward")
    if st.zero == 3:
        out += site(cc, A2A, shard, shape.accum, [rows / shape.accum], "forward")
    return out + site(cc, A2A, shard, shape.accum, [rows / shape.accum], "backward")


def fsdp_gathers(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                  stage_gather_bytes: int | None = None) -> list[tuple]:
    """ZeRO-3: per layer execution, forward and backward, one all-gather over fsdp per array the params
    rules shard (compute dtype; a packed group, Mamba-2's in_proj, is gathered as one array); the head
    and final norm gathered forward only: both are gathered once where they are read and the gathered
    copy is saved for the backward pass (`jaxpar.xla_workarounds.gathered`: models/lm.py, models/layers.py's
    RMSNorm). So are the layers' norm weights, so without remat they are not gathered again backward, nor
    are the routed experts' weights (operands of the expert kernel's shard_map, jaxpar/ops/moe.py, whose
    transpose reads the same gathered operands: XLA:CPU, moe-tiny fsdp=2,expert=4; a memory cost: every
    layer's gathered experts live until the backward pass);
    under remat each layer's norms and o-proj (models/transformer.py) are gathered once in the
    recomputed forward for both their reads.
    Under a pipeline each stage's weights are gathered once per accumulation step instead, forward
    only: per array of a unit, its v*k unit slots at once, `stage_gather_bytes` per element where a program
    gathers other than the compute dtype (jaxpar's pipeline gathers the stored float32 weights: its
    per-shard copies accumulate their gradients in float32, and casts them in the layers,
    jaxpar/pipeline/gpipe.py; the all-gather's operand is the float32 parameter in the HLO)."""
    t, out = st.sizes["tensor"], []
    for e, block in ((shape.exec_attention, "attention"), (shape.exec_mamba, "mamba"), (shape.exec_moe, "moe")):
        if e:
            sharded, _ = zero_split(m, block, 3)
            arrays = weight_buffers(cc, equal_buffers(sharded.per_device(t, st.sizes["expert"]) * act, sharded.moved))
            if shape.stages > 1:
                per_unit = e / (shape.accum * shape.iterations * shape.per_chunk)   # blocks per unit
                slots = per_unit * shape.repeats * shape.per_chunk
                per = stage_gather_bytes / act if stage_gather_bytes else 1.0
                out += site(cc, AG, ("fsdp",), shape.accum, [b * slots * per for b in arrays], "forward")
                continue
            out += site(cc, AG, ("fsdp",), e, arrays, "forward")
            if st.options.remat == "none":   # the gathered norm (and routed experts') weights are saved
                elements, n = norm_vectors(m, block)
                if block == "moe":
                    routed, _ = zero_split(m, block, 3, experts=True)
                    elements, n = elements + routed.per_device(t, st.sizes["expert"]), n + routed.moved
                arrays = weight_buffers(cc, equal_buffers(sharded.per_device(t, st.sizes["expert"]) * act
                                                          - elements * act, sharded.moved - n))
            out += site(cc, AG, ("fsdp",), e, arrays, "backward")
    head, norm = head_and_norm(m, t)
    return out + site(cc, AG, ("fsdp",), shape.accum, [b * act for b in (head, norm) if b], "forward")


def data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                  gather_bytes: int = PARAM_BYTES, departures: Departures = TEXTBOOK) -> list[tuple]:
    """ZeRO-0: all-reduce float32 grads over the data-like axes (hoisted: once per step, one per weight
    array; else per layer execution in the loop and once for embedding, head and final norm).
    ZeRO-1 and ZeRO-3 shard the weights with an `embed` dim (params.zero_split reads which from the
    rules); the others (Mamba-2's conv, A_log, dt_bias, D, gate norm) are treated as under ZeRO-0, their
    gradients all-reduced over every data-like axis, in the loop together with the sharded gradients'
    reduction where the compiler issues both there.
    ZeRO-1: reduce-scatter the sharded grads over data x fsdp, all-gather the updated params after the
    update, `gather_bytes` per element (jaxpar gathers its float32 masters; Megatron's distributed
    optimizer the bf16 model weights).
    ZeRO-3 / FSDP: gathers as `fsdp_gathers`, and per layer execution the sharded grads reduce-scattered
    over fsdp (under a pipeline once per accumulation step, each stage's v*k unit slots at once:
    jaxpar/pipeline/gpipe.py); then the shards all-reduced over the remaining data-like axes.
    Under ZeRO-1/3 the embedding is looked up as `embedding_lookup` says and the head's and final
    norm's gradients are reduce-scattered one by one (not combined).
    Routed experts (MoE under expert > 1) are split over `expert`: their gradients are reduced as above
    over the data-like axes but `expert`, apart from the other weights' (shard_map sums them where the
    expert kernel is transposed, in the layer loop); `departures` apply to layouts without them.
    A program's `departures` (a `Departures`) replace the sums they name."""
    axes = tuple(a for a in DATA_LIKE if st.sizes[a] > 1)
    if m.moe_layers and st.sizes["expert"] > 1:
        dense = _data_parallel(m, st, shape, act, cc, axes, False, gather_bytes, TEXTBOOK)
        experts = _data_parallel(m, st, shape, act, cc, tuple(a for a in axes if a != "expert"), True, gather_bytes,
                                 TEXTBOOK)
        return _one_loop(cc, st, shape, m, dense, experts)
    return _data_parallel(m, st, shape, act, cc, axes, None, gather_bytes, departures)


def _one_loop(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, dense: list[tuple],
              experts: list[tuple]) -> list[tuple]:
    """`dense` and `experts` ops, the experts' in-loop sums over fsdp (the partitioner's reduce-scatters of
    the gradients of the weights it gathered for the expert kernel) in the dense weights' op: the combiner
    makes one op of a layer's sums over fsdp (XLA:CPU: the catalogue's fsdp2-ep4 on moe-tiny,
    tests/test_strategies.py). The kernel's own sums over the other data axes (shard_map's, at its
    transpose) stay apart."""
    if not (cc.combine and not cc.hoist and st.zero == 3 and st.sizes["fsdp"] > 1):
        return dense + experts
    execs, loop = shape.exec_layers / len(m.pattern), (AR, ("fsdp",))
    dense, out = list(dense), []
    for op in experts:
        i = next((i for i, d in enumerate(dense) if op[:3] == d[:3] == (*loop, execs) and d[4] == op[4]), None)
        if i is None or op[:2] != loop:
            out.append(op)
        else:
            dense[i] = (*dense[i][:3], dense[i][3] + op[3], dense[i][4])
    return dense + out


def _groups(cc: Compiler, st: Strategy, over: tuple[str, ...], experts: bool | None) -> list[tuple[str, ...]]:
    """The groups the gradients of the weights `experts` selects are summed over: shard_map sums the routed
    experts' over every axis they are replicated on at once; the others' as `compiler.reductions` says."""
    return [over] if experts and over else reductions(cc, st, over)


def _grads(cc: Compiler, st: Strategy, group: tuple[str, ...], h: Held, shards: int, execs: float,
           gb: int) -> list[tuple]:
    """All-reduces of the gradients of the weights `h` (`gb` bytes each) over `group` (sizes / `shards`):
    hoisted, once per step (per array or per bucket, `weight_buckets`); else a unit's in the layer loop
    (`execs` per unit) and embedding + head + final norm's after it."""
    if cc.hoist:
        buffers = weight_buckets(cc, equal_buffers(h.full * gb / shards, h.arrays), gb / shards, st, group)
        return site(cc, AR, group, 1, buffers, "backward")
    return (site(cc, AR, group, execs, equal_buffers(h.unit * gb / shards, h.unit_arrays), "backward")
            + site(cc, AR, group, 1, equal_buffers(h.emb * gb / shards, h.emb_arrays), "backward"))


def _data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler, axes: tuple[str, ...],
                   experts: bool | None, gather_bytes: int, departures: Departures) -> list[tuple]:
    """`data_parallel` for the weights `experts` selects (params.zero_split), reduced over `axes`; the
    embedding lookup, FSDP gathers and head reductions go with the non-expert weights."""
    zero = st.zero
    # the axes ZeRO shards weights with an `embed` dim over: ZeRO-3 by its params rules, ZeRO-1 by its optimizer's
    shard = tuple(a for a in zero_rules(zero, "optimizer" if zero == 1 else "params")["embed"] if st.sizes[a] > 1)
    if not shard:
        return _replicated_grads(m, st, shape, cc, axes, experts, departures)
    return _sharded_grads(m, st, shape, act, cc, axes, shard, experts, gather_bytes, departures)


def _replicated_grads(m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, axes: tuple[str, ...],
                      experts: bool | None, departures: Departures) -> list[tuple]:
    """ZeRO-0 (no weight sharded over the data axes): every gradient all-reduced over `axes`, per group
    as `_grads` says or, for the weights other than routed experts, as `departures.replicated_sums`."""
    dense, h = experts is not True, held(m, st, experts=experts)
    execs = shape.exec_layers / len(m.pattern)
    departed = departures.replicated_sums if dense else None

    def per_group(group):
        sums = departed(group, h) if departed else None
        return _grads(cc, st, group, h, 1, execs, grad_bytes(st)) if sums is None else sums
    return [op for group in _groups(cc, st, axes, experts) for op in per_group(group)]


def _sharded_grads(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler, axes: tuple[str, ...],
                   shard: tuple[str, ...], experts: bool | None, gather_bytes: int,
                   departures: Departures) -> list[tuple]:
    """ZeRO-1 and ZeRO-3 (the weights with an `embed` dim sharded over `shard`): `data_parallel`'s docstring."""
    sz, zero, t = st.sizes, st.zero, st.sizes["tensor"]
    dense, gb = experts is not True, grad_bytes(st)
    execs = shape.exec_layers / len(m.pattern)

    def groups(over: tuple[str, ...]) -> list[tuple[str, ...]]:
        return _groups(cc, st, over, experts)

    def grads(group: tuple[str, ...], h: Held, shards: int) -> list[tuple]:
        return _grads(cc, st, group, h, shards, execs, gb)

    copies = departures.sharded_sums if dense else None
    sharded, kept = held(m, st, "zero", experts), held(m, st, "kept", experts)
    rest = tuple(a for a in axes if a not in shard)
    head, norm = head_and_norm(m, t)
    # ZeRO-3 over fsdp x other data axes: the norm weights' gradients are all-reduced whole (`_without_norms`)
    vectors = zero == 3 and dense and bool(rest) and shape.stages == 1 and not copies
    if vectors:
        sharded, norms = _without_norms(m, sharded)
    lookup = (site(cc, AG, ("fsdp",), shape.accum, [(sharded.emb - sum(head_and_norm(m, t))) * act], "forward")
              + site(cc, RS, ("fsdp",), shape.accum, [(sharded.emb - sum(head_and_norm(m, t))) * gb],
                     "backward") if departures.table_gathered else embedding_lookup(m, st, shape, act, shard, cc))
    out = (fsdp_gathers(m, st, shape, act, cc, departures.stage_gather_bytes) + lookup
           if zero == 3 and dense else [])
    # the sharded gradients, but the embedding's (its lookup leaves it sharded), reduce-scattered; ZeRO-3
    # does it in the loop whatever the compiler (that is what keeps only a shard of each gradient alive)
    if cc.hoist and zero != 3:
        out += site(cc, RS, shard, 1, weight_buckets(cc, equal_buffers(sharded.layers * gb, sharded.unit_arrays)
                                                      + [b * gb for b in (head, norm) if b and dense], gb,
                                                      st, shard), "backward")
    else:
        if shape.stages > 1:   # jaxpar/pipeline/gpipe.py: each fsdp shard accumulates its stage's v*k unit slots, reduced once
            slots = shape.repeats * shape.per_chunk
            in_loop = site(cc, RS, shard, shape.accum, weight_buffers(cc, equal_buffers(
                sharded.unit * slots * gb, sharded.unit_arrays)), "backward")
        else:
            in_loop = site(cc, RS, shard, execs,
                           weight_buffers(cc, equal_buffers(sharded.unit * gb, sharded.unit_arrays)), "backward")
        if vectors and not cc.hoist:
            in_loop += [op for group in groups(axes) for op in site(
                cc, AR, group, execs, equal_buffers(norms.unit * gb, norms.unit_arrays), "backward")]
        if not cc.hoist:
            for group in groups(axes):
                in_loop += site(cc, AR, group, execs, equal_buffers(kept.unit * gb, kept.unit_arrays), "backward")
        out += together(cc, in_loop)
        for nbytes in (head, norm if not (copies or vectors) else 0.0):
            out += site(cc, RS, shard, 1, [nbytes * gb], "optimizer") if nbytes and dense else []
        if vectors:   # hoisted: once per step, one per array, as the kept weights'
            out += [op for group in groups(axes) for op in (
                grads(group, norms, 1) if cc.hoist else site(cc, AR, group, 1, [norm * gb], "backward"))]
    if zero == 1:
        out += embedding_lookup(m, st, shape, act, shard, cc) if dense else []
        out += site(cc, AG, shard, 1, weight_buckets(cc, equal_buffers(sharded.full * gather_bytes, sharded.arrays),
                                                      gather_bytes, st, shard), "optimizer")
    for group in groups(axes):  # the kept weights', as under ZeRO-0 (in the loop: above)
        out += (grads(group, kept, 1) if cc.hoist
                else site(cc, AR, group, 1, equal_buffers(kept.emb * gb, kept.emb_arrays), "backward"))
    # the head's shard on its own under `tensor` (XLA:CPU's grouping: `_without_norms` names the layouts checked)
    apart = head if vectors and t > 1 and not cc.hoist else 0.0
    if apart:
        sharded = dataclasses.replace(sharded, emb=sharded.emb - head, emb_arrays=sharded.emb_arrays - 1)
    for group in groups(rest):
        out += (copies(group, sharded, head, norm) if copies
                else grads(group, sharded, sz["fsdp"] if zero == 3 else 1))
        out += site(cc, AR, group, 1, [apart * gb / sz["fsdp"]] if apart else [], "backward")
    return out


def _without_norms(m: ModelConfig, sharded: Held) -> tuple[Held, Held]:
    """(`sharded` less the norm weights, the norm weights): the weights whose only dim is `embed` (a
    pattern unit's pre-norms; the final norm among embedding and head).
    Their gradient is a sum over the tokens (a reduce, no dot). Under ZeRO-3 with the batch over fsdp
    and other data axes, the SPMD partitioner all-reduces the whole vector over all the batch axes at
    once and slices the fsdp shard out afterwards, where a matrix's gradient is reduce-scattered over
    fsdp and its shard all-reduced over the rest: per layer execution one op over data x fsdp (the
    unit's norms, in the layer loop), the final norm's after it. Over fsdp alone the two forms are the
    same op (ReduceScatterCreator turns the sliced all-reduce into a reduce-scatter). Checked on
    XLA:CPU: the catalogue's dp2-fsdp2-tp2 and fsdp2-ep4 (expert a batch axis; tests/test_strategies.py),
    llama-tiny data=2,fsdp=4 and data=4,fsdp=2 (tests/test_cost_vs_hlo_fsdp.py); jaxpar/pipeline/gpipe.py's
    stage copies have their own (`copies_grads`).
    In the same layouts under `tensor` the LM head's (vocab-sharded) fsdp shard is summed over the other
    data axes in an op of its own, not with the embedding's shard (the combiner's grouping on XLA:CPU;
    over data x fsdp alone the two share one op, as under ZeRO-0, where the head's gradient is whole)."""
    unit, arrays = unit_norms(m)
    norms = Held(unit=unit, unit_arrays=arrays, layers=unit * m.units, emb=float(m.d_model), emb_arrays=1)
    return Held(sharded.unit - unit, sharded.unit_arrays - arrays, sharded.layers - norms.layers,
                sharded.emb - norms.emb, sharded.emb_arrays - 1), norms


