"""The communication floor of a layout: the fewest bytes one device must send per training step.

`floor(m, st, shape)` writes out, per layout kind, what the parallelism itself obliges a device to send
(ring model, as `jaxpar.collectives.wire_factor`: an all-reduce over n devices sends 2(n-1)/n of its
buffer, an all-gather, reduce-scatter or all-to-all (n-1)/n, a permute all of it), averaged over the
devices. It is the yardstick for the compiled program (experiments/bench_floor.py prints compiled wire
bytes / floor for every 8-device catalogue strategy): what a program moves above it is either a price
the implementation chose (static all-to-all buffers, an SPMD pipeline's bubble iterations) or
communication it should not do. It is *not* the cost model (jaxpar/cost/comm.py predicts what the
compiled program does, inefficiencies included); no formula here reads a compiler trait.

Per kind, per step (x = one micro-batch's residual activation on a device, mb*s_loc*d bytes in the
compute dtype; f32 gradients; e = real layer executions: a pipeline's bubble iterations excluded):

* data parallelism (ZeRO-0): the gradients of the weights replicated over the data-like axes
  (data, fsdp, context, and expert for the non-expert weights) are all-reduced once per step over all of
  them at once: 2(n-1)/n * G. The bandwidth-optimal all-reduce sends that much (Patarasuk & Yuan 2009);
  reducing axis by axis would send more.
* ZeRO-1 (Rajbhandari et al. 2020, section 7): the sharded weights' gradients reduce-scattered and the
  updated weights all-gathered, (n-1)/n each (their 2Psi, as DP's); the embedding's gradient may instead
  come back by the lookup's route (row gradients all-to-all'd to the rows' owners, token ids gathered),
  whichever is fewer bytes.
* FSDP / ZeRO-3 (ibid.: 3Psi): each layer's sharded weights gathered for the forward, again for the
  backward (the weights are freed in between: that is the layout) and the gradients reduce-scattered,
  (n-1)/n each; under a pipeline a stage gathers its weights once per step and keeps them across its
  micro-batches (jaxpar/pipeline/gpipe.py), forward only. Head and final norm: gathered once (they are used at
  the forward's end and the backward's start); so are the layers' norm weights (a vector each: kept
  gathered for the backward, models/layers.py). Embedding table: gathered + gradient reduce-scattered,
  or looked up where it lies (ids gathered, rows all-to-all'd forward and their gradients backward),
  whichever is fewer. Over the data-like axes beyond fsdp the shards' gradients are all-reduced.
* tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022): per attention layer one sum of x
  after o-proj and one after the MLP forward, and one for q,k,v's and one for gate,up's input gradients
  backward: 4 sums, each 2(t-1)/t * x (an all-reduce, or under SP an all-gather plus a reduce-scatter,
  the same bytes); remat `full` reruns the attention sum (SP: both gathers and the attention scatter),
  the `dots` policies under SP the two gathers (no dot outputs). Mamba-2 layer: 2 sums (out_proj
  forward, in_proj's input gradient backward). MoE layer: the attention half's 2, the experts' combined
  output forward and the tokens' gradient at the kernel backward, plus the combine weights' gradient
  [tokens, k] f32 (the experts' outputs are partial sums over tensor). Vocab-parallel embedding and
  head: the embedding output's sum, the head input's gradient sum, and Megatron's three [tokens] f32
  softmax reductions (max, sum of exponentials, the label's logit). Under SP the norm weights'
  gradients are summed over tensor.
* context parallelism (Liu et al. 2023): per attention layer K and V blocks travel c-1 hops forward
  and dK, dV c-1 hops backward (an all-gather of K,V and a reduce-scatter of dK,dV send the same);
  Mamba-2: the conv halo permuted and the segment states gathered, and their transposes.
* expert parallelism: per MoE layer two all-to-alls forward (dispatch, combine) and two backward, each
  carrying only the routed copies, tokens*k*d (Megatron's dropless dispatcher; jaxpar's static buffers
  carry E/k times more: `jaxpar.ops.moe`), (e-1)/e of them leaving the device; the router statistics
  (2E f32) summed over the batch axes.
* pipeline parallelism (Narayanan et al. 2021): each micro-batch's activation crosses each stage
  boundary once forward and its gradient once backward, v*S-1 boundaries with v chunks per device
  (under SP split over tensor); averaged over the S stages. Embedding on the first stage, head and final
  norm on the last: their work and gradient reduction are shared out over the stages in the average.
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
    vectors = unit_norms(m)[0] * m.units / s if dense else 0.0   # the layers' norm weights: gathered once
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
