"""A decoder-only language model: embedding, scanned runs of layer units, final norm, LM head.

The layers are `cfg.runs` (models/config.py): each run is `count` repetitions of a *unit* of blocks ("A"
attention block, "M" Mamba-2 block, "E" attention + mixture-of-experts block), its parameters stacked on a
leading `layers` axis (created with nnx.vmap) and applied with `jax.lax.scan`, so a 126-layer model
compiles one unit body, and DeepSeek-V3's 3 dense + 58 MoE layers two; the pipeline splits the same
stacks across stages.

The public pieces, so that pipeline parallelism can replace the middle:
    embed(tokens) -> x          apply_stack(x, positions) -> x          loss(x, labels) -> scalar

MoE blocks also return the sums their auxiliary losses and router statistics are made of (models/moe.py:
a float32 vector per block). A unit concatenates its blocks' vectors; each run's scan emits one per unit as
its per-iteration output (stacked [units, n], no carry), and `apply_stack_aux` turns them into the losses
and statistics summed over the layers (moe.aux_sum). `loss(x, labels, aux=...)`
adds the weighted auxiliary losses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig, Run
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import RMSNorm, dtype_of, param
from jaxpar.models.mamba import MambaBlock
from jaxpar.models.moe import MoEBlock, aux_loss, aux_sum, mtp_aux_loss
from jaxpar.models.mtp import MTPModule, ahead
from jaxpar.models.transformer import RESIDUAL, AttentionBlock
from jaxpar.xla_workarounds import gathered, lookup


def block_class(kind: str):
    if kind == "A":
        return AttentionBlock
    if kind == "E":
        return MoEBlock
    return MambaBlock


class Unit(nnx.Module):
    """One repetition of a run's unit: its blocks applied in order. Returns (x, its MoE blocks' statistics
    vectors concatenated, or None when it has none)."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, unit: str, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([block_class(kind)(cfg, run, rngs=rngs) for kind in unit])

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        aux = None
        for block in self.blocks:  # segment ids (packed documents) reach the attention blocks only
            x = block(x, positions) if segments is None else block(x, positions, segments)
            if isinstance(x, tuple):  # a MoE block: (x, auxiliary vector)
                x, a = x
                aux = a if aux is None else jnp.concatenate([aux, a])
        return x, aux


class LM(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: RunConfig = RunConfig(), *, rngs: nnx.Rngs):
        self.cfg, self.run = cfg, run
        self.embedding = param(rngs, (cfg.vocab, cfg.d_model), ("vocab", "embed"), std=1.0)
        self.runs = nnx.List([stacked_units(cfg, run, r, rngs) for r in cfg.runs])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), std=cfg.d_model ** -0.5)
        if cfg.mtp_depth:
            self.mtp = nnx.List([MTPModule(cfg, run, rngs=rngs) for _ in range(cfg.mtp_depth)])

    # ---- the three stages ----------------------------------------------------------------------
    def embed(self, tokens: jax.Array) -> jax.Array:
        """The embedding rows of tokens [b, s], vocab-parallel: each tensor rank holds part of the vocab and
        looks up partial rows, summed over `tensor`; then the residual layout."""
        x = lookup(self.embedding[...], tokens, ("vocab", "embed"), dtype_of(self.run), ("batch", "seq", "act_embed"))
        return constrain(x, RESIDUAL)

    def apply_stack(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.apply_stack_aux(x, positions)[0]

    def apply_stack_aux(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array | None]:
        """(x, the MoE blocks' auxiliary vectors summed over every layer; None without MoE blocks);
        `segments`: packed documents' ids, which attention keeps apart."""
        stats = []
        for units in self.runs:
            graphdef, stacked = nnx.split(units)
            x, aux = self.run.scan(unit_body(graphdef, positions, segments), x, stacked)
            stats += [] if aux is None else [aux.reshape(-1)]
        return x, (aux_sum(self.cfg, jnp.concatenate(stats)) if stats else None)

    def loss(self, x: jax.Array, labels: jax.Array, weights: jax.Array | None = None,
             aux: jax.Array | None = None) -> jax.Array:
        """Mean token cross-entropy of the final norm's output (`cross_entropy`), plus the MoE layers'
        auxiliary losses and, with mtp_depth, the multi-token prediction losses (`mtp_loss`)."""
        h = constrain(self.final_norm(x), ("batch", "seq", "act_embed"))
        loss = self.cross_entropy(h, labels, weights)
        if aux is not None:
            loss = loss + aux_loss(self.cfg, aux)
        if self.cfg.mtp_depth:
            loss = loss + self.mtp_loss(h, labels)
        return loss

    def cross_entropy(self, h: jax.Array, labels: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """The (weighted) mean token cross-entropy of the head on normed h, vocab-parallel: logits stay
        sharded on `act_vocab`, the log-sum-exp and the label logit are reductions over vocab (all-reduces
        when it is sharded), so no device ever holds the full [b, s, vocab] logits."""
        w = self.embedding[...].T if self.cfg.tie_embeddings else self.head[...]
        logits = (h @ gathered(w, ("embed", "vocab"), h.dtype)).astype(jnp.float32)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        one_hot = jax.nn.one_hot(labels, self.cfg.vocab, dtype=jnp.float32)
        label_logit = jnp.sum(logits * constrain(one_hot, ("batch", "seq", "act_vocab")), axis=-1)
        nll = lse - label_logit
        if weights is None:
            return jnp.mean(nll)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    def mtp_loss(self, h: jax.Array, labels: jax.Array) -> jax.Array:
        """mtp_weight / depth x the sum over the modules of their mean token loss (models/mtp.py), from the
        normed main output h and the labels; a MoE module adds its bias probe and z-loss."""
        cfg = self.cfg
        order = self.run.stored_positions(labels.shape[1])
        positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), labels.shape)
        total, extra = 0.0, 0.0
        for k, module in enumerate(self.mtp, start=1):
            inputs, _ = ahead(labels, k - 1, order)                        # t_{i+k}
            targets, valid = ahead(labels, k, order)                       # t_{i+k+1}
            h, stats = module(h, self.embed(inputs), positions)
            weights = jnp.broadcast_to(jnp.asarray(valid), labels.shape)
            total = total + self.cross_entropy(constrain(module.norm(h), ("batch", "seq", "act_embed")),
                                               targets, weights)
            if stats is not None:
                extra = extra + mtp_aux_loss(cfg, stats, labels.size)
        return cfg.mtp_weight / cfg.mtp_depth * total + extra

    def __call__(self, tokens: jax.Array, positions: jax.Array, labels: jax.Array,
                 segments: jax.Array | None = None) -> jax.Array:
        x, aux = self.apply_stack_aux(self.embed(tokens), positions, segments)
        return self.loss(x, labels, aux=aux)


def stacked_units(cfg: ModelConfig, run: RunConfig, r: Run, rngs: nnx.Rngs) -> Unit:
    """The `r.count` units of run `r`, their parameters stacked on a leading `layers` dim."""
    @nnx.split_rngs(splits=r.count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_units(rngs: nnx.Rngs) -> Unit:
        return Unit(cfg, run, r.unit, rngs=rngs)
    return make_units(rngs)


def unit_body(graphdef, positions: jax.Array, segments: jax.Array | None = None):
    """The scan body: merge one unit's parameter slice and apply it. Returns (x, the unit's MoE auxiliary
    vector or None) as (carry, per-unit output); the run's LayerScan rematerialises it."""
    def body(x, unit_state):
        return nnx.merge(graphdef, unit_state)(x, positions, segments)
    return body
