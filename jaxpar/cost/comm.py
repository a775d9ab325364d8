"""Predicted collectives of one training step: kind x mesh axes x phase, per device.

Records are the HLO tally's own `jaxpar.collectives.Collective` (kind, axes, count, bytes, wire_bytes, phase),
so a prediction and the compiled program's tally compare field by field. `bytes` is the full
(gathered / pre-scatter / reduced) buffer of each instance, summed over instances; `wire_bytes` is
what one device sends under the ring algorithm (`jaxpar.collectives.wire_factor`). Each parallelism has one small function below, so a formula is easy to adjust once it is checked
against the compiled HLO (tests/test_cost_vs_hlo.py does, for every 8-device strategy on XLA:CPU).
Counts multiply layer executions (scan and pipeline trip counts included). Recomputed forward
collectives (remat `full`) are tallied under `backward`.

What XLA's passes make of the collectives a program asks for differs by backend: jaxpar/cost/compiler.py
states them as data (`Compiler`: GPU, TPU, CPU), and every function below takes one.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import Collective, wire_factor  # the HLO tally's record and ring model: shared
from jaxpar.cost.compiler import (A2A, AG, AR, BATCH_AXES, COMPILERS, GPU, PERMUTE, RS, Compiler, ar_bytes,
                                   reductions, site, together)
from jaxpar.cost.memory import DTYPE_BYTES, GRAD_BYTES, PARAM_BYTES
from jaxpar.cost.params import (BLOCKS, attention_block_params, block_params, layer_counts, mamba_block_params,
                                mamba_dims, per_model, zero_rules, zero_split)
from jaxpar.cost.shape import StepShape
from jaxpar.rules import BASE_RULES
from jaxpar.strategy import AXES, Strategy
from jaxpar.models.config import ModelConfig

# axes over which (non-expert) weights are replicated: the batch's and the sequence's, in mesh order
DATA_LIKE = tuple(a for a in AXES if a in BATCH_AXES + BASE_RULES["seq"])
TOKEN_BYTES = 4  # int32 token ids and positions; f32 per-token statistics


def record(kind: str, axes: tuple[str, ...], count: float, nbytes: float, phase: str,
           sizes: dict[str, int]) -> Collective:
    """`count` instances of `nbytes` each over the group spanned by `axes`."""
    n = 1
    for a in axes:
        n *= sizes[a]
    total = count * nbytes
    return Collective(kind, axes, round(count), round(total), total * wire_factor(kind, n), phase)


def _passes(st: Strategy) -> tuple[str, ...]:
    """Phases in which a layer's forward collectives run: forward, plus backward if recomputed."""
    return ("forward", "backward") if st.options.remat == "full" else ("forward",)


# ---- tensor (+ sequence) parallelism: Megatron f/g operators (Shoeybi et al. 2019; Korthikanti 2022) ---

def tp_attention(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float) -> list[tuple]:
    """Per attention-layer execution (x: the residual activation, xr: as all-reduced).
    Forward: after o-proj and after the MLP down-proj an all-reduce (SP: all-gather of the norm output
    before each, reduce-scatter after). Recompute (remat `full`): the attention one again (the MLP's is
    dead: a layer's output is not needed for its own gradient; SP: both gathers and the attention
    reduce-scatter). Backward: the input gradients of q,k,v and of gate,up are all-reduced, one sum
    each with reassociation, one per projection without it (SP: reduce-scattered; the gathers'
    transposes are reduce-scatters and the reduce-scatters' are all-gathers). A pipeline iteration
    is rematerialised as a whole, so under SP its two gathers run again backward."""
    e, sp, out = shape.exec_attention, st.options.sequence_parallel, []
    ax = ("tensor",)
    fwd_kind = RS if sp else AR
    fwd_x = x if (sp and cc.reduce_scatter) else xr
    for _ in range(2):
        if sp:
            out += site(cc, AG, ax, e, [x], "forward")
        out += site(cc, fwd_kind, ax, e, [fwd_x], "forward")
    if st.options.remat == "full" or (sp and shape.stages > 1):
        if sp:
            out += site(cc, AG, ax, e, [x], "backward") + site(cc, AG, ax, e, [x], "backward")
        if st.options.remat == "full":
            out += site(cc, fwd_kind, ax, e, [fwd_x], "backward")
    if sp:
        out += site(cc, AG, ax, e, [x], "backward") + site(cc, AG, ax, e, [x], "backward")
    if cc.reassociate:
        out += site(cc, fwd_kind, ax, e, [fwd_x], "backward") + site(cc, fwd_kind, ax, e, [fwd_x], "backward")
    else:  # q, k, v and gate, up input gradients: all-reduced (sliced afterwards under SP)
        out += site(cc, AR, ax, e, [xr] * 3, "backward") + site(cc, AR, ax, e, [xr] * 2, "backward")
    return out


def tp_mamba(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float) -> list[tuple]:
    """Per Mamba-layer execution: all-reduce after out_proj forward (SP: gather before in_proj,
    reduce-scatter after out_proj), and of in_proj's input gradient backward (in_proj is one packed
    matmul, so one partial sum; SP: the transposes). Recompute adds nothing live (the out_proj sum
    is the layer's output)."""
    e, sp, ax = shape.exec_mamba, st.options.sequence_parallel, ("tensor",)
    if not sp:
        return site(cc, AR, ax, e, [xr], "forward") + site(cc, AR, ax, e, [xr], "backward")
    rs = x if cc.reduce_scatter else xr
    return (site(cc, AG, ax, e, [x], "forward") + site(cc, RS, ax, e, [rs], "forward")
            + site(cc, AG, ax, e, [x], "backward") + site(cc, RS, ax, e, [rs], "backward"))


def tp_vocab(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """Vocab-sharded embedding and head, once per accumulation step (head outside the pipeline):
    forward the embedding output is summed over `tensor` (SP: reduce-scattered), the head input is
    gathered under SP, the softmax max and sum-exp are all-reduced (T*4 bytes each), and so is the
    label's logit (T*4; only the loss value needs it, so XLA:CPU's combiner merges it with the next
    all-reduce over `tensor`); backward the head input gradient is all-reduced (SP:
    reduce-scattered) and, under SP, the embedding output gradient gathered."""
    tokens = shape.b_loc / shape.accum * shape.s_loc
    x, xr, n = tokens * m.d_model * act, tokens * m.d_model * ar_bytes(cc, act), shape.accum
    sp, ax = st.options.sequence_parallel, ("tensor",)
    rs = x if cc.reduce_scatter else xr
    out = site(cc, RS if sp else AR, ax, n, [rs if sp else xr], "forward")
    out += site(cc, AR, ax, n, [tokens * 4], "forward") + site(cc, AR, ax, n, [tokens * 4], "forward")
    out += site(cc, RS if sp else AR, ax, n, [rs if sp else xr], "backward")
    if sp:
        out += site(cc, AG, ax, n, [x], "forward") + site(cc, AG, ax, n, [x], "backward")
    if not (sp and cc.combine):  # under SP and the combiner it rides with the final-norm gradient
        out += site(cc, AR, ax, n, [tokens * 4], "optimizer" if cc.combine else "forward")
    return out


def sp_norms(cc: Compiler, m: ModelConfig, shape: StepShape) -> list[tuple]:
    """Under SP the norm weights see sequence shards: their gradients are summed over `tensor`.
    Hoisted: once per step; else in the layer loop, per layer execution, and the final norm's
    after it (with the combiner, together with the label-logit sum)."""
    ax, d = ("tensor",), m.d_model
    na, nm = layer_counts(m)
    if cc.hoist:
        reps = na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated
        return [(AR, ax, 1, (reps / shape.stages + d) * GRAD_BYTES, "backward")]
    tokens = shape.b_loc / shape.accum * shape.s_loc
    out = site(cc, AR, ax, shape.exec_attention, [d * GRAD_BYTES] * 2, "backward")
    out += site(cc, AR, ax, shape.exec_mamba, [d * GRAD_BYTES], "backward")
    final = [d * GRAD_BYTES] + ([tokens * 4] if cc.combine else [])
    return out + site(cc, AR, ax, 1, final, "optimizer")


def tensor_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU) -> list[tuple]:
    """Attention layer: 2 per pass (after o-proj, after MLP down); Mamba-2 layer: 1 (after out_proj)."""
    x = shape.mb * shape.s_loc * m.d_model * act
    xr = shape.mb * shape.s_loc * m.d_model * ar_bytes(cc, act)
    out = tp_attention(cc, st, shape, x, xr) if shape.exec_attention else []
    out += tp_mamba(cc, st, shape, x, xr) if shape.exec_mamba else []
    out += tp_vocab(cc, st, shape, m, act)
    if st.options.sequence_parallel:
        out += sp_norms(cc, m, shape)
    return out


# ---- context parallelism --------------------------------------------------------------------------

def context_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU) -> list[tuple]:
    """Attention (jaxpar/ops/context_parallel.py), per layer execution and pass: ring (Liu et al.
    2023): context-1 hops, each a permute of K and one of V (2 ops of the local block's half each),
    and of dK, dV backward; the key positions travel the ring once per step (c-1 int32 permutes);
    all-gather: K and V gathered (2 ops) forward, dK and dV reduce-scattered backward (hand-written:
    reduce-scatters on every backend), the positions gathered once.
    Mamba-2 (jaxpar/ops/mamba_cp.py): per pass one permute of the packed conv halo ((d_conv-1)
    tokens x conv channels; zigzag: two, one from each neighbour) and one all-gather of every
    segment's final SSM state and log-decay (b*m*heads/t*(head_dim*d_state + 1) float32 per shard,
    m = 1 or 2 segments); their transposes backward."""
    c, t = st.sizes["context"], st.sizes["tensor"]
    ax, out = ("context",), []
    zigzag = st.options.cp_layout == "zigzag"
    if shape.exec_attention:
        e = shape.exec_attention
        half = shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act  # K or V
        pos = shape.b_loc / shape.accum * shape.s_loc * TOKEN_BYTES
        ring = st.options.attention == "ring"
        for phase in _passes(st):
            out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], phase) if ring
                    else site(cc, AG, ax, e, [half * c, half * c], phase))
        out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], "backward") if ring
                else site(cc, RS, ax, e, [half * c, half * c], "backward", partitioner=False))
        if ring:
            out += site(cc, PERMUTE, ax, (c - 1) * shape.accum, [pos], "forward")
        else:
            out += site(cc, AG, ax, shape.accum, [pos * c], "forward")
    if shape.exec_mamba:
        e, segs = shape.exec_mamba, 2 if zigzag else 1
        _, conv_dim, heads = mamba_dims(m)
        halo = shape.mb * (m.d_conv - 1) * conv_dim / t * act
        state = shape.mb * segs * heads / t * (m.ssm_head_dim * m.d_state + 1) * 4 * c
        for phase in _passes(st):
            out += site(cc, PERMUTE, ax, e, [halo] * segs, phase) + site(cc, AG, ax, e, [state], phase)
        out += site(cc, PERMUTE, ax, e, [halo] * segs, "backward")
        out += site(cc, RS, ax, e, [state], "backward", partitioner=False)
    return out


# ---- pipeline parallelism -------------------------------------------------------------------------

def pipeline_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int,
                      scatter_gather: bool | None = None, cc: Compiler = GPU) -> list[tuple]:
    """jaxpar/pipeline.py. One collective-permute of the stage state (a micro-batch's residual stream)
    per schedule iteration forward, and its transpose backward (GPipe M+S-1, circular v*M+S-1
    iterations). The state is split over `tensor` under SP; with Megatron's scatter/gather (Narayanan
    2021, 4.1) it is split for the send and all-gathered over `tensor` on arrival. After the loop the
    output [M, mb, s, d] is all-reduced over `pipeline` (replicated from the last stage), and its
    cotangent backward. The circular schedule views the stacked weights [U] as [v, S, k] (a transpose
    across stages): per weight array one all-to-all, plus one permute when v < S, forward, and the
    same for its gradient backward."""
    sp, sizes = st.options.sequence_parallel, st.sizes
    split = sp or (scatter_gather is True)
    x = shape.mb * shape.s_loc * m.d_model * act
    n = shape.iterations * shape.accum
    sent = x / sizes["tensor"] if split else x
    ax = ("pipeline",)
    out = [(PERMUTE, ax, n, sent, "forward"), (PERMUTE, ax, n, sent, "backward")]
    if split and not sp and sizes["tensor"] > 1:
        out += [(AG, ("tensor",), n, x, "forward"), (AG, ("tensor",), n, x, "backward")]
    if scatter_gather is None:  # jaxpar's GSPMD pipeline (Software.pp_scatter_gather None); Megatron has neither
        y = shape.b_loc / shape.accum * shape.s_loc * m.d_model * ar_bytes(cc, act)
        y = y / sizes["tensor"] if sp else y
        out += site(cc, AR, ax, shape.accum, [y], "forward") + site(cc, AR, ax, shape.accum, [y], "backward")
        if shape.repeats > 1:
            h = held(m, st)
            arrays = _arrays(h.layers * act, h.unit_arrays)
            moves = (A2A, PERMUTE) if shape.repeats < shape.stages else (A2A,)
            for kind in moves:
                out += site(cc, kind, ax, 1, arrays, "forward") + site(cc, kind, ax, 1, arrays, "backward")
    return out


# ---- data parallelism, ZeRO-1, FSDP (ZeRO-3) ---------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """Parameter elements per device (after the tensor and pipeline splits) and arrays of a set of
    weights: one pattern unit (the layer stack is stacked over units, so its arrays are the unit's),
    this stage's layer stack, and embedding + final norm + head."""
    unit: float
    unit_arrays: int
    layers: float
    emb: float
    emb_arrays: int

    @property
    def full(self) -> float:
        return self.layers + self.emb

    @property
    def arrays(self) -> int:
        return self.unit_arrays + self.emb_arrays


@per_model
def _held(m: ModelConfig, part: str, zero: int, tensor: int, stages: int) -> Held:
    blocks = {}
    for block in BLOCKS:
        if part == "all":
            blocks[block] = block_params(m, block)
        else:  # the ZeRO-sharded part of each block, or the rest; ZeRO-1 shards by the optimizer rules
            sharded, kept = zero_split(m, block, zero, "optimizer" if zero == 1 else "params")
            blocks[block] = sharded if part == "zero" else kept
    a, mb, e = blocks["attention"], blocks["mamba"], blocks["embedding"]
    na, nm = layer_counts(m)
    ua, um = m.pattern.count("A"), m.pattern.count("M")
    return Held(unit=ua * a.per_device(tensor) + um * mb.per_device(tensor), unit_arrays=ua * a.tensors + um * mb.tensors,
                layers=(na * a.per_device(tensor) + nm * mb.per_device(tensor)) / stages,
                emb=e.per_device(tensor), emb_arrays=e.tensors)


def held(m: ModelConfig, st: Strategy, part: str = "all") -> Held:
    """What one device holds of `part`: "all" weights, the ones the strategy's ZeRO stage shards over the
    data axes ("zero": every weight with an `embed` dim), or the others ("kept": replicated over them)."""
    sz = st.sizes
    return _held(m, part, st.zero, sz["tensor"], sz["pipeline"])


def _arrays(total: float, n: int) -> list[float]:
    """`total` bytes as `n` equal buffers (none when n = 0)."""
    return [total / n] * n if n else []


def _embedding_lookup(m: ModelConfig, st: Strategy, shape: StepShape, act: int, shard: tuple[str, ...],
                      cc: Compiler) -> list[tuple]:
    """Embedding table sharded on its model dim over `shard` (ZeRO-3 parameters, ZeRO-1 moments):
    the token ids are all-gathered to look rows up locally and the rows go back to batch sharding by an
    all-to-all; backward (and under ZeRO-1, where only the gradient is sharded, only backward) the
    row gradients take the reverse all-to-all, after which the embedding gradient needs no reduction."""
    n = 1
    for a in shard:
        n *= st.sizes[a]
    ids = shape.b_loc * n * shape.s_loc * TOKEN_BYTES
    rows = shape.b_loc * shape.s_loc * m.d_model * act
    out = site(cc, AG, shard, shape.accum, [ids / shape.accum], "forward")
    if st.zero == 3:
        out += site(cc, A2A, shard, shape.accum, [rows / shape.accum], "forward")
    return out + site(cc, A2A, shard, shape.accum, [rows / shape.accum], "backward")


def _fsdp_gathers(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler) -> list[tuple]:
    """ZeRO-3: per layer execution, forward and backward, one all-gather over fsdp per array the params
    rules shard (compute dtype; a packed group, Mamba-2's in_proj, is gathered as one array); the head
    and final norm gathered forward, the final norm again backward (the gathered head is kept)."""
    t, out = st.sizes["tensor"], []
    for e, block in ((shape.exec_attention, "attention"), (shape.exec_mamba, "mamba")):
        if e:
            sharded, _ = zero_split(m, block, 3)
            arrays = _arrays(sharded.per_device(t) * act, sharded.moved)
            out += site(cc, AG, ("fsdp",), e, arrays, "forward") + site(cc, AG, ("fsdp",), e, arrays, "backward")
    head, norm = _head_and_norm(m, t)
    out += site(cc, AG, ("fsdp",), shape.accum, [b * act for b in (head, norm) if b], "forward")
    return out + site(cc, AG, ("fsdp",), shape.accum, [norm * act], "backward")


def data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU) -> list[tuple]:
    """ZeRO-0: all-reduce float32 grads over the data-like axes (hoisted: once per step, one per weight
    array; else per layer execution in the loop and once for embedding, head and final norm).
    ZeRO-1 and ZeRO-3 shard the weights with an `embed` dim (params.zero_split reads which from the
    rules); the others (Mamba-2's conv, A_log, dt_bias, D, gate norm) are treated as under ZeRO-0, their
    gradients all-reduced over every data-like axis, in the loop together with the sharded gradients'
    reduction where the compiler issues both there.
    ZeRO-1: reduce-scatter the sharded grads over data x fsdp, all-gather the updated float32 params
    after the update.
    ZeRO-3 / FSDP: gathers as `_fsdp_gathers`, and per layer execution the sharded grads reduce-scattered
    over fsdp; then the shards all-reduced over the remaining data-like axes.
    Under ZeRO-1/3 the embedding is looked up as `_embedding_lookup` says and the head's and final
    norm's gradients are reduce-scattered one by one (not combined)."""
    sz, zero, t = st.sizes, st.zero, st.sizes["tensor"]
    axes = tuple(a for a in DATA_LIKE if sz[a] > 1)
    # the axes ZeRO shards weights with an `embed` dim over: ZeRO-3 by its params rules, ZeRO-1 by its optimizer's
    shard = tuple(a for a in zero_rules(zero, "optimizer" if zero == 1 else "params")["embed"] if sz[a] > 1)
    execs = (shape.exec_attention + shape.exec_mamba) / len(m.pattern)

    def grads(group: tuple[str, ...], h: Held, shards: int) -> list[tuple]:
        """All-reduces of the gradients of the weights `h` over `group` (sizes / `shards`)."""
        if cc.hoist:
            return site(cc, AR, group, 1, _arrays(h.full * GRAD_BYTES / shards, h.arrays), "backward")
        return (site(cc, AR, group, execs, _arrays(h.unit * GRAD_BYTES / shards, h.unit_arrays), "backward")
                + site(cc, AR, group, 1, _arrays(h.emb * GRAD_BYTES / shards, h.emb_arrays), "backward"))

    if not shard:
        return [op for group in reductions(cc, st, axes) for op in grads(group, held(m, st), 1)]
    sharded, kept = held(m, st, "zero"), held(m, st, "kept")
    rest = tuple(a for a in axes if a not in shard)
    head, norm = _head_and_norm(m, t)
    out = _fsdp_gathers(m, st, shape, act, cc) + _embedding_lookup(m, st, shape, act, shard, cc) if zero == 3 else []
    # the sharded gradients, but the embedding's (its lookup leaves it sharded), reduce-scattered; ZeRO-3
    # does it in the loop whatever the compiler (that is what keeps only a shard of each gradient alive)
    if cc.hoist and zero != 3:
        out += site(cc, RS, shard, 1, _arrays(sharded.layers * GRAD_BYTES, sharded.unit_arrays)
                    + [b * GRAD_BYTES for b in (head, norm) if b], "backward")
    else:
        in_loop = site(cc, RS, shard, execs, _arrays(sharded.unit * GRAD_BYTES, sharded.unit_arrays), "backward")
        if not cc.hoist:
            for group in reductions(cc, st, axes):
                in_loop += site(cc, AR, group, execs, _arrays(kept.unit * GRAD_BYTES, kept.unit_arrays), "backward")
        out += together(cc, in_loop)
        for nbytes in (head, norm):
            out += site(cc, RS, shard, 1, [nbytes * GRAD_BYTES], "optimizer") if nbytes else []
    if zero == 1:
        out += _embedding_lookup(m, st, shape, act, shard, cc)
        out += site(cc, AG, shard, 1, _arrays(sharded.full * PARAM_BYTES, sharded.arrays), "optimizer")
    for group in reductions(cc, st, axes):  # the kept weights', as under ZeRO-0 (in the loop: above)
        out += (grads(group, kept, 1) if cc.hoist
                else site(cc, AR, group, 1, _arrays(kept.emb * GRAD_BYTES, kept.emb_arrays), "backward"))
    for group in reductions(cc, st, rest):
        out += grads(group, sharded, sz["fsdp"] if zero == 3 else 1)
    return out


def _head_and_norm(m: ModelConfig, tensor: int) -> tuple[float, float]:
    """Elements per device of the LM head (0 when tied to the embedding) and the final norm."""
    return (0.0 if m.tie_embeddings else m.vocab * m.d_model / tensor), float(m.d_model)


# ---- all of it ---------------------------------------------------------------------------------------

def predicted(m: ModelConfig, st: Strategy, shape: StepShape,
              pp_scatter_gather: bool | None = None, compiler: Compiler = GPU) -> tuple[tuple, ...]:
    """Every predicted collective of one step as (kind, axes, phase, count, total bytes), merged by
    (kind, axes, phase). Plain tuples: the time model reads them thousands of times per second."""
    sz, cc = st.sizes, compiler
    act = DTYPE_BYTES[st.options.dtype]
    raw = data_parallel(m, st, shape, act, cc)
    if sz["tensor"] > 1:
        raw += tensor_parallel(m, st, shape, act, cc)
    if sz["context"] > 1:
        raw += context_parallel(m, st, shape, act, cc)
    if sz["pipeline"] > 1:
        raw += pipeline_parallel(m, st, shape, act, pp_scatter_gather, cc)
    merged: dict[tuple, list[float]] = {}
    for kind, axes, count, nbytes, phase in raw:
        key = (kind, axes, phase)
        acc = merged.get(key)
        if acc is None:
            merged[key] = [count, count * nbytes]
        else:
            acc[0] += count
            acc[1] += count * nbytes
    return tuple((kind, axes, phase, count, total) for (kind, axes, phase), (count, total) in merged.items())


def to_records(merged: tuple[tuple, ...], sizes: dict[str, int]) -> list[Collective]:
    """`predicted` tuples as `Collective` records (with ring-model wire bytes)."""
    return [record(kind, axes, count, total / count if count else 0.0, phase, sizes)
            for kind, axes, phase, count, total in merged]


def collectives(m: ModelConfig, st: Strategy, shape: StepShape,
                pp_scatter_gather: bool | None = None, compiler: Compiler | str = GPU) -> list[Collective]:
    """Every predicted collective of one step, as `Collective` records merged by (kind, axes, phase)."""
    cc = COMPILERS[compiler] if isinstance(compiler, str) else compiler
    return to_records(predicted(m, st, shape, pp_scatter_gather, cc), st.sizes)
