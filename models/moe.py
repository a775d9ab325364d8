"""The mixture-of-experts block ("E" in a pattern): pre-norm GQA attention, then a pre-norm MoE MLP.

    logits = h @ router                     [b, s, E] in float32 (router [d, E], replicated over experts)
    scores = softmax(logits) | sigmoid(logits)
    ids, w = top_k(scores)                  w renormalised to sum 1 when cfg.router_norm, times
                                            routed_scaling_factor; under group-limited routing (n_group
                                            > 1) from the topk_group best groups only (`group_limited`);
                                            with router_bias the choice reads scores + a balancing bias
                                            that the optimizer moves against the load (`balance_probe`)
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
A block returns what they are made of as one float32 vector of sums over its tokens (`stats`: token
copies per expert, router probabilities per expert, squared log-sum-exps, kept copies), which adds up
over any split of the batch: a pipeline sums it over micro-batches (jaxpar/pipeline/gpipe.py) and then gets
the losses of the whole batch, exactly as one device does (a product of two batch means, the balance
loss is not the mean of per-micro-batch losses). A unit concatenates its MoE blocks' vectors, the layer
scan stacks them over units (models/lm.py), and `aux_sum` turns each layer's sums into the
`AUX_FIELDS` and adds them over the layers; `LM.loss` adds aux_loss_coef * mean(load balancing) +
z_loss_coef * mean(z-loss) over the MoE layers, and the training step reports the means (`aux_metrics`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.ops.collective_matmul import Matmuls
from jaxpar.ops.moe import ExpertKernel, moe_experts
from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import MLP, dtype_of, param
from jaxpar.models.transformer import RESIDUAL, AttentionBlock
from jaxpar.xla_workarounds import top_k

# What a MoE block reports, in order: the two losses, then statistics (no gradient).
AUX_FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")
TOKENS = ("batch", "seq", None)


def route(logits: jax.Array, cfg: ModelConfig, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [.., k], weights [.., k], probabilities [.., E] for the balance loss) from float32 logits; the
    choice on the scores plus `bias` [E] (DeepSeek-V3's balancing bias; no gradient), the weights the chosen
    experts' scores, renormalised (router_norm), then times routed_scaling_factor (DeepSeek-V3: 2.5)."""
    if cfg.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    ids = top_k(group_limited(choice, cfg.n_group, cfg.topk_group), cfg.top_k)
    top = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router_norm:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids, top * cfg.routed_scaling_factor, probs


def group_limited(scores: jax.Array, groups: int, keep: int) -> jax.Array:
    """The scores top-k picks from, under group-limited routing (DeepSeek-V3 section 2.1.2, node-limited
    routing; transformers' DeepseekV3MoE.route_tokens_to_experts): the experts in `groups` equal groups,
    each group scored by the sum of its two highest scores, and the experts outside the `keep` best groups
    masked out (-inf), so a token's experts sit in at most `keep` groups, which DeepSeek-V3 places on as
    many nodes. groups = 1: the scores as they are."""
    if groups == 1:
        return scores
    per_group = scores.reshape(*scores.shape[:-1], groups, scores.shape[-1] // groups)
    best_two = jnp.sort(per_group, axis=-1)[..., -2:].sum(-1)                   # [.., groups]
    chosen = jax.nn.one_hot(top_k(best_two, keep), groups, dtype=jnp.bool_).any(-2)
    return jnp.where(chosen[..., None], per_group, -jnp.inf).reshape(scores.shape)


def stats_size(cfg: ModelConfig) -> int:
    """Length of one MoE layer's statistics vector (`router_stats`): + 1 for the balancing bias's probe."""
    return 2 * cfg.experts + 2 + (1 if cfg.router_bias else 0)


def router_stats(logits, ids, probs, kept, bias: jax.Array | None) -> jax.Array:
    """One layer's sums over its tokens (float32 [stats_size]): token copies per expert [E] (no gradient),
    router probabilities per expert [E], sum of logsumexp(logits)^2, kept copies (no gradient), and with a
    balancing `bias` its probe (`balance_probe`). Sums, so that the statistics of a batch are those of its
    parts added (module docstring)."""
    copies = jax.lax.stop_gradient(jax.nn.one_hot(ids, probs.shape[-1], dtype=jnp.float32).sum(axis=(0, 1, 2)))
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    kept = jnp.sum(kept.astype(jnp.float32))
    probe = () if bias is None else (balance_probe(bias, copies)[None],)
    return jnp.concatenate([copies, jnp.sum(probs, axis=(0, 1)), z[None], jax.lax.stop_gradient(kept)[None], *probe])


def balance_probe(bias: jax.Array, copies: jax.Array) -> jax.Array:
    """0, whose gradient with respect to the balancing bias is E * copies - sum(copies): how far each expert's
    load is above the mean, in token copies (b . w - stop_gradient(b . w), w the overload). The loss adds the
    probes with weight 1 (`aux_loss`), so the bias's gradient, summed over batch shards and micro-batches
    like any other, is the whole batch's overload, and the optimizer's balancing step
    (jaxpar/training/trainer.py `make_optimizer`) moves the bias by -gamma x its sign: DeepSeek-V3's
    auxiliary-loss-free balancing (section 2.1.2), outside the loss's own gradient. Integer counts, so every
    layout computes the same signs."""
    overload = jax.lax.stop_gradient(copies.size * copies - jnp.sum(copies))
    product = jnp.sum(bias * overload)
    return product - jax.lax.stop_gradient(product)


def is_balance_bias(path) -> bool:
    """Whether a parameter's tree path (jax.tree_util) is a MoE layer's balancing bias (`router_bias`)."""
    return any(getattr(k, "key", None) == "router_bias" for k in path)


def layer_aux(stats_row: jax.Array, experts: int, top_k: int) -> jax.Array:
    """The AUX_FIELDS of one layer from its `router_stats` summed over every token of the batch, then its
    balancing probe (if any); zeros for a layer that saw no token (a pipeline's padding slot)."""
    copies, prob_sum = stats_row[:experts], stats_row[experts:2 * experts]
    z_sum, kept = stats_row[2 * experts], stats_row[2 * experts + 1]
    n = jnp.sum(copies)                                      # tokens * top_k
    seen = n > 0
    n = jnp.where(seen, n, 1.0)
    tokens = n / top_k
    load = copies / n                                        # f_e, sums to 1
    balance = experts * jnp.sum(load * prob_sum) / tokens    # load carries no gradient (router_stats)
    stats = jax.lax.stop_gradient(jnp.stack([1.0 - kept / n, experts * jnp.max(load), experts * jnp.min(load)]))
    probe = stats_row[2 * experts + 2:]                      # the balancing bias's probe, if any
    return jnp.where(seen, jnp.concatenate([jnp.stack([balance, z_sum / tokens]), stats, probe]), 0.0)


def aux_sum(cfg: ModelConfig, stats: jax.Array) -> jax.Array:
    """AUX_FIELDS summed over the MoE layers, from their statistics in any array whose size is a multiple of
    `stats_size` (the layer scan's [units, blocks * stats_size], a pipeline's [stages, repeats, slots, ...])."""
    per_layer = stats.reshape(-1, stats_size(cfg))
    return jnp.sum(jax.vmap(lambda s: layer_aux(s, cfg.experts, cfg.top_k))(per_layer), axis=0)


class MoE(nnx.Module):
    """Router, routed experts (stacked SwiGLU) and optional shared experts."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.experts, cfg.moe_mlp_dim
        self.cfg, self.run = cfg, run
        self.router = param(rngs, (d, e), ("embed", None), std=d ** -0.5)
        if cfg.router_bias:
            self.router_bias = param(rngs, (e,), (None,), value=0.0)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=d ** -0.5)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=d ** -0.5)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), std=f ** -0.5 / math.sqrt(2 * cfg.layers))
        if cfg.shared_experts:  # it reads the gathered tokens the router reads: plain matmuls (no rings)
            self.shared = MLP(cfg, dataclasses.replace(run, matmuls=Matmuls(fp8=run.matmuls.fp8)), rngs=rngs,
                              width=cfg.shared_experts * f, gated=True)

    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dt = self.cfg, dtype_of(self.run)
        logits = constrain(h.astype(jnp.float32) @ self.router[...].astype(jnp.float32), TOKENS)
        bias = self.router_bias[...] if cfg.router_bias else None
        ids, weights, probs = route(logits, cfg, bias)
        y, kept = moe_experts(h, constrain(ids, TOKENS), constrain(weights, TOKENS),
                              self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt),
                              capacity_factor=cfg.capacity_factor,
                              kernel=ExpertKernel(self.run.moe_kernel, self.run.matmuls.fp8))
        if cfg.shared_experts:
            y = y + self.shared(h)
        return y, router_stats(logits, ids, probs, kept, bias)


class MoEBlock(AttentionBlock):
    """x + Attention(norm(x)), then + MoE(norm(.)); returns (residual stream, `router_stats` vector)."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        self.init_attention(cfg, run, rngs)
        self.moe = MoE(cfg, run, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        x, h = self.attend(x, positions, segments)
        # under collective matmul attend leaves h in the residual layout for the MLP's rings; the router and
        # the experts read it gathered (once for both), as with plain projections
        y, aux = self.moe(constrain(h, ("batch", "seq", "act_embed")))
        return constrain(x + y, RESIDUAL), aux


def aux_loss(cfg: ModelConfig, aux_sum: jax.Array) -> jax.Array:
    """What the MoE layers add to the loss, from the AUX_FIELDS summed over every MoE layer."""
    n = cfg.moe_layers
    probes = aux_sum[len(AUX_FIELDS)] if cfg.router_bias else 0.0   # 0, for the balancing bias's gradient
    return (cfg.aux_loss_coef * aux_sum[0] + cfg.z_loss_coef * aux_sum[1]) / n + probes


def mtp_aux_loss(cfg: ModelConfig, stats: jax.Array, tokens: int) -> jax.Array:
    """What a multi-token prediction module's MoE block adds to the loss (models/mtp.py): its z-loss and its
    bias probe per token, both means over the tokens, so that the heads of a pipeline's micro-batches add up
    to one device's (the probe's sign is what moves the bias); no balance loss."""
    a = aux_sum(cfg, stats)
    probe = a[len(AUX_FIELDS)] / tokens if cfg.router_bias else 0.0
    return cfg.z_loss_coef * a[1] / cfg.moe_layers + probe


def aux_metrics(cfg: ModelConfig, aux_sum: jax.Array) -> dict[str, jax.Array]:
    """Per-step router metrics: each AUX_FIELDS entry averaged over the MoE layers."""
    return {name: aux_sum[i] / cfg.moe_layers for i, name in enumerate(AUX_FIELDS)}
