"""Bytes per device: parameters, gradients, optimizer state, activations.

Model and optimizer state (ZeRO: Rajbhandari et al. 2020; mixed precision as in DESIGN.md -- the
stored parameters are the float32 master weights, the compute dtype is a cast):
    params      4 bytes/param  (float32 master; the master copy *is* the parameter, not counted twice)
    grads       4 bytes/param  (gradients w.r.t. the float32 parameters)
    optimizer   8 bytes/param  (AdamW first and second moments, float32)
Sharding: `tensor` splits the sharded part of each block (params.py), `pipeline` splits the layers;
ZeRO-0 replicates everything over the data axes; ZeRO-1 shards the optimizer state over data x fsdp;
ZeRO-3 shards params, grads and optimizer state over fsdp.

Activations: an inventory of the tensors one layer keeps for its backward pass, per token, in the
compute dtype (dropout masks 1 byte), each marked as split by the tensor axis or replicated over it
(sequence parallelism splits the replicated ones too), and the remat policies under which it is kept.
For GPT shapes with dropout in fp16 the inventory is exactly Korthikanti et al. 2022, section 4
(see `korthikanti_layer_bytes`). Pipelines keep activations of in-flight micro-batches: GPipe (and the
circular schedule, which is GPipe over v*S virtual stages) holds all M; 1F1B holds S.
"""
from __future__ import annotations

import dataclasses

from jaxpar.cost.params import embedding_params, layer_counts, layer_params, mamba_dims, per_model
from jaxpar.strategy import Strategy
from models.config import ModelConfig

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

def local_params(m: ModelConfig, st: Strategy) -> float:
    """Parameters held by one device: layers / pipeline, sharded part / tensor, all / fsdp under ZeRO-3."""
    sz = st.sizes
    n = layer_params(m).per_device(sz["tensor"]) / sz["pipeline"] + embedding_params(m).per_device(sz["tensor"])
    return n / sz["fsdp"] if st.zero == 3 else n


def state_bytes(m: ModelConfig, st: Strategy) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device under the strategy's ZeRO stage."""
    n = local_params(m, st)
    opt_shard = st.sizes["data"] * st.sizes["fsdp"] if st.zero == 1 else 1
    return n * PARAM_BYTES, n * GRAD_BYTES, n * ADAM_BYTES / opt_shard


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
    """Micro-batches whose activations are alive at the peak: GPipe/circular M, 1F1B min(M, S)."""
    if stages == 1:
        return 1
    return min(microbatches, stages) if schedule == "1f1b" else microbatches


def keys_per_query(st: Strategy, seq: int) -> float:
    """Keys one query's scores span on a device: ring attention holds one K/V block (s/c), else all s."""
    return seq / st.sizes["context"] if st.options.attention == "ring" else seq


def activation_bytes(m: ModelConfig, st: Strategy, global_batch: int, seq: int, dropout: bool = False,
                     one_f_one_b: bool = False) -> float:
    """Activation bytes per device at the peak of the backward pass.

    stored = in-flight micro-batches x sum over this stage's layers of (kept bytes per token x tokens)
           + one layer's full inventory while it is recomputed (remat `full`)
           + float32 logits of one accumulation step, b*s*V/t*4 bytes (head outside the pipeline)."""
    sz, o = st.sizes, st.options
    act = DTYPE_BYTES[o.dtype]
    t, stages = sz["tensor"], sz["pipeline"]
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"]) / o.grad_accum
    micro = o.microbatches if stages > 1 else 1
    tokens = b_loc / micro * seq / sz["context"]
    remat = o.remat
    na, nm = layer_counts(m)
    attn = attention_inventory(m, keys_per_query(st, seq), dropout) if na else ()
    mamba = mamba_inventory(m) if nm else ()
    per_layer = (na * inventory_bytes(attn, act, t, o.sequence_parallel, remat)
                 + nm * inventory_bytes(mamba, act, t, o.sequence_parallel, remat)) / stages
    stored = inflight_microbatches("1f1b" if one_f_one_b else o.pp_schedule, micro, stages) * per_layer * tokens
    transient = 0.0
    if remat == "full":
        transient = tokens * max(inventory_bytes(attn, act, t, o.sequence_parallel, "none"),
                                 inventory_bytes(mamba, act, t, o.sequence_parallel, "none"))
    logits = b_loc * seq / sz["context"] * m.vocab / t * LOGIT_BYTES
    return stored + transient + logits


def memory(m: ModelConfig, st: Strategy, global_batch: int, seq: int, dropout: bool = False,
           one_f_one_b: bool = False) -> Memory:
    params, grads, opt = state_bytes(m, st)
    return Memory(params, grads, opt, activation_bytes(m, st, global_batch, seq, dropout, one_f_one_b))


def recomputed_bytes(inv: tuple[tuple, ...], act_bytes: int, tensor: int, sp: bool, policy: str) -> float:
    """Bytes per token a layer produces again in its backward pass: what `none` keeps and `policy` drops."""
    total = 0.0
    for _name, elems, nbytes, split, kept in inv:
        if "none" in kept and policy not in kept:
            total += elems * (nbytes or act_bytes) / (tensor if (split or sp) else 1)
    return total
