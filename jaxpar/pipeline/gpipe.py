"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular schedules, GSPMD-style.

The stacked layer units [U, ...] are cut into S*v chunks (jaxpar/core/schedule.py) and viewed as [S, v, k,
...], sharded on `pipeline` (an even split is stored stage-major, jaxpar/pipeline/order.py: the view is a
reshape; an uneven one moves each stage's units to it once per step). One `lax.scan` runs T = v*M + S - 1
iterations: every stage applies its chunk to one micro-batch (a `vmap` over the stage dim), a ppermute shifts
the outputs one stage up, bubbles are masked so their gradients are exactly zero; jax.grad differentiates
the loop. After it the last stage's outputs are spread over the stages by one all-to-all, each stage running
the final norm, head and loss on M'/S micro-batches (the head's FLOPs once per step). FSDP inside the stages
gathers the stage view once per step, before the loop, and copies it per batch shard
(jaxpar/pipeline/stages.py), so the weight gradients cross `data` and `fsdp` once per step. MoE router
statistics accumulate per layer over the micro-batches, so the router losses are the whole batch's.
Bubble (S-1)/(v*M+S-1) (GPipe: Huang et al. 2019; circular: Narayanan et al. 2021). docs/pipelines.md has
the schedule step by step, its buffers and its communication per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.core.schedule import Schedule, schedule_of
from jaxpar.core.sharding import Layout, constrain, spec_for, use_layout
from jaxpar.core.rules import spec_entry
from jaxpar.core.strategy import Strategy
from jaxpar.ops.layer_scan import KEEP_UNITS, REMAT_POLICIES
from jaxpar.models.moe import aux_loss, aux_sum
from jaxpar.models.transformer import RESIDUAL
from jaxpar.pipeline.stages import (WEIGHTS_NAME, InStages, merge_microbatches, split_microbatches, stage_chunk,
                                    stage_shift, stage_weights, valid_slots)


def _iteration_policy(policy: str):
    """jax.checkpoint policy of one iteration's stage work; never saves the weight slices. Under "selective"
    the iteration saves what "none" saves; the attention core inside recomputes itself
    (models/transformer.py `recomputed`, which this policy cannot overrule). "offload" is refused with a
    pipeline (jaxpar/core/validate.py)."""
    if policy in KEEP_UNITS:
        return jax.checkpoint_policies.save_anything_except_these_names(WEIGHTS_NAME)
    return REMAT_POLICIES[policy]


def _spread_fn(layout: Layout, names: tuple):
    """[S, S, M'/S, ...] stage-sharded (logical `names`), stage 0's row the one that counts -> [S, M'/S, ...]
    holding stage 0's row spread over the stages (stage s: its [s]): one all-to-all over the stage axes
    (its transpose, one more, backward). Manual over every mesh axis: an all-to-all in a partly manual
    shard_map would first gather the batch's axes."""
    name = spec_entry(layout.axes("stages"))
    spec = spec_for(names, layout.rules("activations"), layout.mesh)
    out_spec = P(*(tuple(spec)[:1] + tuple(spec)[2:]))

    def spread(b):                                   # local [1, S, M'/S, ...]
        return jax.lax.all_to_all(b, name, 1, 1)[:, 0]   # [1, S (source), M'/S, ...]: keep stage 0's
    return jax.shard_map(spread, mesh=layout.mesh, in_specs=spec, out_specs=out_spec)


def _run(model, x, positions, sched: Schedule, strategy: Strategy, layout: Layout):
    """The schedule's loop: returns (`buf` [S, M, mb, s, d], whose stage-0 row holds the stack's output of
    every micro-batch; the MoE layers' AUX_FIELDS summed over the layers, None without MoE blocks).

    MoE: each iteration's router statistics (sums over the tokens, models/moe.py) are added, unless the
    item is a bubble, into an accumulator [S, v, K, R] per stage, repeat and the slots' statistics (K: every
    run's unit slots, each a layer's n sums, flattened), so after the loop it holds every layer's sums over
    the whole batch: the same losses as one device's."""
    S, v, M, T = sched.stages, sched.repeats, sched.microbatches, sched.iterations
    stage_axes = layout.axes("stages")
    state_names = ("stages",) + RESIDUAL
    mesh = layout.mesh
    weights = stage_weights(model, sched, layout)
    chunk = stage_chunk(model, sched, layout, with_aux=True)
    valid = valid_slots(sched)
    moe = model.cfg.has_moe

    # Micro-batches [M, mb, s, d], replicated over `pipeline` like the embedding output; they seed
    # `buf` (every stage's copy, so stage 0 reads its input locally) and their positions stay put.
    xs = constrain(split_microbatches(x, M), (None,) + RESIDUAL)
    ps = constrain(split_microbatches(positions, M), (None, "batch", "seq"))       # [M, mb, s]

    def stage_work(weights, valid, repeat, h, pos):
        """Every stage applies its chunk of unit slots (repeat `repeat[s]`) to h[s]."""
        in_axes = (0, None if valid is None else 0, 0, 0, 0)
        with use_layout(InStages(layout.mesh, layout.strategy, layout.replicate_kv_heads)):
            return jax.vmap(chunk, in_axes=in_axes, spmd_axis_name=spec_entry(stage_axes))(
                weights, valid, repeat, h, pos)

    stage_work = jax.checkpoint(stage_work, policy=_iteration_policy(strategy.options.remat),
                                prevent_cse=False)
    stage = jnp.arange(S)

    def iteration(carry, t):
        shifted, buf, acc = carry                # [S, mb, s, d], [S, M, mb, s, d], MoE: [S, v, K, R]
        item = t - stage
        # stage 0 takes micro-batch t % M from buf (the input in repeat 0, then the last stage's
        # output of the previous repeat), the others what their predecessor just produced.
        first = jax.lax.dynamic_index_in_dim(buf, t % M, 1, keepdims=False)
        h = constrain(jnp.where((stage == 0)[:, None, None, None], first, shifted), state_names)
        pos = constrain(jnp.take(ps, item % M, axis=0), ("stages", "batch", "seq"))
        repeat = jnp.clip(item // M, 0, v - 1)
        y = stage_work(weights, valid, repeat, h, pos)
        if moe:                                  # this item's router statistics, unless a bubble
            y, aux = y
            real = (item >= 0) & (item < v * M)
            at = real[:, None] & (jnp.arange(v)[None, :] == repeat[:, None])          # [S, v]
            acc = acc + jnp.where(at[:, :, None, None], aux[:, None], 0.0)
        y = constrain(y, state_names)
        shifted = constrain(shift(y), state_names)
        # slot 0 now holds the last stage's output of item t-S+1: keep it in buf unless it is
        # a bubble (then the slot still holds an input that stage 0 has yet to read).
        m_last = (t - (S - 1)) % M
        old = jax.lax.dynamic_index_in_dim(buf, m_last, 1, keepdims=True)
        new = jnp.where(t >= S - 1, shifted[:, None], old)
        buf = jax.lax.dynamic_update_index_in_dim(buf, new, m_last, 1)
        return (shifted, buf, acc), None

    buf_names = ("stages", None) + RESIDUAL
    shift = stage_shift(mesh, stage_axes)
    shifted = constrain(jnp.zeros((S,) + xs.shape[1:], x.dtype), state_names)
    buf = constrain(jnp.broadcast_to(xs, (S,) + xs.shape), buf_names)
    acc = None
    if moe:                                      # the statistics' shape: one stage's chunk on one item
        aux = jax.eval_shape(stage_work, weights, valid, jnp.zeros((S,), jnp.int32), shifted,
                             jnp.zeros((S,) + ps.shape[1:], ps.dtype))[1]
        acc = jnp.zeros((S, v) + aux.shape[1:], jnp.float32)
    (_, buf, acc), _ = jax.lax.scan(iteration, (shifted, buf, acc), jnp.arange(T))
    if not moe:
        return constrain(buf, buf_names), None
    return constrain(buf, buf_names), aux_sum(model.cfg, jnp.sum(acc, axis=3))


def pipelined_stack(model, x: jax.Array, positions: jax.Array, strategy: Strategy, layout: Layout) -> jax.Array:
    """The model's layer stack on [B, s, d] run as a pipeline over the `pipeline` mesh axis, its output
    replicated over `pipeline` (one all-reduce): computes `model.apply_stack(x, positions)`."""
    with jax.named_scope("pipeline"):
        buf, _ = _run(model, x, positions, schedule_of(strategy, model.cfg.run_units), strategy, layout)
        return constrain(merge_microbatches(constrain(buf[0], (None,) + RESIDUAL)), RESIDUAL)


def pipelined_loss(model, x: jax.Array, positions: jax.Array, labels: jax.Array, strategy: Strategy,
                   layout: Layout) -> jax.Array:
    """`model.loss(model.apply_stack(x, positions), labels)` with the stack pipelined and the final norm,
    head and loss of each micro-batch run on one stage (module docstring); called by Trainer under
    `use_layout` with x the embedding output [B, s, d] and labels [B, s]. Returns (loss, the MoE layers'
    AUX_FIELDS summed over the layers, None without MoE blocks: models/moe.py), the loss with the MoE
    layers' auxiliary losses, as `model.loss(..., aux=...)` adds them."""
    sched = schedule_of(strategy, model.cfg.run_units)
    S, M, h = sched.stages, sched.microbatches, sched.head_microbatches
    stage_axes = layout.axes("stages")
    with jax.named_scope("pipeline"):
        buf, aux = _run(model, x, positions, sched, strategy, layout)
        buf = jnp.pad(buf, ((0, 0), (0, S * h - M)) + ((0, 0),) * (buf.ndim - 2))
        names = ("stages", None, None) + RESIDUAL
        buf = constrain(buf.reshape(S, S, h, *buf.shape[2:]), names)
        out = _spread_fn(layout, names)(buf)                                   # [S, h, mb, s, d]
        out = constrain(out, ("stages", None) + RESIDUAL)
    ls = jnp.pad(split_microbatches(labels, M), ((0, S * h - M), (0, 0), (0, 0)))
    ls = ls.reshape(S, h, *ls.shape[1:])                                       # [S, h, mb, s]
    ls = constrain(ls, ("stages", None, "batch", "seq"))
    weight = jnp.asarray((np.arange(S * h) < M).reshape(S, h), jnp.float32)
    graphdef, state = nnx.split(model)

    def head_loss(x, labels):                          # one micro-batch: its mean token loss
        with use_layout(InStages(layout.mesh, layout.strategy, layout.replicate_kv_heads)):  # a MoE MTP block's kernel
            return nnx.merge(graphdef, state).loss(x, labels)
    per_micro = jax.vmap(jax.vmap(head_loss), spmd_axis_name=spec_entry(stage_axes))(out, ls)   # [S, h]
    loss = jnp.sum(per_micro * weight) / M
    if aux is None:
        return loss, None
    return loss + aux_loss(model.cfg, aux), aux
