"""Predicted collectives of one training step: kind x mesh axes x phase, per device.

Records are the HLO tally's own `jaxpar.hlo.Collective` (kind, axes, count, bytes, wire_bytes, phase),
so a prediction and the compiled program's tally compare field by field. `bytes` is the full
(gathered / pre-scatter / reduced) buffer of each instance, summed over instances; `wire_bytes` is
what one device sends under the ring algorithm (scaling book, "All about sharding"; Thakur et al. 2005):
    all-gather, reduce-scatter, all-to-all   (n-1)/n * bytes
    all-reduce                              2(n-1)/n * bytes
    collective-permute                      bytes
Each parallelism has one small function below, so a formula is easy to adjust once it is checked
against the compiled HLO. Counts multiply layer executions (scan and pipeline trip counts included).
Recomputed forward collectives (remat `full`) are tallied under `backward`.
"""
from __future__ import annotations

from jaxpar.cost.memory import DTYPE_BYTES, GRAD_BYTES, PARAM_BYTES
from jaxpar.cost.params import (attention_block_params, embedding_params, layer_counts, mamba_block_params,
                                mamba_dims)
from jaxpar.cost.shape import StepShape
from jaxpar.hlo import Collective, wire_factor  # the HLO tally's record and ring model: shared
from jaxpar.strategy import Strategy
from models.config import ModelConfig

AR, AG, RS, A2A, PERMUTE = "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
DATA_LIKE = ("data", "fsdp", "context", "expert")  # axes over which (non-expert) weights are replicated


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

def tp_layer(st: Strategy, per_layer: int, execs: float, nbytes: float) -> list[tuple]:
    """`per_layer` all-reduces of the residual activation forward and as many backward; with sequence
    parallelism each all-reduce becomes an all-gather + a reduce-scatter of the same full buffer."""
    kinds = (AG, RS) if st.options.sequence_parallel else (AR,)
    out = []
    for phase in _passes(st) + ("backward",):
        out += [(k, ("tensor",), per_layer * execs, nbytes, phase) for k in kinds]
    return out


def tp_vocab(st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """Vocab-sharded embedding and head, once per accumulation step (head outside the pipeline):
    forward the embedding output is summed over `tensor` (SP: reduce-scattered), the head input is
    gathered under SP, and the softmax max and sum-exp are all-reduced (2 x T*4 bytes); backward the
    head input gradient is all-reduced (SP: reduce-scattered) and, under SP, the embedding grad gathered."""
    tokens = shape.b_loc / shape.accum * shape.s_loc
    x, n = tokens * m.d_model * act, shape.accum
    sp = st.options.sequence_parallel
    out = [(RS if sp else AR, ("tensor",), n, x, "forward"), (AR, ("tensor",), 2 * n, tokens * 4, "forward"),
           (RS if sp else AR, ("tensor",), n, x, "backward")]
    if sp:
        out += [(AG, ("tensor",), n, x, "forward"), (AG, ("tensor",), n, x, "backward")]
    return out


def tensor_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """Attention layer: 2 per pass (after o-proj, after MLP down); Mamba-2 layer: 1 (after out_proj)."""
    x = shape.mb * shape.s_loc * m.d_model * act
    out = tp_layer(st, 2, shape.exec_attention, x) if shape.exec_attention else []
    out += tp_layer(st, 1, shape.exec_mamba, x) if shape.exec_mamba else []
    out += tp_vocab(st, shape, m, act)
    if st.options.sequence_parallel:  # norm weights see sequence shards: their grads are summed
        na, nm = layer_counts(m)
        reps = na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated
        out.append((AR, ("tensor",), 1, (reps / shape.stages + m.d_model) * GRAD_BYTES, "backward"))
    return out


# ---- context parallelism --------------------------------------------------------------------------

def context_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """Attention, ring (Liu et al. 2023): context-1 permutes of the local K,V block forward and of dK,dV
    backward; all-gather (or dense): all-gather K,V forward, reduce-scatter dK,dV backward.
    Mamba-2 (assumed kernel): permute the conv halo ((d_conv-1) tokens) and all-gather every shard's
    final SSM state (b*d_inner*d_state/t float32) forward; the transposes backward."""
    c, t = st.sizes["context"], st.sizes["tensor"]
    out: list[tuple] = []
    if shape.exec_attention:
        kv = 2 * shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act
        for phase in _passes(st):
            if st.options.attention == "ring":
                out.append((PERMUTE, ("context",), (c - 1) * shape.exec_attention, kv, phase))
            else:
                out.append((AG, ("context",), shape.exec_attention, kv * c, phase))
        if st.options.attention == "ring":
            out.append((PERMUTE, ("context",), (c - 1) * shape.exec_attention, kv, "backward"))
        else:
            out.append((RS, ("context",), shape.exec_attention, kv * c, "backward"))
    if shape.exec_mamba:
        _, conv_dim, _ = mamba_dims(m)
        halo = shape.mb * (m.d_conv - 1) * conv_dim / t * act
        state = shape.mb * m.d_inner * m.d_state / t * 4
        for phase in _passes(st):
            out += [(PERMUTE, ("context",), shape.exec_mamba, halo, phase),
                    (AG, ("context",), shape.exec_mamba, state * c, phase)]
        out += [(PERMUTE, ("context",), shape.exec_mamba, halo, "backward"),
                (RS, ("context",), shape.exec_mamba, state * c, "backward")]
    return out


# ---- pipeline parallelism -------------------------------------------------------------------------

def pipeline_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int,
                      scatter_gather: bool | None = None) -> list[tuple]:
    """One collective-permute of the stage state (a micro-batch's residual stream) per schedule
    iteration forward, and its transpose backward (GPipe M+S-1, circular v*M+S-1 iterations).
    The state is split over `tensor` under SP; with Megatron's scatter/gather (Narayanan 2021, 4.1)
    it is split for the send and all-gathered over `tensor` on arrival."""
    sp = st.options.sequence_parallel
    split = sp or (scatter_gather is True)
    x = shape.mb * shape.s_loc * m.d_model * act
    n = shape.iterations * shape.accum
    sent = x / st.sizes["tensor"] if split else x
    out = [(PERMUTE, ("pipeline",), n, sent, "forward"), (PERMUTE, ("pipeline",), n, sent, "backward")]
    if split and not sp and st.sizes["tensor"] > 1:
        out += [(AG, ("tensor",), n, x, "forward"), (AG, ("tensor",), n, x, "backward")]
    return out


# ---- data parallelism, ZeRO-1, FSDP (ZeRO-3) ---------------------------------------------------------

def _local_params(m: ModelConfig, st: Strategy) -> tuple[float, float, int, int]:
    """(layer params, embedding+head params) per device after tensor and pipeline splits, and tensor counts."""
    t, s = st.sizes["tensor"], st.sizes["pipeline"]
    a, mb, e = attention_block_params(m), mamba_block_params(m), embedding_params(m)
    na, nm = layer_counts(m)
    layers = (na * a.per_device(t) + nm * mb.per_device(t)) / s
    tensors = (a.tensors if na else 0) + (mb.tensors if nm else 0)
    return layers, e.per_device(t), tensors, e.tensors


def data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """ZeRO-0: all-reduce float32 grads over the data-like axes once per step (one per weight array).
    ZeRO-1: reduce-scatter grads over data x fsdp, all-gather updated float32 params after the update.
    ZeRO-3 / FSDP: per layer execution all-gather params (compute dtype) forward and backward and
    reduce-scatter grads over fsdp; then all-reduce the shards over the remaining data-like axes."""
    sz, zero = st.sizes, st.zero
    layers, emb, n_layer_t, n_emb_t = _local_params(m, st)
    n_tensors, full = n_layer_t + n_emb_t, layers + emb
    if zero == 3 and sz["fsdp"] > 1:
        rest = tuple(a for a in DATA_LIKE if a != "fsdp" and sz[a] > 1)
        out: list[tuple] = []
        for execs, block in ((shape.exec_attention, attention_block_params(m)),
                             (shape.exec_mamba, mamba_block_params(m))):
            if execs:
                p, tensors = block.per_device(sz["tensor"]), block.tensors
                out += [(AG, ("fsdp",), execs * tensors, p * act / tensors, "forward"),
                        (AG, ("fsdp",), execs * tensors, p * act / tensors, "backward"),
                        (RS, ("fsdp",), execs * tensors, p * GRAD_BYTES / tensors, "backward")]
        out += [(AG, ("fsdp",), shape.accum * n_emb_t, emb * act / n_emb_t, "forward"),
                (AG, ("fsdp",), shape.accum * n_emb_t, emb * act / n_emb_t, "backward"),
                (RS, ("fsdp",), shape.accum * n_emb_t, emb * GRAD_BYTES / n_emb_t, "backward")]
        if rest:
            out.append((AR, rest, n_tensors, full / sz["fsdp"] * GRAD_BYTES / n_tensors, "backward"))
        return out
    axes = tuple(a for a in DATA_LIKE if sz[a] > 1)
    if not axes:
        return []
    if zero == 1:
        shard = tuple(a for a in ("data", "fsdp") if sz[a] > 1)
        rest = tuple(a for a in axes if a not in shard)
        out = [(RS, shard, n_tensors, full * GRAD_BYTES / n_tensors, "backward"),
               (AG, shard, n_tensors, full * PARAM_BYTES / n_tensors, "optimizer")] if shard else []
        if rest:
            out.append((AR, rest, n_tensors, full * GRAD_BYTES / n_tensors, "backward"))
        return out
    return [(AR, axes, n_tensors, full * GRAD_BYTES / n_tensors, "backward")]


# ---- all of it ---------------------------------------------------------------------------------------

def predicted(m: ModelConfig, st: Strategy, shape: StepShape,
              pp_scatter_gather: bool | None = None) -> tuple[tuple, ...]:
    """Every predicted collective of one step as (kind, axes, phase, count, total bytes), merged by
    (kind, axes, phase). Plain tuples: the time model reads them thousands of times per second."""
    sz = st.sizes
    act = DTYPE_BYTES[st.options.dtype]
    raw = data_parallel(m, st, shape, act)
    if sz["tensor"] > 1:
        raw += tensor_parallel(m, st, shape, act)
    if sz["context"] > 1:
        raw += context_parallel(m, st, shape, act)
    if sz["pipeline"] > 1:
        raw += pipeline_parallel(m, st, shape, act, pp_scatter_gather)
    merged: dict[tuple, list[float]] = {}
    for kind, axes, count, nbytes, phase in raw:
        acc = merged.setdefault((kind, axes, phase), [0.0, 0.0])
        acc[0] += count
        acc[1] += count * nbytes
    return tuple((kind, axes, phase, count, total) for (kind, axes, phase), (count, total) in merged.items())


def to_records(merged: tuple[tuple, ...], sizes: dict[str, int]) -> list[Collective]:
    """`predicted` tuples as `Collective` records (with ring-model wire bytes)."""
    return [record(kind, axes, count, total / count if count else 0.0, phase, sizes)
            for kind, axes, phase, count, total in merged]


def collectives(m: ModelConfig, st: Strategy, shape: StepShape,
                pp_scatter_gather: bool | None = None) -> list[Collective]:
    """Every predicted collective of one step, as `Collective` records merged by (kind, axes, phase)."""
    return to_records(predicted(m, st, shape, pp_scatter_gather), st.sizes)
