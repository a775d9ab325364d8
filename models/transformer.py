"""The LLaMA-style attention block: pre-norm GQA attention with RoPE, then a pre-norm MLP.

Tensor parallelism comes from the names alone: q/k/v are column-parallel (heads on `tensor`), the
output projection row-parallel, so XLA inserts one all-reduce (or, under sequence parallelism, a
reduce-scatter + all-gather pair) per sub-block. Under the `overlap` option the projections call the
collective-matmul kernels instead (jaxpar/ops/collective_matmul.py), which spell that all-gather and
reduce-scatter out as ring steps between partial matmuls.

Selective recomputation (remat = "selective"; Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models"): the attention core, softmax(q k^T / sqrt(d)) v with its
mask, is recomputed in the backward pass from q, k, v, which are saved with every other activation
of the layer; its score and probability matrices [b, heads, s, s], the activations that grow as s^2,
are never kept. Its output (the input of the output projection) is saved as the projection's
input. Other recompute policies act on the whole unit (models/lm.py).
"""
from __future__ import annotations

import functools
import math

import jax
from flax import nnx

from jaxpar.ops.attention import attention, recomputed
from jaxpar.ops.collective_matmul import column_parallel, row_parallel
from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig, RunConfig
from jaxpar.models.layers import MLP, RMSNorm, collective_matmul, dtype_of, param, rope
from jaxpar.xla_workarounds import gathered

RESIDUAL = ("batch", "res_seq", "act_embed")


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cfg, self.run = cfg, run
        self.wq = param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), std=d ** -0.5)
        self.wk = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), std=d ** -0.5)
        self.wv = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), std=d ** -0.5)
        self.wo = param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"),
                        std=(h * hd) ** -0.5 / math.sqrt(2 * cfg.layers))
        if cfg.qk_norm:  # Qwen3: one scale per head_dim entry, shared by the heads
            self.q_norm = RMSNorm(hd, cfg.norm_eps, rngs=rngs, name="head_dim")
            self.k_norm = RMSNorm(hd, cfg.norm_eps, rngs=rngs, name="head_dim")

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        q, k, v = self.project(x, positions)
        core = functools.partial(attention, impl=self.run.attention, kernel=self.run.attention_kernel, causal=True)
        if self.run.remat == "selective":
            core = recomputed(core)
        return self.output(core(q, k, v, positions, segments))

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, heads, head_dim] and k, v [b, s, kv_heads, head_dim], RoPE applied to q and k (after
        their per-head RMSNorm under cfg.qk_norm); models/decode.py caches k and v."""
        dt, cm = dtype_of(self.run), collective_matmul(self.run)
        weights = (self.wq[...].astype(dt), self.wk[...].astype(dt), self.wv[...].astype(dt))
        if cm is None:
            q, k, v = (jax.numpy.einsum("bsd,dhk->bshk", x, w) for w in weights)
        else:  # x in the residual layout: one ring all-gathers it for the three projections
            q, k, v = column_parallel(x, weights, **cm)
        if self.cfg.qk_norm:  # each head normalised over head_dim before RoPE (Qwen3's q_norm, k_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rope(q, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_heads", None))
        k = constrain(rope(k, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The row-parallel output projection of the attention output [b, s, heads, head_dim]."""
        out = constrain(out, ("batch", "seq", "act_heads", None))
        wo, cm, dt = self.wo[...], collective_matmul(self.run), dtype_of(self.run)
        # when the unit is recomputed only: without it a gathered copy would be kept for the backward
        # pass, every layer's alive at once, which is what FSDP avoids (jaxpar/xla_workarounds.py)
        recompute = self.run.remat not in ("none", "selective")
        wo = gathered(wo, ("q_heads", "head_dim", "embed"), dt) if recompute else wo.astype(dt)
        if cm is not None:  # reduce-scattered onto the residual layout in ring steps
            return row_parallel(out, wo, **cm)
        return jax.numpy.einsum("bshk,hkd->bsd", out, wo)


class AttentionBlock(nnx.Module):
    """x + Attention(norm(x)), then + MLP(norm(.)). Input and output are the residual stream."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        self.init_attention(cfg, run, rngs)
        self.mlp = MLP(cfg, run, rngs=rngs)

    def init_attention(self, cfg: ModelConfig, run: RunConfig, rngs: nnx.Rngs) -> None:
        """The attention half and the feed-forward's pre-norm (shared with models/moe.py's MoEBlock)."""
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, run, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)

    def attend(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(x + Attention(norm(x)), its normed copy: the feed-forward's input). The normed copies are
        gathered to the block's sequence layout, except under `overlap`, where the projections'
        collective matmuls gather them (so they stay in the residual layout here)."""
        inner = RESIDUAL if collective_matmul(self.attn.run) else ("batch", "seq", "act_embed")
        h = constrain(self.attn_norm(x), inner)
        x = constrain(x + self.attn(h, positions, segments), RESIDUAL)
        return x, constrain(self.mlp_norm(x), inner)

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        x, h = self.attend(x, positions, segments)
        return constrain(x + self.mlp(h), RESIDUAL)
