"""FLOPs per block and per training step.

Conventions (Narayanan et al. 2021, appendix; Kaplan et al. 2020; scaling book "Transformer math"):
- A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs. Backward of a matmul costs 2x its forward
  (one matmul for the input gradient, one for the weight gradient), so training = 3 x forward.
- `matmul` FLOPs are what MFU counts (model FLOPs utilisation, Chowdhery et al. 2022); `other` holds
  rough elementwise counts (softmax, norms, activations, conv) reported for completeness only.
- Attention scores: QK^T and PV each cost 2*b*s*s_kv*hq. What a kernel computes (hardware FLOPs, and the
  time): in full under dense masked attention (the Megatron formula's s/(6h) term); `causal=True` halves
  them, which is what a causal kernel that skips fully masked blocks does. Model FLOPs (the MFU numerator)
  always count the causal half, whatever the kernel computes: one convention for every command and stack
  (the design guide's, Megatron-Bridge's flop_utils; MODEL_FLOPS_CONVENTION).
- Recompute (HFU, hardware FLOPs): remat `none` and `dots` add nothing (`dots` saves every matmul
  output; only elementwise work is redone); `dots_no_batch` saves matmuls without batch dims, so the
  batched dots -- attention QK^T and PV, the Mamba-2 SSD einsums -- run again (Korthikanti et al. 2022's
  "selective recompute"); `full` reruns every layer's forward. The LM head is outside the layers.
  Under `full`, PyTorch's checkpoint (Megatron) reruns the whole forward, the unit's last projection
  included; XLA drops that one matmul (MLP down / Mamba out_proj of the scanned unit's last block),
  because the backward needs its input and weight, never its output, so the rerun is dead code
  (`rerun_outputs=False`; checked against the compiled HLO in tests/test_cost_vs_xla.py).
- Ring attention (jaxpar.ops.attention) rematerialises each K/V-block fold, so the backward
  reruns the score matmul QK^T of every block (not PV: its output is not needed to differentiate),
  +2*b*s*s*hq per attention layer whatever the remat policy.

For GPT shapes (hq = hkv = h, f = 4h, GeLU) one layer's forward matmuls are 24*b*s*h^2 + 4*b*s^2*h,
so a step is 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) model FLOPs, 96*... with full recompute
(Narayanan et al. 2021, eq. 3; Korthikanti et al. 2022, section 6).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxpar.cost.params import latent_attention_weights, mamba_dims, per_model
from jaxpar.ops.capacity import group_capacity
from jaxpar.models.config import ModelConfig

TRAIN_FACTOR = 3.0  # forward + backward (2x forward) for matmuls
# What MFU's numerator counts, in every command, stack and study (module docstring; docs/cost_model.md
# "One MFU convention" says what each source's own convention counts).
MODEL_FLOPS_CONVENTION = "6 x parameters x tokens + attention over the causal half of the s x s scores; no recompute"


@dataclasses.dataclass(frozen=True, slots=True)
class Flops:
    matmul: float
    other: float = 0.0

    def __add__(self, o: "Flops") -> "Flops":
        return Flops(self.matmul + o.matmul, self.other + o.other)

    def __mul__(self, k: float) -> "Flops":
        return Flops(self.matmul * k, self.other * k)


# ---- attention block ---------------------------------------------------------------------------

def rmsnorm_flops(width: int, tokens: float) -> Flops:
    """RMSNorm: square, mean, rsqrt, scale, weight: ~4 FLOPs per element, no matmul."""
    return Flops(0.0, 4.0 * tokens * width)


def attention_projection_flops(m: ModelConfig, tokens: float) -> Flops:
    """q,k,v,o projections with GQA: 2*T*d*(hq + 2*hkv) + 2*T*hq*d; RoPE ~3 FLOPs per q/k element. Latent
    attention: 2*T per entry of each of its matrices (`latent_projection_weights`), RoPE on q_rope and the
    shared k_rope, and its two latent RMSNorms."""
    if m.mla:
        r, latents = m.qk_rope_head_dim, m.q_lora_rank + m.kv_lora_rank
        return Flops(2.0 * tokens * sum(w.size for w in latent_projection_weights(m)),
                     3.0 * tokens * (m.heads + 1) * r + rmsnorm_flops(latents, tokens).other)
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return Flops(2.0 * tokens * m.d_model * (hq + 2 * hkv) + 2.0 * tokens * hq * m.d_model,
                 3.0 * tokens * (hq + hkv))


def tensor_replicated_flops(m: ModelConfig, tokens: float) -> float:
    """Forward matmul FLOPs of a step that every tensor rank computes whole: latent attention's projections
    down to its latents and the RoPE key in each layer and MTP module (W_q_a, W_kv_a, W_k_rope: their output
    dims, `latent` and the shared key's, are not split; Megatron-Core's MLA builds them `duplicated` too),
    2*T*d*(q_lora + kv_lora + rope), and each MTP module's W_eh, 2*T*2d*d."""
    latents = 2.0 * tokens * m.d_model * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) if m.mla else 0.0
    return (latents * (m.attention_layers + m.moe_layers + m.mtp_depth)
            + 4.0 * tokens * m.d_model * m.d_model * m.mtp_depth)


def latent_projection_weights(m: ModelConfig) -> tuple:
    """Latent attention's matrices, each applied once per token in the training forward (not its norms)."""
    return tuple(w for w in latent_attention_weights(m) if len(w.shape) > 1)


def attention_core_flops(m: ModelConfig, batch: float, seq: int, causal: bool = False) -> Flops:
    """Scores QK^T 2*b*s*s*hq, softmax ~5 FLOPs per score, weighted sum PV 2*b*s*s*hv (hv = hq but under
    latent attention, whose value heads are v_head_dim wide).

    Each query head attends over all s keys (GQA shares k/v across heads, not the score work).
    `causal=True` halves the score work (only the lower triangle is computed)."""
    hq, hv = m.heads * m.head_dim, m.heads * m.v_dim
    frac = 0.5 if causal else 1.0
    scores = batch * seq * seq * frac
    return Flops(2.0 * scores * (hq + hv), 5.0 * scores * m.heads)


def mlp_flops(m: ModelConfig, tokens: float) -> Flops:
    """SwiGLU: 3 matmuls 3*2*T*d*f, silu*up ~6 FLOPs per hidden element; GeLU: 2*2*T*d*f, ~8 per element."""
    if m.mlp_type == "swiglu":
        return Flops(6.0 * tokens * m.d_model * m.mlp_dim, 6.0 * tokens * m.mlp_dim)
    return Flops(4.0 * tokens * m.d_model * m.mlp_dim, 8.0 * tokens * m.mlp_dim)


def attention_block_flops(m: ModelConfig, batch: float, seq: int, causal: bool = False) -> Flops:
    """Forward of one attention layer: 2 RMSNorms + GQA attention + MLP."""
    t = batch * seq
    return (rmsnorm_flops(m.d_model, t) * 2 + attention_projection_flops(m, t)
            + attention_core_flops(m, batch, seq, causal) + mlp_flops(m, t))


# ---- Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs", SSD algorithm, section 6) ------------

def ssd_flops(m: ModelConfig, batch: float, seq: int) -> Flops:
    """The chunked SSD scan for one layer (every term is a batched einsum).

    With D = d_inner, N = d_state, G = ngroups, Q = chunk (<= seq), c = seq/Q chunks, T = b*seq:
      intra-chunk C B^T           2*T*Q*N*G
      its application to x        2*T*Q*D       (masked by the decay matrix L)
      chunk states B^T x          2*T*N*D
      inter-chunk state passing   2*b*(c+1)^2*D*N  (the decay matmul of `ssd_minimal_discrete` over the
                                  c chunk states and the initial state, jaxpar/ops/ssd.py)
      state-to-output C h         2*T*N*D
    Elementwise: decay segment sums and exp ~3*T*H*Q."""
    q = min(m.chunk, seq)
    c = seq / q
    t = batch * seq
    di, n = m.d_inner, m.d_state
    mm = 2 * t * q * n * m.ngroups + 2 * t * q * di + 4 * t * n * di + 2 * batch * (c + 1) ** 2 * di * n
    return Flops(mm, 3.0 * t * m.ssm_heads * q)


def mamba_block_flops(m: ModelConfig, batch: float, seq: int) -> Flops:
    """Forward of one Mamba-2 layer: RMSNorm, in_proj (z,x,B,C,dt packed: d_in_proj = 2*d_inner +
    2*ngroups*d_state + nheads), depthwise causal conv over conv_dim = d_inner + 2*ngroups*d_state
    channels (2*T*conv_dim*d_conv) + SiLU, SSD, gated RMSNorm y*silu(z) (~9*T*d_inner), out_proj."""
    t = batch * seq
    d_in_proj, conv_dim, _ = mamba_dims(m)
    proj = Flops(2.0 * t * m.d_model * d_in_proj + 2.0 * t * m.d_inner * m.d_model)
    conv = Flops(0.0, 2.0 * t * conv_dim * m.d_conv + 5.0 * t * conv_dim)
    gate = Flops(0.0, 9.0 * t * m.d_inner)
    return rmsnorm_flops(m.d_model, t) + proj + conv + ssd_flops(m, batch, seq) + gate


# ---- mixture-of-experts block (models/moe.py) --------------------------------------------------------

def router_flops(m: ModelConfig, tokens: float) -> Flops:
    """Router logits 2*T*d*E (float32); softmax or sigmoid, top-k and renormalisation ~(5 + 2k)*T*E."""
    return Flops(2.0 * tokens * m.d_model * m.experts, (5.0 + 2.0 * m.top_k) * tokens * m.experts)


def expert_flops(m: ModelConfig, tokens: float, rows: float | None = None) -> Flops:
    """The routed experts: a SwiGLU of width f_e on each of the k copies of a token (6*d*f_e per copy)
    and the weighted combine 2*k*d per token (an einsum). `rows`: expert rows computed per token when
    the kernel computes more than the k copies that exist (jaxpar's padded kernel: E*C_loc/s_loc;
    `expert_rows`); the combine stays k per token. The grouped kernel (moe_kernel = grouped,
    jaxpar/ops/moe_grouped.py) computes the k copies: rows = None."""
    k, f, d = m.top_k, m.moe_mlp_dim, m.d_model
    rows = k if rows is None else rows
    return Flops(6.0 * tokens * rows * d * f + 2.0 * tokens * k * d, 6.0 * tokens * rows * f)


def shared_expert_flops(m: ModelConfig, tokens: float) -> Flops:
    """DeepSeek's shared experts: one SwiGLU of width shared_experts * f_e on every token."""
    f = m.shared_experts * m.moe_mlp_dim
    return Flops(6.0 * tokens * m.d_model * f, 6.0 * tokens * f)


def moe_block_flops(m: ModelConfig, batch: float, seq: int, causal: bool = False) -> Flops:
    """Forward of one MoE layer: the attention half of an attention block (2 RMSNorms, GQA) + router +
    the k routed experts per token + shared experts: FLOPs follow the *active* parameters."""
    t = batch * seq
    return (rmsnorm_flops(m.d_model, t) * 2 + attention_projection_flops(m, t)
            + attention_core_flops(m, batch, seq, causal) + router_flops(m, t) + expert_flops(m, t)
            + shared_expert_flops(m, t))


def expert_rows(m: ModelConfig, seq: int, context: int = 1, padded: bool = True) -> float:
    """Expert rows computed per token: k copies, or under jaxpar's static dispatch buffers
    (`padded`: moe_kernel = padded, jaxpar.ops.moe) E * C_loc / s_loc, C_loc = min(s_loc, C),
    s_loc = seq / context, C = seq (dropless) or ceil(cf * seq * k / E): a dropless kernel computes E/k
    times the copies. k copies is the grouped kernel (jaxpar/ops/moe_grouped.py: jax.lax.ragged_dot, a
    grouped matmul on GPU and TPU) and the routed dispatch of other stacks (Megatron's grouped GEMM).
    Caveat: XLA:CPU expands ragged_dot to a dense masked product over every expert, so a CPU run of the
    grouped kernel computes E rows per token (XLA's cost analysis counts them); the count here is what
    GPU and TPU compute, the hardware the cost model prices."""
    if not padded or not m.experts:
        return float(m.top_k)
    s_loc = seq / context
    return m.experts * min(s_loc, group_capacity(seq, m.top_k, m.experts, m.capacity_factor)) / s_loc


@per_model  # called once per estimate: the planner's hot path
def projection_ops(m: ModelConfig) -> tuple[tuple[int, float], ...]:
    """(layers that run it, forward matmul FLOPs per token) of each projection GEMM beside which tensor
    parallelism with sequence parallelism issues one collective of the b*s*d stream (Korthikanti et al.
    2022, fig. 5: an all-gather before each block half's first GEMM, a reduce-scatter after its last):
    attention's QKV and output projection, the MLP's (or the routed and shared experts') up and down,
    Mamba-2's in_proj and out_proj. time.decomposed_hideable pairs each collective with its own GEMM."""
    hq, hkv, d = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.d_model
    attention = m.attention_layers + m.moe_layers
    ops = [(attention, 2.0 * d * (hq + 2 * hkv)), (attention, 2.0 * hq * d)] if attention else []
    if attention and m.mla:   # the gathered input meets the projections from d; the output projection
        ops = [(attention, 2.0 * d * ((m.q_lora_rank or hq) + m.kv_lora_rank + m.qk_rope_head_dim)),
               (attention, 2.0 * m.heads * m.v_head_dim * d)]
    if m.attention_layers:
        up = 2 if m.mlp_type == "swiglu" else 1
        ops += [(m.attention_layers, 2.0 * d * m.mlp_dim * up), (m.attention_layers, 2.0 * m.mlp_dim * d)]
    if m.moe_layers:
        f = (m.top_k + m.shared_experts) * m.moe_mlp_dim
        ops += [(m.moe_layers, 4.0 * d * f + 2.0 * d * m.experts), (m.moe_layers, 2.0 * f * d)]
    if m.mamba_layers:
        ops += [(m.mamba_layers, 2.0 * d * mamba_dims(m)[0]), (m.mamba_layers, 2.0 * m.d_inner * d)]
    return tuple(ops)


@per_model  # called once per estimate: the planner's hot path
def projection_shapes(m: ModelConfig) -> tuple[tuple[str, int, int, str, int], ...]:
    """(block kind, K, N, the dimension tensor parallelism splits, "" for none, experts) of each projection GEMM of one
    layer, an M x K input times a K x N weight (Megatron's column-parallel layers split N, its row-parallel
    ones K: Shoeybi et al. 2019): the same GEMMs as `projection_ops`, the MoE layer's routed experts as
    one grouped GEMM over `experts` weights and its shared experts as a dense one (the router's d x E is
    left out: a few columns). Block kinds as the step's layer executions count them (shape.StepShape):
    "attention" (attention and MoE layers), "mlp", "experts", "mamba"."""
    hq, hkv, d = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.d_model
    ops = [("attention", d, hq + 2 * hkv, "n", 0), ("attention", hq, d, "k", 0)] if m.attention_layers + m.moe_layers else []
    if ops and m.mla:   # the latents from d, not split ("": every tensor rank computes them), then per head
        h, c, ql = m.heads, m.kv_lora_rank, m.q_lora_rank
        ops = [("attention", d, ql + c + m.qk_rope_head_dim, "", 0) if ql else ("attention", d, hq, "n", 0),
               *((("attention", ql, hq, "n", 0),) if ql else (("attention", d, c + m.qk_rope_head_dim, "", 0),)),
               ("attention", c, h * (m.qk_nope_head_dim + m.v_head_dim), "n", 0), ("attention", h * m.v_head_dim, d, "k", 0)]
    if m.attention_layers:
        ops += [("mlp", d, m.mlp_dim * (2 if m.mlp_type == "swiglu" else 1), "n", 0), ("mlp", m.mlp_dim, d, "k", 0)]
    if m.moe_layers:
        f = m.moe_mlp_dim
        ops += [("experts", d, 2 * f, "n", m.experts), ("experts", f, d, "k", m.experts)]
        if m.shared_experts:
            ops += [("experts", d, 2 * f * m.shared_experts, "n", 0), ("experts", f * m.shared_experts, d, "k", 0)]
    if m.mamba_layers:
        ops += [("mamba", d, mamba_dims(m)[0], "n", 0), ("mamba", m.d_inner, d, "k", 0)]
    return tuple(ops)


# ---- embedding and head ----------------------------------------------------------------------------

def embedding_flops(m: ModelConfig, tokens: float) -> Flops:
    """Token embedding is a gather: no FLOPs forward (backward is a scatter-add, T*d adds)."""
    return Flops(0.0, 0.0)


def head_flops(m: ModelConfig, tokens: float) -> Flops:
    """Final RMSNorm, LM head 2*T*d*V, cross-entropy (max, exp, sum, log, pick) ~5*T*V."""
    return rmsnorm_flops(m.d_model, tokens) + Flops(2.0 * tokens * m.d_model * m.vocab, 5.0 * tokens * m.vocab)


def mtp_flops(m: ModelConfig, batch: float, seq: int, causal: bool = False) -> Flops:
    """The multi-token prediction modules (models/mtp.py), each: its two input norms, W_eh 2*T*2d*d, one
    block of the last layer's kind, its final norm, the shared LM head and its cross-entropy."""
    if not m.mtp_depth:
        return Flops(0.0, 0.0)
    t, d = batch * seq, m.d_model
    block = moe_block_flops if m.mtp_kind == "E" else attention_block_flops
    one = rmsnorm_flops(d, t) * 2 + Flops(4.0 * t * d * d, 0.0) + block(m, batch, seq, causal) + head_flops(m, t)
    return one * m.mtp_depth


# ---- one training step -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class StepFlops:
    model: float        # forward + backward matmul FLOPs, the causal half of the scores: the MFU numerator
    hardware: float     # what the kernels compute, recompute and padding included: the HFU numerator
    elementwise: float  # non-matmul FLOPs (forward + backward + recompute), not in MFU/HFU
    layers: float       # forward + backward FLOPs the layers' kernels compute (the part the pipeline splits)
    head: float         # forward + backward FLOPs of embedding + head (not split by the pipeline axis)
    recompute: float    # recomputed matmul FLOPs
    padding: float      # expert matmul FLOPs on empty buffer rows (jaxpar's static MoE dispatch), in `hardware`
    by_block: tuple[tuple[str, float, float], ...]  # (part, model matmul FLOPs, elementwise FLOPs)


def output_projection_flops(m: ModelConfig, tokens: float) -> Flops:
    """The last matmuls of the scanned units (each unit's last block's output projection, dead in its
    recompute), all runs': MLP down 2*T*f*d for an attention block, out_proj 2*T*d_inner*d for a Mamba-2
    block, none for a MoE block (the router weights' gradient reads the experts' outputs)."""
    width = {"A": m.mlp_dim, "M": m.d_inner, "E": 0.0}
    return Flops(sum(2.0 * tokens * width[unit[-1]] * m.d_model * n for unit, n in m.runs))


# The layer unit's own policy under the stacks' recompute names: `selective` (Korthikanti et al. 2022;
# Megatron's --recompute-granularity selective) leaves the unit alone and recomputes its attention core
# (QK^T, softmax, PV) from the saved q, k, v; `offload` (MaxText's host offload; jaxpar/ops/layer_scan.py OFFLOADED) saves
# each unit's input in host memory and recomputes the unit as `full` does.
UNIT_POLICY = {"selective": "none", "offload": "full"}


def unit_policy(remat: str) -> str:
    """What the layer unit itself does under `remat` (UNIT_POLICY; the other policies are their own)."""
    return UNIT_POLICY.get(remat, remat)


def core_passes(remat: str, ring: bool = False, rerun_outputs: bool = True) -> float:
    """How many times a step computes each attention core's forward matmuls, backward included
    (TRAIN_FACTOR), with what `recompute_flops` reruns of it under `remat` and `ring`."""
    rerun = ((1.0 if rerun_outputs else 0.5) if remat == "selective"
             else 1.0 if unit_policy(remat) == "full" or remat == "dots_no_batch" else 0.0)
    return TRAIN_FACTOR + rerun + (0.5 if ring else 0.0)


def every_other_matmul_flops(m: ModelConfig, tokens: float) -> Flops:
    """The forward matmuls a policy that saves every other matmul output of a layer reruns (torchtitan's
    op-level selective checkpointing: its policy counts aten.mm calls per layer and recomputes the
    even-numbered ones, torchtitan/models/llama3/parallelize_llama.py `_custom_policy`): in the order
    wq, wk, wv, wo, w1, w3, w2 that is k, the output projection and up (attention and dense MLP layers)."""
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    up = m.mlp_dim if m.mlp_type == "swiglu" else 0
    return Flops(2.0 * tokens * m.d_model * (hkv + hq + up) * m.attention_layers)


class Kernels(NamedTuple):
    """What a step's kernels compute that its FLOP count depends on: only the causal triangle of the scores
    (`causal`: a kernel that skips fully masked blocks); QK^T again in the backward pass (`rerun_qk`: ring
    attention's rematerialised folds, a fused kernel's backward); the unit's last projection in a full rerun
    (`rerun_outputs`: PyTorch's checkpoint reruns it, XLA drops it: module docstring); expert rows per token
    (`rows`: `expert_rows`; None: the k copies); torchtitan's `dots`, which reruns every other matmul
    (`every_other_mm`: `every_other_matmul_flops`)."""
    causal: bool = False
    rerun_qk: bool = False
    rerun_outputs: bool = True
    rows: float | None = None
    every_other_mm: bool = False


def recompute_flops(m: ModelConfig, remat: str, batch: float, seq: int, kernels: Kernels = Kernels()) -> Flops:
    """Forward work redone in the backward pass under a remat policy (module docstring; `selective`: the
    attention core's forward once more, UNIT_POLICY, but for PV where the compiler drops the dead output, as
    it drops full remat's last projection: `kernels.rerun_outputs` False)."""
    causal, rerun_outputs = kernels.causal, kernels.rerun_outputs
    if remat == "selective":
        rec = attention_core_flops(m, batch, seq, causal) * ((1.0 if rerun_outputs else 0.5)
                                                             * (m.attention_layers + m.moe_layers))
    elif unit_policy(remat) == "full":
        rec = (attention_block_flops(m, batch, seq, causal) * m.attention_layers
               + mamba_block_flops(m, batch, seq) * m.mamba_layers + moe_block_flops(m, batch, seq, causal) * m.moe_layers)
        if not rerun_outputs:
            rec = rec + output_projection_flops(m, batch * seq) * -1.0
    elif remat == "dots_no_batch":
        rec = (attention_core_flops(m, batch, seq, causal) * (m.attention_layers + m.moe_layers)
               + ssd_flops(m, batch, seq) * m.mamba_layers)
    else:
        other = 0.0 if remat == "none" else (attention_block_flops(m, batch, seq, causal).other * m.attention_layers
                                              + mamba_block_flops(m, batch, seq).other * m.mamba_layers
                                              + moe_block_flops(m, batch, seq, causal).other * m.moe_layers)
        rec = Flops(0.0, other)  # `dots`: elementwise only
        if remat == "dots" and kernels.every_other_mm:
            rec = rec + every_other_matmul_flops(m, batch * seq)
    if kernels.rerun_qk:
        rec = rec + attention_core_flops(m, batch, seq, causal) * (0.5 * (m.attention_layers + m.moe_layers))  # QK^T
    return rec


@per_model  # a planner varies the strategy, not these arguments
def step_flops(m: ModelConfig, remat: str, batch: float, seq: int, kernels: Kernels = Kernels()) -> StepFlops:
    """FLOPs of one optimizer step over `batch` sequences of length `seq` (all devices together) under `remat`,
    as `kernels` compute them (`Kernels`: hardware FLOPs; the expert rows beyond the k copies count as
    `padding`), and as MFU counts them (`model`, `by_block`: MODEL_FLOPS_CONVENTION, the causal half)."""
    tokens, causal, rows = batch * seq, kernels.causal, kernels.rows
    attn = attention_block_flops(m, batch, seq, causal) * m.attention_layers
    mamba = mamba_block_flops(m, batch, seq) * m.mamba_layers
    moe = moe_block_flops(m, batch, seq, causal) * m.moe_layers
    mtp = mtp_flops(m, batch, seq, causal)
    head = head_flops(m, tokens) + embedding_flops(m, tokens) + mtp
    rec = recompute_flops(m, remat, batch, seq, kernels)
    cores = m.attention_layers + m.moe_layers + m.mtp_depth
    masked = 0.0 if causal else attention_core_flops(m, batch, seq, True).matmul * cores
    pad = 0.0
    if m.moe_layers and rows is not None:   # the MTP modules' MoE blocks run outside the recomputed stack
        excess = expert_flops(m, tokens, rows).matmul - expert_flops(m, tokens).matmul
        pad = excess * (m.moe_layers * (TRAIN_FACTOR + (1.0 if unit_policy(remat) == "full" else 0.0))
                        + m.mtp_moe_layers * TRAIN_FACTOR)
    fwd = attn + mamba + moe + head
    t, a, k, e = tokens, m.attention_layers, m.mamba_layers, m.moe_layers
    parts = (("attention qkvo", attention_projection_flops(m, t) * (a + e)),
             ("attention scores", attention_core_flops(m, batch, seq, True) * (a + e)),
             ("mlp", mlp_flops(m, t) * a),
             ("moe router", router_flops(m, t) * e),
             ("moe experts", expert_flops(m, t) * e),
             ("moe shared experts", shared_expert_flops(m, t) * e),
             ("mamba mixer", (mamba_block_flops(m, batch, seq) + rmsnorm_flops(m.d_model, t) * -1) * k),
             ("norms", rmsnorm_flops(m.d_model, t) * (2 * (a + e) + k + 1)),
             ("embedding+head", head + mtp * -1 + rmsnorm_flops(m.d_model, t) * -1),
             ("multi-token prediction", mtp))
    blocks = tuple((name, f.matmul * TRAIN_FACTOR, f.other * TRAIN_FACTOR) for name, f in parts)
    return StepFlops(model=(fwd.matmul - masked) * TRAIN_FACTOR,
                     hardware=fwd.matmul * TRAIN_FACTOR + rec.matmul + pad,
                     elementwise=fwd.other * TRAIN_FACTOR + rec.other,
                     layers=(attn.matmul + mamba.matmul + moe.matmul) * TRAIN_FACTOR,
                     head=head.matmul * TRAIN_FACTOR, recompute=rec.matmul, padding=pad,
                     by_block=tuple(b for b in blocks if b[1] > 0 or b[2] > 0))
