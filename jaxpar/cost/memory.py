"""Bytes per device: parameters, gradients, optimizer state, activations.

Model and optimizer state (ZeRO: Rajbhandari et al. 2020; mixed precision as in docs/design.md -- the
stored parameters are the float32 master weights, the compute dtype is a cast):
    params      4 bytes/param  (float32 master; the master copy *is* the parameter, not counted twice)
    grads       4 bytes/param  (gradients w.r.t. the float32 parameters)
    optimizer   8 bytes/param  (AdamW first and second moments, float32)
Sharding: `tensor` splits the sharded part of each block (params.py), `pipeline` splits the layers;
ZeRO-0 replicates everything over the data axes; ZeRO-1 shards the optimizer state over data x fsdp;
ZeRO-3 shards params, grads and optimizer state over fsdp -- each only for the weights the rules table
shards (those with an `embed` dim: not Mamba-2's conv, A_log, dt_bias, D and gate norm; params.py).

Activations: an inventory of the tensors one layer keeps for its backward pass, per token, in the
compute dtype (dropout masks 1 byte), each marked as split by the tensor axis or replicated over it
(sequence parallelism splits the replicated ones too), and the remat policies under which it is kept.
For GPT shapes with dropout in fp16 the inventory is exactly Korthikanti et al. 2022, section 4
(see `korthikanti_layer_bytes`). Pipelines keep activations of in-flight micro-batches: GPipe (and the
circular schedule, which is GPipe over v*S virtual stages) holds all M; 1F1B holds S.

jaxpar's own program (`jax_program=True`, what `estimate` uses for the jaxpar software preset) keeps
what JAX's autodiff saves for models/ instead (`jax_attention_inventory`, `jax_mamba_inventory`), plus
one layer's backward working set; checked against XLA's memory analysis in tests/test_cost_vs_xla.py.
"""
from __future__ import annotations

import dataclasses
import math

from jaxpar.cost.flops import expert_rows
from jaxpar.cost.inventory_jax import (BOOL, F32, attention_half, jax_attention_inventory, jax_mamba_inventory,
                                      jax_moe_inventory)
from jaxpar.cost.params import block_counts, mamba_dims, per_model, zero_axes, zero_split
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
LOGIT_BYTES = 4  # logits are upcast to float32 for the loss

# remat policies under which a tensor is kept ("selective" = Korthikanti's selective recompute)
ALL = frozenset({"none", "full", "dots", "dots_no_batch", "selective"})
NONE = frozenset({"none", "selective"})
CORE = frozenset({"none"})                                   # attention core: dropped by selective
DOT = frozenset({"none", "selective", "dots", "dots_no_batch"})  # outputs of dots without batch dims
BDOT = frozenset({"none", "dots"})                            # outputs of batched dots
DOT_ONLY = frozenset({"dots", "dots_no_batch"})               # dot outputs "none" needs no copy of


@dataclasses.dataclass(frozen=True, slots=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


# ---- model and optimizer state ---------------------------------------------------------------------

def local_params(m: ModelConfig, st: Strategy, purpose: str = "params") -> float:
    """Elements one device holds of the parameters (`purpose` "params"; the gradients match them) or of
    one optimizer moment ("optimizer"): layers / pipeline, the tensor-sharded part / tensor, and the
    weights the strategy's ZeRO rules shard (params.zero_split: those with an `embed` dim) / the data
    axes they shard them over (ZeRO-3: fsdp; ZeRO-1 moments: data x fsdp)."""
    sz = st.sizes
    shards = 1
    for a in zero_axes(m, st.zero, purpose):
        shards *= sz[a]
    return _local_params(m, st.zero, purpose, sz["tensor"], sz["pipeline"], shards, sz["expert"])


@per_model
def _local_params(m: ModelConfig, zero: int, purpose: str, tensor: int, stages: int, shards: int,
                  expert: int = 1) -> float:
    """The routed experts' weights (MoE blocks) are split over `expert` as well: every expert is held
    once over the expert axis, so the memory counts all of them, E / expert per device. A ZeRO shard is
    a padded flat shard of each block: ceil(elements / shards), which equals the division whenever the
    shards divide the model dim (what the trainer needs) and counts the padding when they do not
    (Megatron's distributed optimizer pads its flat buffer to a multiple of the data-parallel size)."""
    na, nm, ne = block_counts(m)
    n = 0.0
    for block, copies in (("attention", na / stages), ("mamba", nm / stages), ("moe", ne / stages), ("embedding", 1)):
        if copies:
            sharded, kept = zero_split(m, block, zero, purpose)
            n += copies * (math.ceil(sharded.per_device(tensor, expert) / shards) + kept.per_device(tensor, expert))
    return n


def state_bytes(m: ModelConfig, st: Strategy) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device under the strategy's ZeRO stage."""
    n = local_params(m, st)
    return n * PARAM_BYTES, n * GRAD_BYTES, local_params(m, st, "optimizer") * ADAM_BYTES


# ---- activation inventories (elements per token, byte override, split by tensor?, kept under) -------

@per_model
def attention_inventory(m: ModelConfig, s_kv: float, dropout: bool = False) -> tuple[tuple, ...]:
    """One attention layer (pre-norm, GQA, MLP). `s_kv`: keys each query attends over on this device."""
    d, hq, hkv, f = m.d_model, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_dim
    sc = m.heads * s_kv
    inv = [("layer input x", d, None, False, ALL), ("norm1 out", d, None, False, NONE),
           ("q", hq, None, True, DOT), ("k", hkv, None, True, DOT), ("v", hkv, None, True, DOT),
           ("scores QK^T", sc, None, True, frozenset({"dots"})), ("softmax", sc, None, True, CORE),
           ("attention out PV", hq, None, True, frozenset({"none", "selective", "dots"})),
           ("o-proj out", d, None, False, DOT_ONLY), ("norm2 in", d, None, False, NONE),
           ("norm2 out", d, None, False, NONE), ("mlp down out", d, None, False, DOT_ONLY)]
    if m.mlp_type == "swiglu":
        inv += [("gate out", f, None, True, DOT), ("up out", f, None, True, DOT),
                ("silu(gate)", f, None, True, NONE), ("silu(gate)*up", f, None, True, NONE)]
    else:
        inv += [("gelu in", f, None, True, DOT), ("gelu out", f, None, True, NONE)]
    if dropout:
        inv += [("attn dropout mask", sc, 1, True, CORE), ("attn dropout out", sc, None, True, CORE),
                ("attn-out dropout mask", d, 1, False, NONE), ("mlp-out dropout mask", d, 1, False, NONE)]
    return tuple(inv)


@per_model
def mamba_inventory(m: ModelConfig) -> tuple[tuple, ...]:
    """One Mamba-2 layer (Dao & Gu 2024): in_proj output, conv, SSD intermediates, gated norm."""
    d, di = m.d_model, m.d_inner
    d_in_proj, conv_dim, nh = mamba_dims(m)
    q = m.chunk
    return (("layer input x", d, None, False, ALL), ("norm out", d, None, False, NONE),
            ("in_proj out zxBCdt", d_in_proj, None, True, DOT), ("conv out", conv_dim, None, True, NONE),
            ("silu(conv) x,B,C", conv_dim, None, True, NONE), ("dt, dA cumsum", 2 * nh, 4, True, NONE),
            ("C B^T", m.ngroups * q, None, True, BDOT), ("decay L", nh * q, None, True, NONE),
            ("chunk states", di * m.d_state / q, None, True, BDOT), ("ssd y", di, None, True, BDOT),
            ("gated norm in/out", 2 * di, None, True, NONE), ("out_proj out", d, None, False, DOT_ONLY))


@per_model
def moe_inventory(m: ModelConfig, s_kv: float, rows: float, dropout: bool = False) -> tuple[tuple, ...]:
    """One MoE layer as a PyTorch implementation keeps it (Megatron-style grouped experts): the attention
    half, the float32 router logits and probabilities, and per expert row (`rows` per token: the k
    routed copies) its input, gate and up, SwiGLU's pieces and its output (which the router weights'
    gradient reads); shared experts as an MLP of width shared * f_e."""
    d, f, e, sf = m.d_model, m.moe_mlp_dim, m.experts, m.shared_experts * m.moe_mlp_dim
    inv = [*attention_half(attention_inventory(m, s_kv, dropout)),
           ("router logits, probabilities (float32)", 2 * e, 4, False, NONE),
           ("expert input copies", rows * d, None, False, DOT), ("expert gate, up out", 2 * rows * f, None, True, DOT),
           ("expert silu(gate), silu*up", 2 * rows * f, None, True, NONE),
           ("expert outputs", rows * d, None, False, DOT)]
    if sf:
        inv += [("shared gate, up out", 2 * sf, None, True, DOT), ("shared silu(gate), silu*up", 2 * sf, None, True, NONE)]
    return tuple(inv)


@per_model  # memoised on the inventory's identity (inventories are memoised per model, so they repeat)
def inventory_bytes(inv: tuple[tuple, ...], act_bytes: int, tensor: int, sp: bool, policy: str) -> float:
    """Bytes per token kept by one layer: sum of kept tensors, split ones / tensor (all of them with SP)."""
    total = 0.0
    for _name, elems, nbytes, split, kept in inv:
        if policy in kept:
            total += elems * (nbytes or act_bytes) / (tensor if (split or sp) else 1)
    return total


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            selective: bool = False) -> float:
    """Activation bytes per transformer layer, fp16, with dropout (Korthikanti et al. 2022, table 2):
    no parallelism s*b*h*(34 + 5*a*s/h); TP s*b*h*(10 + 24/t + 5*a*s/(h*t)); TP+SP s*b*h*(34/t + 5*a*s/(h*t));
    TP+selective s*b*h*(10 + 24/t); TP+SP+selective 34*s*b*h/t."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + core)


# ---- activations of one step -------------------------------------------------------------------------

def inflight_microbatches(schedule: str, microbatches: int, stages: int) -> int:
    """Micro-batches whose activations are alive at the peak: GPipe/circular M, 1F1B min(M, S) (Megatron's
    asynchronous schedule; jaxpar's lockstep 1F1B stashes stage inputs instead: `jax_1f1b_stash_bytes`)."""
    if stages == 1:
        return 1
    return min(microbatches, stages) if schedule == "1f1b" else microbatches


def jax_1f1b_stash_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int, layer_transient: float,
                         stage_kept: float = 0.0) -> tuple[float, float]:
    """(stored, transient) activation bytes per device of jaxpar's 1F1B (jaxpar/pipeline/one_f_one_b.py): stored
    are its 2vS-1 stashed stage inputs (one residual [mb, s, d] each, whatever M is), the embedding output
    and its cotangent (the batch's) and one micro-batch's lookup partial sums, and with FSDP the gathered stage weights
    (`fsdp_stage_bytes`); transient the recomputed chunk's inventory in a tick's backward: its k unit
    slots' layers under remat "none", else what the units' policy keeps of them (`stage_kept`: the stage's
    v chunks', one micro-batch) and one layer's inventory at work (jaxpar/pipeline/stages.py)."""
    sz = st.sizes
    act = DTYPE_BYTES[st.options.dtype]
    stages = sz["pipeline"]
    sched_k = _per_chunk(m, st)
    tokens = b_loc / st.options.microbatches * seq / sz["context"]
    residual = m.d_model * act / (sz["tensor"] if st.options.sequence_parallel else 1)
    repeats = st.options.pp_repeats   # interleaved 1F1B: 2vS-1 slots
    # the embedding output and its cotangent, the whole batch's (split over tensor under SP), and one
    # micro-batch's lookup partial sums at a time (jaxpar/pipeline/one_f_one_b.py looks micro-batches up in turn)
    embedding = 2 * b_loc * seq / sz["context"] * residual + tokens * m.d_model * act
    stored = (2 * stages * repeats - 1) * tokens * residual + embedding
    if st.options.remat == "none":
        return stored + fsdp_stage_bytes(m, st), layer_transient * sched_k * len(m.pattern)
    return stored + fsdp_stage_bytes(m, st), stage_kept / repeats + layer_transient


def pipeline_embedding_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int) -> float:
    """jaxpar's pipelines look the whole accumulation step's batch up at once, before the schedule: the
    vocab-parallel lookup's partial sums [b, s, d] before their reduction over `tensor` and, backward, the
    output gradient gathered for the table's scatter-add, each un-split over `tensor` (llama3-70b
    TP4 PP8 DP2, 128 sequences of 8k per device: two 32 GiB float32 buffers in XLA:CPU's peak, which
    promotes the bf16 sums). jaxpar/pipeline/one_f_one_b.py looks the micro-batches up in turn instead."""
    return 2 * b_loc * seq / st.sizes["context"] * m.d_model * DTYPE_BYTES[st.options.dtype]


def fsdp_stage_bytes(m: ModelConfig, st: Strategy) -> float:
    """With FSDP inside a jaxpar pipeline's stages: each device's gathered copy of its stage's v*k unit slots
    (compute dtype, its tensor shard) and its float32 gradient accumulator, alive the whole step."""
    from jaxpar.core.schedule import schedule_of  # noqa: PLC0415
    sz = st.sizes
    if sz["fsdp"] == 1:
        return 0.0
    sched = schedule_of(st, m.units)
    unit = 0.0
    for block, n in zip(("attention", "mamba", "moe"), block_counts(m)):
        if n:
            sharded, kept = zero_split(m, block, 3)
            unit += n / m.units * (sharded.per_device(sz["tensor"], sz["expert"]) + kept.per_device(sz["tensor"], sz["expert"]))
    return sched.repeats * sched.per_chunk * unit * (DTYPE_BYTES[st.options.dtype] + GRAD_BYTES)


def _per_chunk(m: ModelConfig, st: Strategy) -> int:
    from jaxpar.core.schedule import schedule_of  # noqa: PLC0415
    return schedule_of(st, m.units).per_chunk


def jax_pipeline_bytes(m: ModelConfig, st: Strategy, tokens: float, per_layer: float, layer_transient: float
                       ) -> tuple[float, float]:
    """(stored, transient) bytes per device of jaxpar's GPipe / circular pipeline (jaxpar/pipeline/gpipe.py), whose
    one scan runs T = v*M + S - 1 iterations, bubbles included, each rematerialised as a whole under the
    policy. Stored: what each of the T iterations saves. Under `full`, and under `dots_no_batch` too (the
    vmap over the stages gives every weight dot a batch dim, so that policy saves none of them), only the
    iteration's input, one residual [mb, s, d] (split over tensor under SP); under `none` and `dots` its
    k unit slots' inventories (`per_layer` is the stage's v*k slots'). Plus, with FSDP inside the stages,
    each device's gathered copy of its stage's v*k unit slots (compute dtype, its tensor shard) and its
    float32 gradient accumulator, alive the whole step. Transient: the recomputed chunk in an
    iteration's backward, its k unit slots' inventories (remat `none` inside the chunk). Checked against
    XLA's memory analysis of llama3-70b's top plans (`plan --verify`, tests/test_verify_scale.py)."""
    from jaxpar.core.schedule import schedule_of  # noqa: PLC0415
    sz, o = st.sizes, st.options
    sched = schedule_of(st, m.units)
    act = DTYPE_BYTES[o.dtype]
    if o.remat in ("full", "dots_no_batch"):
        stored = sched.iterations * tokens * m.d_model * act / (sz["tensor"] if o.sequence_parallel else 1)
    else:
        stored = per_layer * tokens * sched.iterations / sched.repeats
    return stored + fsdp_stage_bytes(m, st), layer_transient * sched.per_chunk * len(m.pattern)


def keys_per_query(st: Strategy, seq: int, fused: bool = False) -> float:
    """Keys one query's scores span in HBM on a device: ring attention holds one K/V block (s/c), else
    all s; a fused (flash) attention kernel none (its score tiles live in on-chip memory)."""
    if fused:
        return 0.0
    return seq / st.sizes["context"] if st.options.attention == "ring" else seq


def activation_bytes(m: ModelConfig, st: Strategy, global_batch: int, seq: int, dropout: bool = False,
                     one_f_one_b: bool = False, jax_program: bool = False, fused_attention: bool = False,
                     score_keys: float | None = None) -> float:
    """Activation bytes per device at the peak of the backward pass.

    stored = in-flight micro-batches x sum over this stage's layers of (kept bytes per token x tokens)
           + one layer's full inventory at work in the backward pass: recomputed (remat `full`) or, in
             jaxpar's program (`jax_program`), whatever the policy, because XLA copies a layer's slice of
             the stacked scan residuals out before differentiating it
           + in jaxpar's program, the float32 gradient of one layer's attention scores (d softmax and
             d scores are the largest buffers of a layer's backward), h/t*s_kv*4 bytes per token, and the
             boolean causal mask, once (dense attention; hoisted out of the layer loop)
           + float32 logits of one accumulation step, b*s*V/t*4 bytes (jaxpar's pipeline: of its stage's
             ceil(M/S) micro-batches)
           + the int32 batch (`batch_bytes`).
    `score_keys` (jaxpar's program, dense attention): the keys each query's stored scores span (default
    `seq`); 0 leaves the [heads, s, s] scores out, so the difference is what they cost
    (jaxpar.planning.planner.scores_note)."""
    sz, o = st.sizes, st.options
    act = DTYPE_BYTES[o.dtype]
    t, stages = sz["tensor"], sz["pipeline"]
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"]) / o.grad_accum
    micro = o.microbatches if stages > 1 else 1
    tokens = b_loc / micro * seq / sz["context"]
    remat, sp = o.remat, o.sequence_parallel
    na, nm, ne = block_counts(m)
    ring = o.attention == "ring" and sz["context"] > 1
    rows = expert_rows(m, seq, sz["context"], padded=jax_program)
    keys = seq if score_keys is None else score_keys
    if jax_program:
        attn = jax_attention_inventory(m, keys, sz["context"] if ring else 0) if na else ()
        mamba = jax_mamba_inventory(m) if nm else ()
        moe = jax_moe_inventory(m, keys, sz["context"] if ring else 0, rows) if ne else ()
    else:
        attn = attention_inventory(m, keys_per_query(st, seq, fused_attention), dropout) if na else ()
        mamba = mamba_inventory(m) if nm else ()
        moe = moe_inventory(m, keys_per_query(st, seq, fused_attention), rows, dropout) if ne else ()
    def stage_layers(policy: str) -> float:   # bytes per token this stage's layers keep under `policy`
        return (na * inventory_bytes(attn, act, t, sp, policy) + nm * inventory_bytes(mamba, act, t, sp, policy)
                + ne * inventory_bytes(moe, act, t, sp, policy)) / stages
    per_layer = stage_layers(remat)
    stored = inflight_microbatches("1f1b" if one_f_one_b else o.pp_schedule, micro, stages) * per_layer * tokens
    transient = 0.0
    if remat == "full" or jax_program:
        transient = tokens * max(inventory_bytes(inv, act, t, sp, "none") for inv in (attn, mamba, moe))
    if jax_program and stages > 1 and o.pp_schedule == "1f1b":   # the units' policy, in the stages' vmap
        inner = "full" if remat == "dots_no_batch" else remat        # (no dot without a batch dim there)
        stored, transient = jax_1f1b_stash_bytes(m, st, b_loc, seq, transient, stage_layers(inner) * tokens)
    elif jax_program and stages > 1:
        stored, transient = jax_pipeline_bytes(m, st, tokens, per_layer, transient)
        stored += pipeline_embedding_bytes(m, st, b_loc, seq)
    in_shard_map = sz["expert"] > 1 or sz["context"] > 1 or t > 1   # jaxpar.ops.moe.moe_experts
    if jax_program and ne and remat == "none" and st.zero == 3 and sz["fsdp"] > 1 and stages == 1 and in_shard_map:
        stored += ne * fsdp_experts_bytes(m, st)
    scores = 0.0
    if jax_program and (na or ne) and not ring:  # per token: h/t queries heads x s keys
        scores = tokens * m.heads / t * keys * (F32 + BOOL)
    logits = b_loc * seq / sz["context"] * m.vocab / t * LOGIT_BYTES
    if jax_program and stages > 1:  # jaxpar/pipeline/gpipe.py: each stage the head of ceil(M/S) micro-batches
        logits *= 1 / (micro * stages) if o.pp_schedule == "1f1b" else -(-micro // stages) / micro   # 1F1B: 1/S of one
    return stored + transient + scores + logits + batch_bytes(st, global_batch, seq)


def fsdp_experts_bytes(m: ModelConfig, st: Strategy) -> float:
    """Per MoE layer, jaxpar's program under ZeRO-3 without remat: the routed experts' weights gathered over
    fsdp (float32, as stored) are the expert kernel's shard_map operands, which its transpose reads, so
    every layer's gathered copy lives until the backward pass (seen in XLA's memory analysis: moe-tiny
    d_model=128, fsdp=4 x expert=2; jaxpar/cost/comm_data._fsdp_gathers: not gathered again backward).
    Dense weights, and the experts where the kernel runs without shard_map (fsdp alone), are gathered
    again in the backward pass instead. (A program fix would re-gather them too: the gather happens where
    the layer scan slices the stacked weights, outside any region a jax.checkpoint around the kernel
    controls; tried, not done.)"""
    routed, _ = zero_split(m, "moe", 3, experts=True)
    return routed.per_device(st.sizes["tensor"], st.sizes["expert"]) * F32


def batch_bytes(st: Strategy, global_batch: int, seq: int) -> float:
    """The step's input: token ids, labels and positions, int32, for this device's rows
    (batch over data x fsdp x expert, sequence over context; replicated over tensor and pipeline)."""
    sz = st.sizes
    return 3 * 4 * global_batch / (sz["data"] * sz["fsdp"] * sz["expert"]) * seq / sz["context"]


def memory(m: ModelConfig, st: Strategy, global_batch: int, seq: int, dropout: bool = False,
           one_f_one_b: bool = False, jax_program: bool = False, fused_attention: bool = False) -> Memory:
    params, grads, opt = state_bytes(m, st)
    return Memory(params, grads, opt, activation_bytes(m, st, global_batch, seq, dropout, one_f_one_b, jax_program,
                                                       fused_attention))


@per_model  # as inventory_bytes
def recomputed_bytes(inv: tuple[tuple, ...], act_bytes: int, tensor: int, sp: bool, policy: str) -> float:
    """Bytes per token a layer produces again in its backward pass: what `none` keeps and `policy` drops."""
    total = 0.0
    for _name, elems, nbytes, split, kept in inv:
        if "none" in kept and policy not in kept:
            total += elems * (nbytes or act_bytes) / (tensor if (split or sp) else 1)
    return total
