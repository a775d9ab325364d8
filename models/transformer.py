"""The LLaMA-style attention block: pre-norm GQA attention with RoPE, then a pre-norm MLP.

Tensor parallelism comes from the names alone: q/k/v are column-parallel (heads on `tensor`), the
output projection row-parallel, so XLA inserts one all-reduce (or, under sequence parallelism, a
reduce-scatter + all-gather pair) per sub-block.
"""
from __future__ import annotations

import math

import jax
from flax import nnx

from jaxpar.ops.attention import attention
from jaxpar.sharding import constrain
from jaxpar.models.config import ModelConfig, RunConfig
from jaxpar.models.layers import MLP, RMSNorm, dtype_of, param, rope

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

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self.project(x, positions)
        return self.output(attention(q, k, v, positions, impl=self.run.attention, causal=True))

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, heads, head_dim] and k, v [b, s, kv_heads, head_dim], RoPE applied to q and k
        (models/decode.py caches k and v)."""
        dt = dtype_of(self.run)
        q = jax.numpy.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt))
        k = jax.numpy.einsum("bsd,dhk->bshk", x, self.wk[...].astype(dt))
        v = jax.numpy.einsum("bsd,dhk->bshk", x, self.wv[...].astype(dt))
        q = constrain(rope(q, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_heads", None))
        k = constrain(rope(k, positions, self.cfg.rope_theta, self.cfg.rope_scaling), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The row-parallel output projection of the attention output [b, s, heads, head_dim]."""
        out = constrain(out, ("batch", "seq", "act_heads", None))
        return jax.numpy.einsum("bshk,hkd->bsd", out, self.wo[...].astype(dtype_of(self.run)))


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

    def attend(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + Attention(norm(x)), its normed copy: the feed-forward's input)."""
        h = constrain(self.attn_norm(x), ("batch", "seq", "act_embed"))
        x = constrain(x + self.attn(h, positions), RESIDUAL)
        return x, constrain(self.mlp_norm(x), ("batch", "seq", "act_embed"))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x, h = self.attend(x, positions)
        return constrain(x + self.mlp(h), RESIDUAL)
