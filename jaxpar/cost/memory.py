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

This is the textbook accounting; jaxpar's own program keeps what JAX's autodiff saves and what XLA's
buffers hold instead: jaxpar/cost/program_memory.py states those adjustments.
"""
from __future__ import annotations

import dataclasses
import math

from jaxpar.cost.flops import expert_rows, unit_policy
from jaxpar.cost.params import block_counts, mamba_dims, per_model, zero_axes, zero_split
from jaxpar.core.schedule import ZERO_BUBBLE
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

# Bytes per element of what a step keeps in its compute dtype: activations, gathered weights, the KV cache
# (a float8 step keeps them in bf16 and casts per matmul: estimate.GEMM_OPERAND_BYTES has its operands)
ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2, "float8": 2}
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
GRADIENT_BYTES = {"float32": GRAD_BYTES, "bfloat16": 2}   # per gradient element, by the strategy's grad_dtype


def grad_bytes(st: Strategy) -> int:
    """Bytes per gradient element as the step accumulates and reduces them: the strategy's `grad_dtype`
    (float32 unless another stack's run reduces in bfloat16)."""
    return GRADIENT_BYTES[st.options.grad_dtype]


LOGIT_BYTES = 4  # logits are upcast to float32 for the loss
TOKEN_BYTES = 4  # int32 token ids and positions; f32 per-token statistics

# remat policies under which a tensor is kept ("selective" = Korthikanti's selective recompute)
ALL = frozenset({"none", "full", "dots", "dots_no_batch", "selective"})
NONE = frozenset({"none", "selective"})
CORE = frozenset({"none"})                                   # attention core: dropped by selective
DOT = frozenset({"none", "selective", "dots", "dots_no_batch"})  # outputs of dots without batch dims
BDOT = frozenset({"none", "dots"})                            # outputs of batched dots
DOT_ONLY = frozenset({"dots", "dots_no_batch"})               # dot outputs "none" needs no copy of

# The MLP entries of an attention inventory (this module's and jaxpar/cost/inventory_jax.py's)
MLP_ENTRIES = frozenset({"mlp down out", "gate out", "up out", "silu(gate)", "silu(gate)*up", "gelu in", "gelu out",
                         "mlp-out dropout mask", "gate, up", "silu pieces, silu*up", "gelu (tanh form) pieces"})


@dataclasses.dataclass(frozen=True, slots=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    host: float = 0.0      # in host memory, not in `total` (remat offload: `host_bytes`)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


# ---- model and optimizer state ---------------------------------------------------------------------

def local_params(m: ModelConfig, st: Strategy, purpose: str = "params", over_context: bool = False,
                 fsdp_over_context: bool = False, end_stages: bool = False) -> float:
    """Elements one device holds of the parameters (`purpose` "params"; the gradients match them) or of
    one optimizer moment ("optimizer"): layers / pipeline, the tensor-sharded part / tensor, and the
    weights the strategy's ZeRO rules shard (params.zero_split: those with an `embed` dim) / the data
    axes they shard them over (ZeRO-3: fsdp; ZeRO-1 moments: data x fsdp), and over `context` too where
    the stack shards its state over the context ranks (`over_context`: Software.state_over_context).
    A stack whose FSDP spans the context ranks (`fsdp_over_context`: Software.fsdp_over_context) shards
    the whole state over them even with no data-parallel shard axis: ZeRO-3 over `context` alone (those
    parameter gathers are not priced in the step time). `end_stages`: the stack places the embedding on
    the first pipeline stage and the head on the last (`embedding_copies`)."""
    sz = st.sizes
    zero, shards = st.zero, 1
    axes = zero_axes(m, zero, purpose)
    if fsdp_over_context and not axes and sz["context"] > 1:
        zero, axes = 3, ("context",)
    elif over_context and axes:
        shards *= sz["context"]
    for a in axes:
        shards *= sz[a]
    return _local_params(m, zero, purpose, sz["tensor"], sz["pipeline"], shards, sz["expert"],
                         embedding_copies(m, sz["pipeline"], end_stages))


def embedding_copies(m: ModelConfig, stages: int, end_stages: bool) -> float:
    """The share of the embedding block (input embedding, final norm, untied head) the fullest pipeline
    stage holds. jaxpar's program replicates the block over `pipeline` (params.py: only the layers are
    staged): 1. Megatron-LM builds the embedding on the first stage and the output layer on the last
    (GPTModel pre_process / post_process), torchtitan's pipeline split does the same (tok_embeddings on
    the first stage, norm and output on the last): an untied model's stage holds one of the two
    matrices, 1/2 of the block; a tied one keeps the word embedding on both end stages (Megatron's
    shared embedding, all-reduced between them): 1."""
    return 0.5 if end_stages and stages > 1 and not m.tie_embeddings else 1.0


@per_model
def _local_params(m: ModelConfig, zero: int, purpose: str, tensor: int, stages: int, shards: int,
                  expert: int = 1, embedding: float = 1.0) -> float:
    """The routed experts' weights (MoE blocks) are split over `expert` as well: every expert is held
    once over the expert axis, so the memory counts all of them, E / expert per device. A ZeRO shard is
    a padded flat shard of each block: ceil(elements / shards), which equals the division whenever the
    shards divide the model dim (what the trainer needs) and counts the padding when they do not
    (Megatron's distributed optimizer pads its flat buffer to a multiple of the data-parallel size).
    `embedding`: the share of the embedding block held (`embedding_copies`)."""
    na, nm, ne = block_counts(m)
    n = 0.0
    for block, copies in (("attention", na / stages), ("mamba", nm / stages), ("moe", ne / stages), ("embedding", embedding)):
        if copies:
            sharded, kept = zero_split(m, block, zero, purpose)
            n += copies * (math.ceil(sharded.per_device(tensor, expert) / shards) + kept.per_device(tensor, expert))
    return n


def state_bytes(m: ModelConfig, st: Strategy, traits: "Traits" = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device under the strategy's ZeRO stage: the stack's weight_bytes
    per parameter of the weights kept between steps, float32 gradients, its optimizer_bytes per parameter of
    the optimizer's state (jaxpar's float32 weights are the masters; a bf16 stack keeps a float32 master copy
    with the moments), sharded as `local_params` says (`traits`: Traits; None, jaxpar's)."""
    t = traits or PROGRAM_TRAITS
    where = (t.state_over_context, t.fsdp_over_context, t.pp_end_stages)
    n = local_params(m, st, "params", *where)
    return n * t.weight_bytes, n * grad_bytes(st), local_params(m, st, "optimizer", *where) * t.optimizer_bytes


# ---- activation inventories (elements per token, byte override, split by tensor?, kept under) -------

def attention_half(inv: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """An attention block's inventory without its MLP: an MoE block's attention half."""
    return tuple(entry for entry in inv if entry[0] not in MLP_ENTRIES)


@per_model
def attention_inventory(m: ModelConfig, s_kv: float, dropout: bool = False) -> tuple[tuple, ...]:
    """One attention layer (pre-norm, GQA, MLP). `s_kv`: keys each query attends over on this device."""
    d, hq, hkv, f = m.d_model, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_dim
    sc = m.heads * s_kv
    inv = [("layer input x", d, None, False, ALL), ("norm1 out", d, None, False, NONE), *latent_entries(m),
           ("q", hq, None, True, DOT), ("k", hkv, None, True, DOT), ("v", m.kv_heads * m.v_dim, None, True, DOT),
           ("scores QK^T", sc, None, True, frozenset({"dots"})), ("softmax", sc, None, True, CORE),
           ("attention out PV", m.heads * m.v_dim, None, True, frozenset({"none", "selective", "dots"})),
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


def latent_entries(m: ModelConfig) -> tuple[tuple, ...]:
    """Latent attention's own activations per token (models/mla.py), replicated over `tensor`: the query and
    K/V latents before and after their RMSNorms and the RoPE key; none under GQA."""
    if not m.mla:
        return ()
    ql, c = m.q_lora_rank, m.kv_lora_rank
    return (("q, kv latents", ql + c, None, False, DOT), ("q, kv latents normed", ql + c, None, False, NONE),
            ("rope key", m.qk_rope_head_dim, None, False, DOT))


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


# The inputs of the linear layers, which a float8 step keeps for its weight gradients as the float8 copy
# its forward GEMM read (1 byte; Transformer Engine's Linear and torchao's Float8Linear save the cast input)
LINEAR_INPUTS = frozenset({"norm1 out", "attention out PV", "norm2 out", "silu(gate)*up", "gelu out"})


@per_model  # memoised on the inventory's identity (inventories are memoised per model, so they repeat)
def inventory_bytes(inv: tuple[tuple, ...], act_bytes: int, tensor: int, sp: bool, policy: str,
                    linear_bytes: int = 0) -> float:
    """Bytes per token kept by one layer: sum of kept tensors, split ones / tensor (all of them with SP);
    the LINEAR_INPUTS at `linear_bytes` where given (a float8 step)."""
    total = 0.0
    for name, elems, nbytes, split, kept in inv:
        if policy in kept:
            size = linear_bytes if linear_bytes and name in LINEAR_INPUTS else (nbytes or act_bytes)
            total += elems * size / (tensor if (split or sp) else 1)
    return total


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            selective: bool = False) -> float:
    """Activation bytes per transformer layer, fp16, with dropout (Korthikanti et al. 2022, table 2):
    no parallelism s*b*h*(34 + 5*a*s/h); TP s*b*h*(10 + 24/t + 5*a*s/(h*t)); TP+SP s*b*h*(34/t + 5*a*s/(h*t));
    TP+selective s*b*h*(10 + 24/t); TP+SP+selective 34*s*b*h/t."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + core)


# ---- activations of one step -------------------------------------------------------------------------

def inflight_microbatches(schedule: str, microbatches: int, stages: int) -> float:
    """Micro-batches whose activations are alive at the peak: GPipe/circular M, 1F1B min(M, S) (Megatron's
    asynchronous schedule; jaxpar's lockstep 1F1B stashes stage inputs instead:
    program_memory.one_f_one_b_bytes); ZB-H1 and ZB-V 1F1B's, DualPipe-V S + 1/2 (2S+1 half-stage chunks:
    core/schedule.py stated_activations, held by jaxpar/core/timetable.py's layouts)."""
    if stages == 1:
        return 1
    if schedule == "dualpipe-v":
        return stages + 0.5
    return min(microbatches, stages) if schedule in ("1f1b", "zb-h1", "zb-v") else microbatches


def step_tokens(st: Strategy, global_batch: int, seq: int) -> tuple[float, int, float]:
    """(sequences per device per accumulation step, micro-batches M (1 without a pipeline), tokens per
    micro-batch on a device)."""
    sz, o = st.sizes, st.options
    b_loc = global_batch / (sz["data"] * sz["fsdp"] * sz["expert"]) / o.grad_accum
    micro = o.microbatches if sz["pipeline"] > 1 else 1
    return b_loc, micro, b_loc / micro * seq / sz["context"]


def stage_bytes(m: ModelConfig, inventories: tuple[tuple, tuple, tuple], st: Strategy, policy: str) -> float:
    """Bytes per token this stage's layers keep under `policy`, from the (attention, Mamba-2, MoE)
    `inventories` of one layer each."""
    sz, o = st.sizes, st.options
    act, fp8 = ACTIVATION_BYTES[o.dtype], 1 if o.dtype == "float8" else 0
    return sum(n * inventory_bytes(inv, act, sz["tensor"], o.sequence_parallel, policy, fp8)
               for n, inv in zip(block_counts(m), inventories)) / sz["pipeline"]


def working_bytes(inventories: tuple[tuple, tuple, tuple], st: Strategy) -> float:
    """Bytes per token of the largest layer's full inventory (what `none` keeps): one layer at work."""
    sz, o = st.sizes, st.options
    return max(inventory_bytes(inv, ACTIVATION_BYTES[o.dtype], sz["tensor"], o.sequence_parallel, "none")
               for inv in inventories)


def host_bytes(m: ModelConfig, st: Strategy, global_batch: int, seq: int) -> float:
    """Bytes per device in host memory under remat `offload`: each layer unit's input, the residual stream
    [b, s, d] in the compute dtype (split over tensor under SP), copied there in the forward pass and back
    in the backward pass (jaxpar/ops/layer_scan.py OFFLOADED; MaxText's decoder_layer_input offload); 0 otherwise."""
    if st.options.remat != "offload":
        return 0.0
    sz, o = st.sizes, st.options
    _, _, tokens = step_tokens(st, global_batch, seq)
    split = sz["tensor"] if o.sequence_parallel else 1
    return m.units / sz["pipeline"] * tokens * m.d_model * ACTIVATION_BYTES[o.dtype] / split


def logit_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int) -> float:
    """The float32 logits of `b_loc` sequences: b*s*V/t*4 bytes (vocab-parallel head)."""
    return b_loc * seq / st.sizes["context"] * m.vocab / st.sizes["tensor"] * LOGIT_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Traits:
    """What a stack's program keeps that the mesh and the remat policy do not say, named as
    jaxpar/cost/software.py's `Software` names them (its fields carry each one's meaning and source):
    dropout masks, 1F1B's in-flight micro-batches, a fused attention kernel (no scores in HBM), a fused
    SwiGLU (`fused_swiglu`), autodiff's remat (`residuals_only`), torchtitan's every-other-matmul `dots`
    (`every_other_matmul`), the bytes per logit alive at the loss's peak, a pipeline's gathered FSDP weights
    (`pipeline_fsdp_bytes`) and its end stages' embedding and head (`embedding_copies`), the bytes per
    parameter of the weights kept between steps, of the optimizer state and of a parameter gather, and the
    state sharded over the context ranks (`local_params`). `of` reads them off a stack."""
    dropout: bool = False
    pp_1f1b: bool = False
    fused_attention: bool = False
    fused_mlp: bool = False
    autodiff_remat: bool = False
    sac_every_other_mm: bool = False
    loss_logit_bytes: int = LOGIT_BYTES
    pp_fsdp_gathered: bool = False
    pp_end_stages: bool = False
    weight_bytes: int = PARAM_BYTES
    optimizer_bytes: int = ADAM_BYTES
    param_gather_bytes: int = 2
    state_over_context: bool = False
    fsdp_over_context: bool = False

    @staticmethod
    @per_model   # on the stack's identity: one record per preset
    def of(stack) -> "Traits":
        """The traits of `stack` (any object with these fields: a jaxpar.cost.software.Software)."""
        return Traits(**{name: getattr(stack, name) for name in Traits.__dataclass_fields__})


PROGRAM_TRAITS = Traits()   # jaxpar's program's, the defaults (built once: the planner's hot path)


@per_model  # memoised on the inventory's identity, as inventory_bytes
def fused_swiglu(inv: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """An inventory whose SwiGLU is one fused kernel: it keeps its input (gate, up) and recomputes
    silu(gate) in its backward pass, so silu(gate) is never stored (Megatron-Core's bias_swiglu_impl,
    megatron/core/fusions/fused_bias_swiglu.py; Transformer Engine's LayerNormMLP; torch.compile's and
    XLA's fusions of the elementwise ops)."""
    return tuple(entry for entry in inv if entry[0] != "silu(gate)")


# A block's last projection: its output only joins the residual stream, which the next layer keeps as its input
LAST_PROJECTIONS = frozenset({"mlp down out", "out_proj out"})
# The even-numbered matmuls of an attention layer in call order wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down)
EVEN_MATMULS = frozenset({"k", "o-proj out", "up out"})


@per_model  # memoised on the inventory's identity, as inventory_bytes
def residuals_only(inv: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """An inventory as autodiff's rematerialisation keeps it: of the values a policy lets it save, only
    those the backward pass reads (jax.checkpoint's partial evaluation saves residuals, not every
    saveable value), so a block's last projection, read by no backward computation, is never stored.
    PyTorch's selective checkpointing caches every output its policy names (torch.utils.checkpoint)."""
    return tuple(entry for entry in inv if entry[0] not in LAST_PROJECTIONS)


@per_model  # memoised on the inventory's identity, as inventory_bytes
def every_other_matmul(inv: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """An inventory under torchtitan's op-level selective checkpointing: its policy saves the outputs of
    the attention kernel and of the odd-numbered matmuls of a layer and recomputes the even-numbered ones
    (`EVEN_MATMULS`; jaxpar.cost.flops.every_other_matmul_flops counts their rerun)."""
    return tuple(e if e[0] not in EVEN_MATMULS else (*e[:4], e[4] - {"dots"}) for e in inv)


def inventories(m: ModelConfig, st: Strategy, seq: int, traits: Traits = Traits()) -> tuple[tuple, tuple, tuple]:
    """(attention, Mamba-2, MoE) inventories of one layer each (empty where the model has none): scores
    over `keys_per_query` keys, routed experts at their k copies per token, as the stack's `traits` keep
    them (`Traits`)."""
    na, nm, ne = block_counts(m)
    keys = keys_per_query(st, seq, traits.fused_attention)
    rows = expert_rows(m, seq, st.sizes["context"], padded=False)
    dropout = traits.dropout
    attention = attention_inventory(m, keys, dropout) if na else ()
    attention = fused_swiglu(attention) if traits.fused_mlp else attention
    attention = every_other_matmul(attention) if traits.sac_every_other_mm else attention
    invs = (attention, mamba_inventory(m) if nm else (), moe_inventory(m, keys, rows, dropout) if ne else ())
    return tuple(residuals_only(inv) for inv in invs) if traits.autodiff_remat else invs


def activation_bytes(m: ModelConfig, st: Strategy, global_batch: int, seq: int, traits: Traits = Traits()) -> float:
    """Activation bytes per device at the peak of the backward pass:
    stored = in-flight micro-batches x sum over this stage's layers of (kept bytes per token x tokens)
           + the larger of two transients that are never alive together:
               under remat `full`, one layer's full inventory recomputed at work in the backward pass;
               the loss's logits of one accumulation step, b*s*V/t x `traits.loss_logit_bytes`; under 1F1B of
               one micro-batch (the last stage runs each micro-batch's loss and its backward pass back to
               back, with no warm-up micro-batches: Narayanan et al. 2021 sec. 2.2; Megatron-Core's
               pipeline schedules).
             The backward pass runs in reverse order: the loss's backward consumes the logits (Megatron's
             vocab-parallel cross entropy keeps its softmax in their place) and they are freed before the
             last layer's backward pass recomputes its inventory
           + the int32 batch (`batch_bytes`).
    `traits.pp_1f1b`: the stack runs 1F1B; `traits.fused_attention`: no scores in HBM."""
    o, one_f_one_b = st.options, traits.pp_1f1b
    b_loc, micro, tokens = step_tokens(st, global_batch, seq)
    invs = inventories(m, st, seq, traits)
    kind = o.pp_schedule if o.pp_schedule in ZERO_BUBBLE or not one_f_one_b else "1f1b"
    inflight = inflight_microbatches(kind, micro, st.sizes["pipeline"])
    stored = inflight * stage_bytes(m, invs, st, o.remat) * tokens
    transient = tokens * working_bytes(invs, st) if unit_policy(o.remat) == "full" else 0.0
    head_rows = b_loc / micro if one_f_one_b else b_loc
    logits = logit_bytes(m, st, head_rows, seq) / LOGIT_BYTES * traits.loss_logit_bytes
    return stored + max(transient, logits) + mtp_bytes(m, st, invs, head_rows, seq) + batch_bytes(st, global_batch, seq)


def mtp_bytes(m: ModelConfig, st: Strategy, invs: tuple[tuple, tuple, tuple], rows: float, seq: int) -> float:
    """What the multi-token prediction modules (models/mtp.py) keep for the backward pass of the `rows`
    sequences the head runs at once: each, outside the recomputed stack, its block's whole inventory (`none`),
    its inputs (the embedding of the tokens ahead and the two normed copies, 3 x d per token) and its
    float32 logits."""
    if not m.mtp_depth:
        return 0.0
    sz, o = st.sizes, st.options
    act = ACTIVATION_BYTES[o.dtype]
    inv = invs[2] if m.mtp_kind == "E" else invs[0]
    tokens = rows * seq / sz["context"]
    per_token = inventory_bytes(inv, act, sz["tensor"], o.sequence_parallel, "none") + 3 * m.d_model * act
    return m.mtp_depth * (tokens * per_token + logit_bytes(m, st, rows, seq))


def pipeline_fsdp_bytes(m: ModelConfig, st: Strategy, traits: Traits) -> tuple[float, float]:
    """(gathered weights, unsharded gradients) bytes per device where FSDP shards the weights inside a
    pipeline stage and keeps them gathered for the step: torchtitan's default reshard_after_forward is
    off under pipeline parallelism (torchtitan/models/llama3/infra/parallelize.py: "For PP, do not reshard
    after forward to avoid per-microbatch all-gathers"), and PyTorch's pipeline stages accumulate the
    gradients of every micro-batch but the last unsharded, reduced on the last (torch/distributed/
    pipelining/stage.py backward_maybe_with_nosync): the stage's weights at the stack's param_gather_bytes and
    its float32 gradients, over tensor and the stage only. (0, 0) without a pipeline or FSDP (over fsdp, or
    over context where the stack's FSDP spans it: fsdp_over_context)."""
    sz = st.sizes
    sharded = (st.zero == 3 and sz["fsdp"] > 1) or (traits.fsdp_over_context and sz["context"] > 1)
    if sz["pipeline"] == 1 or not sharded:
        return 0.0, 0.0
    whole = _local_params(m, 0, "params", sz["tensor"], sz["pipeline"], 1, sz["expert"],
                          embedding_copies(m, sz["pipeline"], traits.pp_end_stages))
    return whole * traits.param_gather_bytes, whole * grad_bytes(st)


def memory(m: ModelConfig, st: Strategy, global_batch: int, seq: int, traits: Traits = Traits()) -> Memory:
    """Bytes per device of one training step of a stack with `traits`: model and optimizer state
    (`state_bytes`), with a pipeline's gathered FSDP weights and unsharded gradients where the stack keeps
    them (`pipeline_fsdp_bytes`), and activations (`activation_bytes`)."""
    params, grads, opt = state_bytes(m, st, traits)
    if traits.pp_fsdp_gathered:
        gathered, unsharded = pipeline_fsdp_bytes(m, st, traits)
        params, grads = params + gathered, max(grads, unsharded)
    return Memory(params, grads, opt, activation_bytes(m, st, global_batch, seq, traits),
                  host_bytes(m, st, global_batch, seq))


def keys_per_query(st: Strategy, seq: int, fused: bool = False) -> float:
    """Keys one query's scores span in HBM on a device: ring attention holds one K/V block (s/c), else
    all s; a fused (flash) attention kernel none (its score tiles live in on-chip memory)."""
    if fused:
        return 0.0
    return seq / st.sizes["context"] if st.options.attention == "ring" else seq


def batch_bytes(st: Strategy, global_batch: int, seq: int) -> float:
    """The step's input: token ids, labels and positions, int32, for this device's rows
    (batch over data x fsdp x expert, sequence over context; replicated over tensor and pipeline)."""
    sz = st.sizes
    return 3 * 4 * global_batch / (sz["data"] * sz["fsdp"] * sz["expert"]) * seq / sz["context"]


@per_model  # as inventory_bytes
def recomputed_bytes(inv: tuple[tuple, ...], act_bytes: int, tensor: int, sp: bool, policy: str) -> float:
    """Bytes per token a layer produces again in its backward pass: what `none` keeps and `policy` drops."""
    total = 0.0
    for _name, elems, nbytes, split, kept in inv:
        if "none" in kept and policy not in kept:
            total += elems * (nbytes or act_bytes) / (tensor if (split or sp) else 1)
    return total
