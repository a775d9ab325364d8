"""A decoder-only language model: embedding, a scanned stack of units, final norm, LM head.

A *unit* is one repetition of `cfg.pattern` ("A" attention block, "M" Mamba-2 block, "E" attention +
mixture-of-experts block). The units' parameters are stacked on a leading `layers` axis (created
with nnx.vmap) and applied with `jax.lax.scan`, so a 126-layer model compiles one unit body; the
pipeline splits the same stack across stages.

The public pieces, so that pipeline parallelism can replace the middle:
    embed(tokens) -> x          apply_stack(x, positions) -> x          loss(x, labels) -> scalar

MoE blocks also return the sums their auxiliary losses and router statistics are made of (models/moe.py:
a float32 vector per block). A unit concatenates its blocks' vectors; the scan emits one per unit as its
per-iteration output (stacked [units, n], no carry), and `apply_stack_aux` turns them into the losses
and statistics summed over the layers (moe.aux_sum). `loss(x, labels, aux=...)`
adds the weighted auxiliary losses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.ops.attention import RING_NAMES
from jaxpar.ops.blockwise_attention import RESIDUAL_NAMES
from jaxpar.ops.fsdp_prefetch import prefetched_scan
from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig, RunConfig
from jaxpar.models.layers import RMSNorm, dtype_of, param
from jaxpar.models.mamba import MambaBlock
from jaxpar.models.moe import MoEBlock, aux_loss, aux_sum
from jaxpar.models.transformer import RESIDUAL, AttentionBlock
from jaxpar.xla_workarounds import gathered, lookup


def block_class(kind: str):
    if kind == "A":
        return AttentionBlock
    if kind == "E":
        return MoEBlock
    return MambaBlock


class Unit(nnx.Module):
    """One repetition of the pattern: its blocks applied in order. Returns (x, its MoE blocks' statistics
    vectors concatenated, or None when it has none)."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([block_class(kind)(cfg, run, rngs=rngs) for kind in cfg.pattern])

    def __call__(self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        aux = None
        for block in self.blocks:  # segment ids (packed documents) reach the attention blocks only
            x = block(x, positions) if segments is None else block(x, positions, segments)
            if isinstance(x, tuple):  # a MoE block: (x, auxiliary vector)
                x, a = x
                aux = a if aux is None else jnp.concatenate([aux, a])
        return x, aux


UNIT_INPUT = "unit_input"    # checkpoint_name of each unit's input: the residual stream [b, s, d] entering it

OFFLOADED = (UNIT_INPUT,)
"""What remat = "offload" keeps, and where: each unit's input (the residual stream [batch, seq, d_model] entering
the unit, in the compute dtype and the residual layout: sequence-sharded under sequence parallelism), one per
unit, copied to host memory (`pinned_host`) in the forward pass and back in the backward pass; nothing else is
saved, everything inside the unit is recomputed from that input. So the device holds what remat = "full"
holds minus the units' inputs (which "full" keeps in device memory), the host holds units x b x s x d
elements per device's shard, the host link carries them once each way per step, and the compute is "full"'s
(one more forward of every unit). MaxText's remat_policy=custom with decoder_layer_input=offload
(AI-Hypercomputer/maxtext: `checkpoint_name(x, "decoder_layer_input")` at the top of each decoder layer)
makes the same choice. Policy: jax.checkpoint_policies.save_and_offload_only_these_names. On GPU and TPU
the lowering annotates each saved input `pinned_host` (XLA's host offloading); the CPU lowering drops memory
kinds (a CPU device's memory is host memory), so there the inputs stay where "full" keeps them."""

_KERNEL_RESIDUALS = jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES, *RING_NAMES)   # the kernels'
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _KERNEL_RESIDUALS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KERNEL_RESIDUALS),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=OFFLOADED,
        offload_src="device", offload_dst="pinned_host"),
}
KEEP_UNITS = ("none", "selective")   # policies under which the layer scan is not checkpointed: selective
# recomputes only the attention blocks' cores, inside the block (models/transformer.py; Mamba-2 blocks keep
# everything, as under none), none recomputes nothing


def remat(fn, policy: str):
    """Wrap a scan body in jax.checkpoint under the named policy ("none" and "selective" leave it alone:
    selective's recompute is the attention core's own, models/transformer.py)."""
    if policy in KEEP_UNITS:
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)


class LM(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: RunConfig = RunConfig(), *, rngs: nnx.Rngs):
        self.cfg, self.run = cfg, run
        self.embedding = param(rngs, (cfg.vocab, cfg.d_model), ("vocab", "embed"), std=1.0)

        @nnx.split_rngs(splits=cfg.units)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_units(rngs: nnx.Rngs) -> Unit:
            return Unit(cfg, run, rngs=rngs)

        self.units = make_units(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), std=cfg.d_model ** -0.5)

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
        graphdef, stacked = nnx.split(self.units)
        if self.run.fsdp_prefetch:  # (remat = "full": the prefetched scan recomputes each unit backward)
            x, aux = prefetched_scan(lambda h, unit: nnx.merge(graphdef, unit)(h, positions, segments), x, stacked)
        else:
            x, aux = jax.lax.scan(unit_step(graphdef, self.run.remat, positions, segments), x, stacked)
        if aux is None:
            return x, None
        return x, aux_sum(self.cfg, aux)

    def loss(self, x: jax.Array, labels: jax.Array, weights: jax.Array | None = None,
             aux: jax.Array | None = None) -> jax.Array:
        """Mean token cross-entropy, vocab-parallel: logits stay sharded on `act_vocab`, the
        log-sum-exp and the label logit are reductions over vocab (all-reduces when it is
        sharded), so no device ever holds the full [b, s, vocab] logits."""
        x = constrain(self.final_norm(x), ("batch", "seq", "act_embed"))
        w = self.embedding[...].T if self.cfg.tie_embeddings else self.head[...]
        logits = (x @ gathered(w, ("embed", "vocab"), x.dtype)).astype(jnp.float32)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        one_hot = jax.nn.one_hot(labels, self.cfg.vocab, dtype=jnp.float32)
        label_logit = jnp.sum(logits * constrain(one_hot, ("batch", "seq", "act_vocab")), axis=-1)
        nll = lse - label_logit
        if weights is None:
            loss = jnp.mean(nll)
        else:
            loss = jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        if aux is not None:
            loss = loss + aux_loss(self.cfg, aux)
        return loss

    def __call__(self, tokens: jax.Array, positions: jax.Array, labels: jax.Array,
                 segments: jax.Array | None = None) -> jax.Array:
        x, aux = self.apply_stack_aux(self.embed(tokens), positions, segments)
        return self.loss(x, labels, aux=aux)


def unit_step(graphdef, policy: str, positions: jax.Array, segments: jax.Array | None = None):
    """The scan body: merge one unit's parameter slice and apply it (rematerialised per policy).
    Returns (x, the unit's MoE auxiliary vector or None) as (carry, per-unit output)."""
    def step(x, unit_state):
        return nnx.merge(graphdef, unit_state)(checkpoint_name(x, UNIT_INPUT), positions, segments)
    return remat(step, policy)
