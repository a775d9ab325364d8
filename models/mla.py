"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3 section 2.1).

K and V are compressed into one latent per token, c = RMSNorm(h W_kv_a) [kv_lora_rank], from which every
head's key and value are up-projected; a decoupled RoPE key, one head of qk_rope_head_dim shared by all
heads, carries the position. The query goes through its own low-rank latent (q_lora_rank; 0 = a full
projection):

    c_q = RMSNorm(h W_q_a);  q = c_q W_q_b = [q_nope, q_rope]    q_rope = RoPE(q_rope), per head
    c = RMSNorm(h W_kv_a);   k = [c W_k_b, RoPE(h W_k_rope)]       the RoPE part broadcast to every head
    v = c W_v_b;             out = softmax(q k^T / sqrt(qk_nope + qk_rope) + mask) v W_o

Heads are (q_heads) on `tensor` like GQA's; the latents' dim ("latent") follows the model dim under ZeRO
(jaxpar/core/rules.py) and is replicated over `tensor`, so a tensor rank computes the whole latent and its
own heads from it. Training and prefill attend over the expanded K/V (`project`, the same kernels as GQA:
q/k heads of head_dim, v heads of v_head_dim); decoding keeps only c and the RoPE key, kv_lora_rank +
qk_rope_head_dim values per token and layer, and folds W_k_b into the query and W_v_b into the output
(models/decode.py `mla_block`; DeepSeek-V2 section 2.1.2). Under YaRN (cfg.rope_type "yarn") the softmax
scale is multiplied by mscale^2 (`ModelConfig.latent_softmax_scale`), folded into q, so every kernel and
the decode cache's readers see it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import RMSNorm, dtype_of, param, rope

HEADS = ("batch", "seq", "act_heads", None)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d, h, hd, r, c = cfg.d_model, cfg.heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.cfg, self.run = cfg, run
        if cfg.q_lora_rank:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), ("embed", "latent"), std=d ** -0.5)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, rngs=rngs, name="latent")
            self.wq_b = param(rngs, (cfg.q_lora_rank, h, hd), ("latent", "q_heads", "head_dim"),
                              std=cfg.q_lora_rank ** -0.5)
        else:
            self.wq = param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), std=d ** -0.5)
        self.wkv_a = param(rngs, (d, c), ("embed", "latent"), std=d ** -0.5)
        self.kv_norm = RMSNorm(c, cfg.norm_eps, rngs=rngs, name="latent")
        self.wk_rope = param(rngs, (d, r), ("embed", "head_dim"), std=d ** -0.5)
        self.wk_b = param(rngs, (c, h, cfg.qk_nope_head_dim), ("latent", "q_heads", "head_dim"), std=c ** -0.5)
        self.wv_b = param(rngs, (c, h, cfg.v_head_dim), ("latent", "q_heads", "head_dim"), std=c ** -0.5)
        self.wo = param(rngs, (h, cfg.v_head_dim, d), ("q_heads", "head_dim", "embed"),
                        std=(h * cfg.v_head_dim) ** -0.5 / math.sqrt(2 * cfg.layers))

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        q, k, v = self.project(x, positions)
        return self.output(self.run.core(q, k, v, positions, segments))

    def query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope [b, s, heads, qk_nope], q_rope [b, s, heads, qk_rope] with RoPE applied)."""
        dt = dtype_of(self.run)
        if self.cfg.q_lora_rank:
            cq = self.q_norm(self.run.matmuls.project(x, self.wq_a[...].astype(dt)))
            q = self.run.matmuls.project(cq, self.wq_b[...].astype(dt))
        else:
            q = self.run.matmuls.project(x, self.wq[...].astype(dt))
        if self.cfg.latent_softmax_scale != 1.0:   # YaRN's mscale^2 on the softmax scale, folded into q
            q = q * jnp.asarray(self.cfg.latent_softmax_scale, q.dtype)
        q = constrain(q, HEADS)
        nope = self.cfg.qk_nope_head_dim
        return q[..., :nope], rope(q[..., nope:], positions, self.cfg.rope_theta, self.cfg.rope_scaling)

    def latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the decode cache keeps per token: (c [b, s, kv_lora_rank], the RoPE key [b, s, qk_rope])."""
        dt = dtype_of(self.run)
        c = self.kv_norm(self.run.matmuls.project(x, self.wkv_a[...].astype(dt)))
        k_rope = self.run.matmuls.project(x, self.wk_rope[...].astype(dt))
        k_rope = rope(k_rope[:, :, None, :], positions, self.cfg.rope_theta, self.cfg.rope_scaling)[:, :, 0]
        return constrain(c, ("batch", "seq", None)), constrain(k_rope, ("batch", "seq", None))

    def expand(self, c: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every head's k [b, s, heads, head_dim] and v [b, s, heads, v_head_dim] from the latent."""
        dt = dtype_of(self.run)
        k_nope = self.run.matmuls.project(c, self.wk_b[...].astype(dt))
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + k_rope.shape[-1:])], -1)
        v = self.run.matmuls.project(c, self.wv_b[...].astype(dt))
        return constrain(k, HEADS), constrain(v, HEADS)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k [b, s, heads, head_dim] and v [b, s, heads, v_head_dim], the expanded form the kernels read."""
        q_nope, q_rope = self.query(x, positions)
        k, v = self.expand(*self.latent(x, positions))
        return constrain(jnp.concatenate([q_nope, q_rope], -1), HEADS), k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The row-parallel output projection of the attention output [b, s, heads, v_head_dim]."""
        out = constrain(out, HEADS)
        wo = self.run.recomputed_weight(self.wo[...], ("q_heads", "head_dim", "embed"), dtype_of(self.run))
        return self.run.matmuls.row(out, wo)
