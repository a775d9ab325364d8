"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular schedules, GSPMD-style.

The model's layer units are stacked on a leading `layers` dim (models/lm.py). With S stages and
v repeats (1 for GPipe) the U units are cut into S*v chunks in execution order, chunk c = r*S + s
run by stage s in repeat r (jaxpar/core/schedule.py: the split; even when S*v divides U, else the first
and last chunks lighter, or `pp_stages`). Every chunk runs in k = max(split) unit slots; a shorter
chunk's last slots are padding: zero weights whose output is discarded (`where(valid, unit(h), h)`),
so they are the identity, the real weights' gradients are unchanged and nothing flows into padding.
The stacked weights [U, ...] are viewed as [S, v, k, ...] (chunks sliced, padded, stage dim first),
sharded on `stages` (= pipeline). An even split is stored stage-major (jaxpar/pipeline/order.py: the
trainer's state holds unit (r*S + s)*k + j at position s*v*k + r*k + j; checkpoints and the gradients
that `Trainer.loss_and_grads` returns are in layer order), so `layers` on `pipeline` puts each stage's
chunks on it and the view is a reshape: no weight moves, GPipe or circular. An uneven split cannot
be sharded evenly on `layers`: `pipeline` shards the next dim it divides (schedule.stored_spec: jit
needs even shards), and the view moves each stage's units to it once per step (an all-to-all per
weight leaf, its gradient back the same way).

Activations live in two stage-sharded buffers, the stage state [S, mb, s, d] and `buf`
[S, M, mb, s, d], and one `lax.scan` runs T = v*M + S - 1 iterations. At iteration t stage s
works on item i = t - s (valid when 0 <= i < v*M): micro-batch i % M in repeat i // M.
`buf` starts as every stage's copy of the M micro-batches (the embedding output is replicated over
`pipeline`: the lookup is a gather, no FLOPs, and sending its output would cost as much as looking
it up). Every iteration
  1. stage 0 takes `buf[0, t % M]`: the micro-batch itself in repeat 0, the last stage's output
     for it from the previous repeat afterwards (see 4); stage s > 0 takes what stage s-1
     produced in the previous iteration;
  2. every stage applies its chunk: `vmap` over the stage dim (spmd_axis_name = the pipeline
     axes, so the blocks' own sharding annotations keep the stage dim on `pipeline`) of a scan
     over its k unit slots, rematerialised per iteration (see `_iteration_policy`);
  3. the outputs shift one stage up, the last stage's wrapping round to slot 0: a ppermute, one
     collective-permute over `pipeline` per iteration (and its transpose backward);
  4. slot 0 of the shifted outputs (the last stage's output of item t-S+1, micro-batch m) is
     written to `buf[:, m]` (stage 0's copy is the one that counts), unless the item is a bubble:
     masked, so bubble work never reaches the result and its gradients are exactly zero.
The circular schedule needs M >= S so that an output is back in `buf` before stage 0 reads it
for the next repeat; a slot is overwritten only after stage 0 has read what it held.

The head and loss run once per step in total, not on every stage: after the loop stage 0's `buf`
(the last repeat's output of every micro-batch, padded to M' = S*ceil(M/S) micro-batches) is spread
over the stages by one all-to-all, so stage s holds micro-batches s*M'/S + [0, M'/S), and each stage
runs the final norm, head and cross-entropy on its M'/S (padding micro-batches weigh 0). The loss is
the mean of the micro-batches' means (equal token counts: the batch mean). The head's and final
norm's gradients are then partial sums per stage, reduced over `pipeline` with the data axes.
Micro-batch m takes rows m, m+M, m+2M, ... (as gradient accumulation in jaxpar.training.trainer does): the
split is a reshape that keeps every row on the devices of the `batch` axes that already hold it.

FSDP inside the stages: the stage view is all-gathered over `fsdp` once per step, before the loop
(it is loop-invariant), not in every iteration. The gathered weights are then broadcast to one copy
per fsdp shard, [S, F, v, k, ...] sharded on `fsdp` too (each device keeps what it already holds), and
a second vmap, over the fsdp shards (spmd_axis_name fsdp), runs each shard's rows with its own copy.
So the weight gradient accumulates per device through the loop (the scan's cotangent carry is
[S, F, ...], nothing to reduce there) and the broadcast's transpose reduces it over `fsdp` once per
step; without the copy, XLA reduces every iteration's contribution in the loop. With `data` > 1 too the
copies are per data x fsdp shard (the data copies of the fsdp-sharded view made first, so the transpose
scatters over fsdp before it sums the shards over data), and without fsdp (ZeRO-0/1) per data shard alike
(the weights are replicated over data anyway, so each device's copy costs nothing): the gradient is summed
over data once per step, not in every iteration (T times the bytes). Memory: each device
holds its stage's v*k unit slots of weights un-sharded over fsdp (compute dtype, its tensor shard) for
the whole step, plus their gradient accumulator in the backward: the ZeRO-2-like trade Llama 3 made
(Dubey et al. 2024, 3.3.2: no re-shard after the forward).

Mixture of experts inside the stages: the expert kernel's shard_map (jaxpar/ops/moe.py, its all-to-alls over
`expert`) runs under the vmaps over stages and weight copies, which batch it over `pipeline` (and `data`).
The router's auxiliary losses are per-layer functions of batch means (models/moe.py), so each item's router
statistics (sums over its tokens) are added, bubbles masked, into an accumulator per stage, repeat and unit
slot (= per layer) and the losses are made from the whole batch's sums after the loop: loss, gradients and
router metrics equal one device's (tests/test_pipeline_moe.py). 1F1B collects them in a forward pass of its own
(jaxpar/pipeline/one_f_one_b.py).

Communication per step, over `pipeline`: T collective-permutes of the stage state [mb, s, d]
(its per-device shard) forward and T backward; one all-to-all of the output [M', mb, s, d] forward
and one of its cotangent backward; the input's cotangent all-reduced backward (every stage's `buf`
copy began as the input); the head's and final norm's gradients reduced. An uneven split adds one
all-to-all per weight leaf forward and one for its gradient backward (the view, above); an even one
moves no weights. Bubble fraction (S-1)/(v*M+S-1) (GPipe: Huang et al. 2019;
circular/interleaved: Narayanan et al. 2021, v model chunks per device).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.core.schedule import Schedule, schedule_of
from jaxpar.core.sharding import Layout, constrain, spec_for, use_layout
from jaxpar.core.strategy import Strategy
from jaxpar.models.lm import KEEP_UNITS, REMAT_POLICIES
from jaxpar.models.moe import aux_loss, aux_sum
from jaxpar.models.transformer import RESIDUAL
from jaxpar.pipeline.stages import (WEIGHTS_NAME, InStages, axis_name, merge_microbatches, split_microbatches,
                                    stage_chunk, stage_shift, stage_weights, valid_slots)


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
    name = axis_name(layout.axes("stages"))
    spec = spec_for(names, layout.rules("activations"), layout.mesh)
    out_spec = P(*(tuple(spec)[:1] + tuple(spec)[2:]))

    def spread(b):                                   # local [1, S, M'/S, ...]
        return jax.lax.all_to_all(b, name, 1, 1)[:, 0]   # [1, S (source), M'/S, ...]: keep stage 0's
    return jax.shard_map(spread, mesh=layout.mesh, in_specs=spec, out_specs=out_spec)


def _run(model, x, positions, sched: Schedule, strategy: Strategy, layout: Layout):
    """The schedule's loop: returns (`buf` [S, M, mb, s, d], whose stage-0 row holds the stack's output of
    every micro-batch; the MoE layers' AUX_FIELDS summed over the layers, None without MoE blocks).

    MoE: each iteration's router statistics (sums over the tokens, models/moe.py) are added, unless the
    item is a bubble, into an accumulator [S, v, k, R, n] per stage, repeat and unit slot (a layer), so
    after the loop it holds every layer's sums over the whole batch: the same losses as one device's."""
    S, v, M, T = sched.stages, sched.repeats, sched.microbatches, sched.iterations
    stage_axes = layout.axes("stages")
    state_names = ("stages",) + RESIDUAL
    mesh = layout.mesh
    weights = stage_weights(model, sched, layout)
    chunk = stage_chunk(model, sched, layout, with_aux=True)
    valid = valid_slots(sched)
    moe = "E" in model.cfg.pattern

    # Micro-batches [M, mb, s, d], replicated over `pipeline` like the embedding output; they seed
    # `buf` (every stage's copy, so stage 0 reads its input locally) and their positions stay put.
    xs = constrain(split_microbatches(x, M), (None,) + RESIDUAL)
    ps = constrain(split_microbatches(positions, M), (None, "batch", "seq"))       # [M, mb, s]

    def stage_work(weights, valid, repeat, h, pos):
        """Every stage applies its chunk of k unit slots (repeat `repeat[s]`) to h[s]."""
        in_axes = (0, None if valid is None else 0, 0, 0, 0)
        with use_layout(InStages(layout.mesh, layout.strategy, layout.replicate_kv_heads)):
            return jax.vmap(chunk, in_axes=in_axes, spmd_axis_name=axis_name(stage_axes))(
                weights, valid, repeat, h, pos)

    stage_work = jax.checkpoint(stage_work, policy=_iteration_policy(strategy.options.remat),
                                prevent_cse=False)
    stage = jnp.arange(S)

    def iteration(carry, t):
        shifted, buf, acc = carry                # [S, mb, s, d], [S, M, mb, s, d], MoE: [S, v, k, R, n]
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
            acc = acc + jnp.where(at[:, :, None, None, None], aux[:, None], 0.0)
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
        buf, _ = _run(model, x, positions, schedule_of(strategy, model.cfg.units), strategy, layout)
        return constrain(merge_microbatches(constrain(buf[0], (None,) + RESIDUAL)), RESIDUAL)


def pipelined_loss(model, x: jax.Array, positions: jax.Array, labels: jax.Array, strategy: Strategy,
                   layout: Layout) -> jax.Array:
    """`model.loss(model.apply_stack(x, positions), labels)` with the stack pipelined and the final norm,
    head and loss of each micro-batch run on one stage (module docstring); called by Trainer under
    `use_layout` with x the embedding output [B, s, d] and labels [B, s]. Returns (loss, the MoE layers'
    AUX_FIELDS summed over the layers, None without MoE blocks: models/moe.py), the loss with the MoE
    layers' auxiliary losses, as `model.loss(..., aux=...)` adds them."""
    sched = schedule_of(strategy, model.cfg.units)
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
        return nnx.merge(graphdef, state).loss(x, labels)
    per_micro = jax.vmap(jax.vmap(head_loss), spmd_axis_name=axis_name(stage_axes))(out, ls)   # [S, h]
    loss = jnp.sum(per_micro * weight) / M
    if aux is None:
        return loss, None
    return loss + aux_loss(model.cfg, aux), aux
