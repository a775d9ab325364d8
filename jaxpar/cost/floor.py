"""The communication floor of a layout: the fewest bytes one device must send per training step.

`floor(m, st, shape)` writes out, per layout kind, what the parallelism itself obliges a device to send
(ring model, as `jaxpar.collectives.wire_factor`), averaged over the devices: data parallelism's gradient
all-reduce once per step over every data-like axis at once (Patarasuk & Yuan 2009); ZeRO-1's reduce-scatter
and gather, and ZeRO-3's gathers forward and backward with the reduce-scatter (Rajbhandari et al. 2020,
sec. 7: 2 and 3 Psi); tensor parallelism's four sums per attention layer (Shoeybi et al. 2019; Korthikanti
et al. 2022); context parallelism's c-1 K/V hops each way (Liu et al. 2023); expert parallelism's routed
copies only; pipeline parallelism's boundary crossings (Narayanan et al. 2021). It is the yardstick for the
compiled program (experiments/bench_floor.py prints compiled wire bytes / floor per catalogue strategy),
not the cost model (comm.py predicts what the program does, inefficiencies included); no formula here
reads a compiler trait. docs/cost-model.md ("The communication floor") has each kind at length.
"""
from __future__ import annotations

from jaxpar.cost.held import DATA_LIKE, held, unit_norms
from jaxpar.cost.memory import ACTIVATION_BYTES, GRAD_BYTES, PARAM_BYTES, TOKEN_BYTES
from jaxpar.cost.params import attention_block_params, layer_counts, mamba_block_params, mamba_dims, zero_rules
from jaxpar.cost.shape import StepShape
from jaxpar.models.config import ModelConfig
from jaxpar.core.strategy import Strategy

KINDS = ("data", "zero1", "fsdp", "tensor", "context", "expert", "pipeline")


def _ar(n: int) -> float:
    """Bytes sent per buffer byte by a ring all-reduce over n devices."""
    return 2 * (n - 1) / n


def _share(n: int) -> float:
    """... by an all-gather, reduce-scatter or all-to-all over n devices."""
    return (n - 1) / n


def _real(shape: StepShape) -> float:
    """The fraction of a pipeline's layer executions that carry a micro-batch (bubbles excluded)."""
    return shape.repeats * shape.micro / shape.iterations if shape.stages > 1 else 1.0


def _tokens(shape: StepShape) -> float:
    """Tokens one device embeds / feeds the head per step (a pipeline group's, shared out over its stages)."""
    return shape.b_loc * shape.s_loc / shape.stages


def _lookup(m: ModelConfig, shape: StepShape, n: int, act: int, forward: bool) -> float:
    """The embedding looked up where its model-dim shards lie (n of them): every token id gathered, the
    rows all-to-all'd to batch sharding (if `forward`) and their gradients back."""
    t = _tokens(shape)
    return _share(n) * (n * t * TOKEN_BYTES + (1 + forward) * t * m.d_model * act)


def _weights(m: ModelConfig, st: Strategy, shape: StepShape, act: int, experts: bool | None) -> dict[str, float]:
    """Data parallelism, ZeRO-1 and FSDP for the weights `experts` selects (see the module docstring)."""
    axes = tuple(a for a in DATA_LIKE if st.sizes[a] > 1 and not (experts and a == "expert"))
    n_all, s = st.group(axes), shape.stages
    dense = experts is not True

    def per_device(h) -> float:   # layers per stage; embedding, head, final norm shared out over the stages
        return h.layers + h.emb / s

    if st.zero == 0 or not axes:
        return {"data": _ar(n_all) * per_device(held(m, st, experts=experts)) * GRAD_BYTES}
    purpose = "optimizer" if st.zero == 1 else "params"
    shard = tuple(a for a in zero_rules(st.zero, purpose)["embed"] if a in axes)
    n, rest = st.group(shard), st.group(tuple(a for a in axes if a not in shard))
    z, kept = held(m, st, "zero", experts), held(m, st, "kept", experts)
    out = {"data": _ar(n_all) * per_device(kept) * GRAD_BYTES + _ar(rest) * per_device(z) / n * GRAD_BYTES}
    table = m.vocab * m.d_model / st.sizes["tensor"] / s if dense else 0.0   # the embedding table, in z.emb
    if st.zero == 1:
        reduce = _share(n) * (per_device(z) - table) * GRAD_BYTES
        reduce += min(_share(n) * table * GRAD_BYTES, _lookup(m, shape, n, act, forward=False)) if dense else 0.0
        out["zero1"] = reduce + _share(n) * per_device(z) * PARAM_BYTES
        return out
    gathers = 2 * shape.accum if s == 1 else 1
    others = z.emb / s - table   # head and final norm
    norms = sum(e * n for (e, _), n in zip(unit_norms(m), m.run_units))   # the layers' norm weights: gathered once
    vectors = norms / s if dense else 0.0
    once = shape.accum if s == 1 else 1
    out["fsdp"] = (_share(n) * (gathers * (z.layers - vectors) * act + once * vectors * act + z.layers * GRAD_BYTES
                                + others * (shape.accum * act + GRAD_BYTES))
                   + (min(_share(n) * table * (act + GRAD_BYTES), _lookup(m, shape, n, act, forward=True))
                      if dense else 0.0))
    return out


def _tensor(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> float:
    t, o = st.sizes["tensor"], st.options
    sp, r = o.sequence_parallel, _real(shape)
    x = shape.mb * shape.s_loc * m.d_model * act
    sums = 0.0   # activation-sized sums (2(t-1)/t x each) over the step
    # remat: the attention sum again (SP: two gathers and a scatter, half a sum each); under SP the
    # `dots` policies regather the two norm outputs (no dot outputs)
    attn_remat = (1.5 if sp else 1.0) if o.remat == "full" else (1.0 if sp and o.remat != "none" else 0.0)
    sums += shape.exec_attention * r * (4 + attn_remat)
    sums += shape.exec_mamba * r * (2 + (0.5 if sp and o.remat != "none" else 0))
    moe = shape.exec_moe * r
    sums += moe * (4 + attn_remat + (2 if m.shared_experts else 0) + (0.5 if sp and o.remat != "none" else 0))
    out = _ar(t) * x * sums + moe * _ar(t) * shape.mb * shape.s_loc * m.top_k * 4
    tokens = _tokens(shape)
    out += _ar(t) * tokens * (2 * m.d_model * act + 3 * 4)   # embedding output, head input gradient, softmax
    if sp:
        na, nm = layer_counts(m)
        reps = (na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated
                + m.moe_layers * 2 * m.d_model) / shape.stages + m.d_model / shape.stages
        out += _ar(t) * reps * GRAD_BYTES
    return out


def _context(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> float:
    c, t, r = st.sizes["context"], st.sizes["tensor"], _real(shape)
    passes = 2 if st.options.remat == "full" else 1
    kv = shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act
    out = (shape.exec_attention + shape.exec_moe) * r * (c - 1) * 2 * kv * (passes + 1)
    if shape.exec_mamba:
        segs = 2 if st.options.cp_layout == "zigzag" else 1
        _, conv_dim, heads = mamba_dims(m)
        halo = shape.mb * (m.d_conv - 1) * conv_dim / t * act * segs
        state = shape.mb * segs * heads / t * (m.ssm_head_dim * m.d_state + 1) * 4 * c
        out += shape.exec_mamba * r * (halo * (passes + 1) + _share(c) * state * (passes + 1))
    return out


def _expert(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> float:
    e, moe = st.sizes["expert"], shape.exec_moe * _real(shape)
    a2a = (6 if st.options.remat == "full" else 4) * _share(e) * shape.mb * shape.s_loc * m.top_k * m.d_model * act
    return moe * (a2a + _ar(st.group(DATA_LIKE)) * 2 * m.experts * 4)


def _pipeline(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> float:
    s, sp = shape.stages, st.options.sequence_parallel
    x = shape.mb * shape.s_loc * m.d_model * act / (st.sizes["tensor"] if sp else 1)
    return 2 * shape.accum * shape.micro * (shape.repeats * s - 1) / s * x


def floor(m: ModelConfig, st: Strategy, shape: StepShape) -> dict[str, float]:
    """Bytes one device must send per step, by layout kind (KINDS; kinds the strategy lacks are absent)."""
    act = ACTIVATION_BYTES[st.options.dtype]
    sz, out = st.sizes, {}
    if m.moe_layers and sz["expert"] > 1:
        parts = [_weights(m, st, shape, act, False), _weights(m, st, shape, act, True)]
    else:
        parts = [_weights(m, st, shape, act, None)]
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    if sz["tensor"] > 1:
        out["tensor"] = _tensor(m, st, shape, act)
    if sz["context"] > 1:
        out["context"] = _context(m, st, shape, act)
    if shape.exec_moe and (sz["expert"] > 1 or any(sz[a] > 1 for a in DATA_LIKE)):
        out["expert"] = _expert(m, st, shape, act)
    if sz["pipeline"] > 1:
        out["pipeline"] = _pipeline(m, st, shape, act)
    return {k: v for k, v in out.items() if v}


def total(m: ModelConfig, st: Strategy, shape: StepShape) -> float:
    """The floor summed over kinds: bytes per device per step."""
    return sum(floor(m, st, shape).values())
