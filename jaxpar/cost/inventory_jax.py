"""What jaxpar's own program keeps for the backward pass, per token of one layer: the activation
inventories of JAX's reverse-mode autodiff for models/ (jaxpar/cost/program_memory.py uses them for
software with `jaxpar_program`; jaxpar/cost/memory.py's textbook inventories describe Megatron's PyTorch
layer). Entries are (name,
elements per token, byte override or None for the compute dtype, split by tensor?, kept under which
remat policies), as in memory.py.
"""
from __future__ import annotations

from jaxpar.cost.memory import attention_half
from jaxpar.cost.params import mamba_dims, per_model
from jaxpar.models.config import ModelConfig


# ---- jaxpar's own program: what JAX's reverse-mode autodiff keeps -----------------------------------
#
# A jaxpar step keeps what JAX's partial
# evaluation of the scanned layer saves as residuals, read off `jax.ad_checkpoint.print_saved_residuals`
# on one block of models/ (float32 and bfloat16): RMSNorm works in float32 and keeps its float32 input,
# x*rsqrt(mean) and the scaled output; softmax keeps exp(s - max) in float32 and the probabilities in
# the compute dtype (XLA fuses the masked scores away; the boolean causal mask and the RoPE tables are
# the same in every layer and hoisted out of the layer loop, so they are counted once, not per layer);
# SwiGLU keeps gate and up and silu's pieces; Mamba-2's depthwise conv keeps each of its d_conv shifted
# inputs, SSD computes in float32 and keeps its decay matrices. Under a remat policy the scan carries the
# layer input (compute dtype) and the policy's saveable dot outputs (jax.checkpoint_policies).

F32, BOOL = 4, 1
REMAT = frozenset({"full", "dots", "dots_no_batch"})   # jax.checkpoint saves the layer input
NONE_ONLY = frozenset({"none"})
JAX_DOT = frozenset({"none", "dots", "dots_no_batch"})   # dots without batch dims (kept without remat too)
JAX_DOT_ONLY = frozenset({"dots", "dots_no_batch"})      # outputs "none" needs no copy of
JAX_BDOT = frozenset({"dots"})                            # outputs of batched dots (attention, SSD)


def _jax_norm(prefix: str, width: int, split: bool = False) -> list[tuple]:
    return [(f"{prefix} input (float32)", width, F32, split, NONE_ONLY),
            (f"{prefix} rsqrt, mean", 2, F32, split, NONE_ONLY),
            (f"{prefix} x*rsqrt (float32)", width, F32, split, NONE_ONLY)]


@per_model
def jax_attention_inventory(m: ModelConfig, s_kv: float, ring_blocks: int = 0,
                            fused: bool = False) -> tuple[tuple, ...]:
    """One attention block as jaxpar's JAX program keeps it (see above). Dense attention keeps the
    scores of all `s_kv` keys; ring attention (`ring_blocks` moved K/V blocks) rematerialises each
    block's scores and keeps, per moved block, the running float32 output and softmax statistics
    (hq + 2*heads) and the block's K/V (jaxpar.ops.attention; by name under the policies saving dots
    too); a `fused` kernel (blockwise, cuDNN, splash) keeps q, k, v, its output and each query row's
    float32 logsumexp, nothing per key (jaxpar/ops/blockwise_attention.py, FlashAttention-2's residuals)."""
    d, h, hq, hkv, f = m.d_model, m.heads, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_dim
    sc = h * s_kv
    inv = [("layer input x", d, None, False, REMAT), *_jax_norm("norm1", d), ("norm1 out", d, None, False, NONE_ONLY),
           ("q, k, v", hq + 2 * hkv, None, True, JAX_DOT)]
    if fused:
        inv += [("softmax logsumexp (float32)", h, F32, True, NONE_ONLY)]
    elif ring_blocks:
        inv += [("ring running out, max, sum", ring_blocks * (hq + 2 * h), F32, True, JAX_DOT),   # named:
                ("ring K/V blocks", ring_blocks * 2 * hkv, None, True, JAX_DOT)]           # ops.attention.RING_NAMES
    else:
        inv += [("scores QK^T (float32)", sc, F32, True, JAX_BDOT), ("exp(scores - max)", sc, F32, True, NONE_ONLY),
                ("probabilities", sc, None, True, NONE_ONLY), ("softmax max, sum", 2 * h, F32, True, NONE_ONLY)]
    inv += [("attention out PV", hq, None, True, frozenset({"none", "dots"})),
            ("o-proj out", d, None, False, JAX_DOT_ONLY), *_jax_norm("norm2", d),
            ("norm2 out", d, None, False, NONE_ONLY), ("mlp down out", d, None, False, JAX_DOT_ONLY)]
    if m.mlp_type == "swiglu":
        inv += [("gate, up", 2 * f, None, True, JAX_DOT), ("silu pieces, silu*up", 4 * f, None, True, NONE_ONLY)]
    else:
        inv += [("gelu in", f, None, True, JAX_DOT), ("gelu (tanh form) pieces", 3 * f, None, True, NONE_ONLY)]
    return tuple(inv)


@per_model
def jax_mamba_inventory(m: ModelConfig) -> tuple[tuple, ...]:
    """One Mamba-2 block as jaxpar's JAX program keeps it (models/mamba.py, jaxpar/ops/ssd.py), with
    D = d_inner, H heads, G*N = ngroups*d_state, Q = chunk, K = d_conv, per token."""
    d, di, h, gn, q = m.d_model, m.d_inner, m.ssm_heads, m.ngroups * m.d_state, m.chunk
    d_in_proj, conv_dim, _ = mamba_dims(m)
    states = di * m.d_state / q
    return (("layer input x", d, None, False, REMAT), *_jax_norm("norm", d), ("norm out", d, None, False, NONE_ONLY),
            ("in_proj out zxBCdt", d_in_proj, None, True, JAX_DOT_ONLY), ("z", di, None, True, NONE_ONLY),
            ("conv shifted inputs, sum", (m.d_conv + 1) * conv_dim, None, True, NONE_ONLY),
            ("silu(conv) pieces", 2 * conv_dim + di, None, True, NONE_ONLY),
            ("softplus(dt) pieces", 3 * h, F32, True, NONE_ONLY),
            ("SSD x*dt, B, C, x*decay (float32)", 2 * di + 2 * gn, F32, True, NONE_ONLY),
            ("SSD decay segsums, exp, C B^T o L (float32)", 4 * h * q + 4 * h, F32, True, NONE_ONLY),
            ("SSD segsum masks", 2 * h * q, BOOL, True, NONE_ONLY),
            ("SSD chunk states, carried states, transposed (float32)", 2 * states + di, F32, True, NONE_ONLY),
            ("SSD einsum outputs (float32)", m.ngroups * q + 2 * di + 2 * states, F32, True, JAX_BDOT),
            ("y + D x", di, None, True, NONE_ONLY),
            ("gated norm silu(z) pieces", 3 * di, None, True, NONE_ONLY),
            ("gated norm u, u*rsqrt, out (float32)", 3 * di, F32, True, NONE_ONLY),
            ("gated norm rsqrt, mean", 2 * m.ngroups, F32, True, NONE_ONLY),
            ("out_proj out", d, None, False, JAX_DOT_ONLY))


@per_model
def jax_moe_inventory(m: ModelConfig, s_kv: float, ring_blocks: int, rows: float,
                      fused: bool = False) -> tuple[tuple, ...]:
    """One MoE block as jaxpar's program keeps it (models/moe.py, jaxpar/ops/moe.py), per token: the
    attention half, router logits, scores and probabilities (float32), the queue's one-hots (int32),
    the experts' input buffers at `rows` rows per token (E*C_loc/s_loc: the static buffers; under
    expert parallelism the received ones: an all_to_all's transpose needs no input), the experts'
    batched gate/up einsum outputs (kept by `none` and `dots`) and SwiGLU pieces, and the combine's
    float32 picked copies (the router weights' gradient reads them; the expert outputs themselves
    are not kept)."""
    d, f, e, k, sf = m.d_model, m.moe_mlp_dim, m.experts, m.top_k, m.shared_experts * m.moe_mlp_dim
    inv = [*attention_half(jax_attention_inventory(m, s_kv, ring_blocks, fused)),
           ("router logits, scores, probabilities (float32)", 3 * e, F32, False, NONE_ONLY),
           ("queue one-hots (int32)", 2 * k * e, F32, False, NONE_ONLY),
           ("expert input buffers", rows * d, None, False, NONE_ONLY),
           ("expert gate, up", 2 * rows * f, None, True, frozenset({"none", "dots"})),
           ("expert silu pieces, silu*up", 4 * rows * f, None, True, NONE_ONLY),
           ("combine picked copies (float32)", k * d, F32, False, NONE_ONLY)]
    if sf:
        inv += [("shared gate, up", 2 * sf, None, True, JAX_DOT), ("shared silu pieces, silu*up", 4 * sf, None, True, NONE_ONLY)]
    return tuple(inv)
