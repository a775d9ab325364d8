"""The mixture-of-experts block ("E" in a pattern): pre-norm GQA attention, then a pre-norm MoE MLP.

    logits = h @ router                     [b, s, E] in float32 (router [d, E], replicated over experts)
    scores = softmax(logits) | sigmoid(logits)
    ids, w = top_k(scores)                  w renormalised to sum 1 when cfg.router_norm
    y = sum_j w_j * SwiGLU_{ids_j}(h)       jaxpar.ops.moe: dispatch, experts, combine (local or
                                            expert-parallel over the `expert` mesh axis)
      + SwiGLU_shared(h)                    cfg.shared_experts always-on experts, as one wide SwiGLU

The experts are stacked: w_gate, w_up [E, d, f] with logical names ("experts", "embed", "mlp") and
w_down [E, f, d] ("experts", "mlp", "embed"), so the rules table puts experts on `expert`, the
expert width on `tensor` and the model dim on `fsdp` (ZeRO-3), as for any other weight.

Auxiliary losses, per MoE layer, over every token of the batch (so they do not depend on the mesh):
    load balancing (Switch Transformer eq. 4; GShard)  E * sum_e f_e * p_e, with f_e the fraction of
        the b*s*k token copies routed to e (before capacity drops; it sums to 1, so a balanced router
        scores 1 whatever k) and p_e the mean router probability of e (sigmoid router: the scores
        normalised over the experts, as DeepSeek-V3's balance loss does);
    router z-loss (ST-MoE, Zoph et al. 2022, eq. 5)     mean over tokens of logsumexp(logits)^2.
A block returns them with router statistics as one float32 vector (`AUX_FIELDS`); the layer scan
sums the vectors of a unit's MoE blocks and stacks them over units (models/lm.py), `LM.loss` adds
aux_loss_coef * mean(load balancing) + z_loss_coef * mean(z-loss) over the MoE layers, and the
training step reports the means (`aux_metrics`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.ops.moe import moe_experts
from jaxpar.sharding import constrain
from jaxpar.models.config import ModelConfig, RunConfig
from jaxpar.models.layers import MLP, dtype_of, param
from jaxpar.models.transformer import RESIDUAL, AttentionBlock

# What a MoE block reports, in order: the two losses, then statistics (no gradient).
AUX_FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")
TOKENS = ("batch", "seq", None)


def route(logits: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [.., k], weights [.., k], probabilities [.., E] for the balance loss) from float32 logits."""
    if cfg.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    ids = top_k(scores, cfg.top_k)
    top = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router_norm:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids, top, probs


def top_k(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest scores, largest first, ties to the lower index (as lax.top_k): k
    argmax passes. XLA's SPMD partitioner gathers a batch-sharded lax.top_k operand onto every
    device; an argmax is a reduction over the unsharded expert dim, so it stays sharded."""
    picked = []
    for _ in range(k):
        i = jnp.argmax(scores, axis=-1)
        picked.append(i)
        scores = jnp.where(jax.nn.one_hot(i, scores.shape[-1], dtype=jnp.bool_), -jnp.inf, scores)
    return jnp.stack(picked, axis=-1).astype(jnp.int32)


def router_aux(logits, ids, probs, kept, experts: int) -> jax.Array:
    """The AUX_FIELDS of one layer, over every token (float32 [len(AUX_FIELDS)])."""
    copies = jnp.sum(jax.nn.one_hot(ids, experts, dtype=jnp.float32), axis=-2)       # [b, s, E]
    load = jnp.mean(copies, axis=(0, 1)) / ids.shape[-1]                              # f_e, sums to 1
    balance = experts * jnp.sum(jax.lax.stop_gradient(load) * jnp.mean(probs, axis=(0, 1)))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    stats = jax.lax.stop_gradient(jnp.stack([1.0 - jnp.mean(kept.astype(jnp.float32)),
                                             experts * jnp.max(load), experts * jnp.min(load)]))
    return jnp.concatenate([jnp.stack([balance, z]), stats])


class MoE(nnx.Module):
    """Router, routed experts (stacked SwiGLU) and optional shared experts."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.experts, cfg.moe_mlp_dim
        self.cfg, self.run = cfg, run
        self.router = param(rngs, (d, e), ("embed", None), std=d ** -0.5)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=d ** -0.5)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=d ** -0.5)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), std=f ** -0.5 / math.sqrt(2 * cfg.layers))
        if cfg.shared_experts:  # it reads the gathered tokens the router reads: plain matmuls (no rings)
            self.shared = MLP(cfg, dataclasses.replace(run, overlap="none"), rngs=rngs,
                              width=cfg.shared_experts * f, gated=True)

    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dt = self.cfg, dtype_of(self.run)
        logits = constrain(h.astype(jnp.float32) @ self.router[...].astype(jnp.float32), TOKENS)
        ids, weights, probs = route(logits, cfg)
        y, kept = moe_experts(h, constrain(ids, TOKENS), constrain(weights, TOKENS),
                              self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt),
                              capacity_factor=cfg.capacity_factor)
        if cfg.shared_experts:
            y = y + self.shared(h)
        return y, router_aux(logits, ids, probs, kept, cfg.experts)


class MoEBlock(AttentionBlock):
    """x + Attention(norm(x)), then + MoE(norm(.)); returns (residual stream, AUX_FIELDS vector)."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        self.init_attention(cfg, run, rngs)
        self.moe = MoE(cfg, run, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, h = self.attend(x, positions)
        # under `overlap` attend leaves h in the residual layout for the MLP's rings; the router and the
        # experts read it gathered (once for both), as without the option
        y, aux = self.moe(constrain(h, ("batch", "seq", "act_embed")))
        return constrain(x + y, RESIDUAL), aux


def aux_loss(cfg: ModelConfig, aux_sum: jax.Array) -> jax.Array:
    """What the MoE layers add to the loss, from the AUX_FIELDS summed over every MoE layer."""
    n = cfg.moe_layers
    return (cfg.aux_loss_coef * aux_sum[0] + cfg.z_loss_coef * aux_sum[1]) / n


def aux_metrics(cfg: ModelConfig, aux_sum: jax.Array) -> dict[str, jax.Array]:
    """Per-step router metrics: each AUX_FIELDS entry averaged over the MoE layers."""
    return {name: aux_sum[i] / cfg.moe_layers for i, name in enumerate(AUX_FIELDS)}
