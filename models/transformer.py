"""The LLaMA-style attention block: pre-norm GQA attention with RoPE, then a pre-norm MLP.

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q), RoPE(k)
    x = x + softmax(q k^T / sqrt(d) + causal mask) v Wo;  x = x + MLP(RMSNorm(x))

Tensor parallelism comes from the names alone: q/k/v are column-parallel (heads on `tensor`), the output
projection row-parallel, so XLA inserts one all-reduce (or, under sequence parallelism, a reduce-scatter +
all-gather pair) per sub-block. How the projections and the core run (plain dots or collective matmul rings;
the sequence split, the kernel, selective recompute) is the run's (models/run.py), chosen outside the model.
"""
from __future__ import annotations

import math

import jax
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import MLP, RMSNorm, dtype_of, param, rope
from jaxpar.models.mla import LatentAttention

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
        return self.output(self.run.core(q, k, v, positions, segments))

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, heads, head_dim] and k, v [b, s, kv_heads, head_dim], RoPE applied to q and k (after
        their per-head RMSNorm under cfg.qk_norm); models/decode.py caches k and v."""
        dt, read = dtype_of(self.run), self.run.matmuls.weight
        weights = (read(self.wq[...], ("embed", "q_heads", "head_dim"), dt),
                   read(self.wk[...], ("embed", "kv_heads", "head_dim"), dt),
                   read(self.wv[...], ("embed", "kv_heads", "head_dim"), dt))
        q, k, v = self.run.matmuls.column(x, weights)    # [b, s, d] . [d, heads, head_dim]
        if self.cfg.qk_norm:  # each head normalised over head_dim before RoPE (Qwen3's q_norm, k_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rope(q, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_heads", None))
        k = constrain(rope(k, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The row-parallel output projection of the attention output [b, s, heads, head_dim]."""
        out = constrain(out, ("batch", "seq", "act_heads", None))
        # read by the product and its transpose: gathered once for both where the unit is recomputed
        wo = self.run.recomputed_weight(self.wo[...], ("q_heads", "head_dim", "embed"), dtype_of(self.run))
        return self.run.matmuls.row(out, wo)             # [b, s, heads, head_dim] . [heads, head_dim, d]


class AttentionBlock(nnx.Module):
    """x + Attention(norm(x)), then + MLP(norm(.)). Input and output are the residual stream."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        self.init_attention(cfg, run, rngs)
        self.mlp = MLP(cfg, run, rngs=rngs)

    def init_attention(self, cfg: ModelConfig, run: RunConfig, rngs: nnx.Rngs) -> None:
        """The attention half and the feed-forward's pre-norm (shared with models/moe.py's MoEBlock)."""
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = LatentAttention(cfg, run, rngs=rngs) if cfg.mla else Attention(cfg, run, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)

    def attend(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(x + Attention(norm(x)), its normed copy: the feed-forward's input), the normed copies in the
        layout the projections read (`Matmuls.input_names`)."""
        inner = self.attn.run.matmuls.input_names
        h = constrain(self.attn_norm(x), inner)
        x = constrain(x + self.attn(h, positions, segments), RESIDUAL)
        return x, constrain(self.mlp_norm(x), inner)

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        x, h = self.attend(x, positions, segments)
        return constrain(x + self.mlp(h), RESIDUAL)
