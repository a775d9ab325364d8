"""The 1F1B (one-forward-one-backward) pipeline schedule: activation memory bounded by the stage count.

GPipe and circular (jaxpar/pipeline.py) are a forward loop that jax.grad differentiates: the backward
starts after every micro-batch's forward, so each stage keeps what its backward needs of all M
micro-batches (T = M + S - 1 iterations' stage inputs, and with remat "none" their inventories). 1F1B
(PipeDream-flush: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", 2.2.1) starts a micro-batch's backward as soon as its forward leaves the last stage,
so a stage holds a bounded number of micro-batches in flight whatever M is. No autodiff through the
loop can order work that way, so this module writes the backward itself and hands the trainer the loss
and the gradients (Trainer._value_and_grads), instead of a loss for jax.grad.

The schedule, one program on every device (`vmap` over the stage dim, spmd_axis_name = the pipeline
axes, as jaxpar/pipeline.py). T = M + 2(S-1) ticks; in tick t stage s
  1. forward: micro-batch i = t - s (valid when 0 <= i < M) through its chunk; stage 0 takes the
     embedding output of micro-batch t, stage s > 0 what stage s-1 produced in tick t-1. The chunk's
     input goes into the stage's stash, a ring of D = 2S-1 slots (slot t % D);
  2. at the last stage, the final norm, head and loss of that output, and their vjp: the cotangent of
     micro-batch i's stack output (seeded 1/M: the loss is the micro-batches' mean);
  3. backward: micro-batch j = t - 2(S-1) + s (valid when 0 <= j < M): the chunk recomputed from its
     stashed input (slot (t - 2(S-1-s)) % D) and its vjp taken with the cotangent that stage s+1 sent
     in tick t-1 (the last stage: step 2's, for j = i, the micro-batch it has just run forward). The
     weights' gradient is added to an accumulator in the loop's carry, the input's cotangent sent on;
  4. the forward outputs shift one stage up and the input cotangents one stage down: two
     collective-permutes over `pipeline` per tick (the second is the first's transpose).
Stage s stashes a micro-batch from its forward (tick i + s) to its backward (tick i + 2(S-1) - s):
at most 2(S-1-s) + 1 <= 2S-1 inputs [mb, s, d], whatever M is; the backward's recompute (one chunk's
activations) is transient. Stage 0's input cotangents are collected per micro-batch for the
embedding's backward.

Why the ticks pair a forward with a backward instead of running one or the other (the asynchronous
1F1B's F and B slots): in one SPMD program every device runs every tick, so a tick costs the most
expensive branch any stage takes. With a per-stage branch (lax.cond under shard_map) a tick of F-or-B
costs B (about 2F, plus the recompute) on every device, 2(M+S-1) of them; masked under vmap it costs
F + B. Pairing them, in the steady state both halves of every tick are real work: (M + 2(S-1)) (F + B)
per step against GPipe's (M + S - 1) (F + B), a bubble of 2(S-1)/(M + 2(S-1)) (jaxpar/schedule.py),
bought for the memory bound; the stash (2S-1 against the asynchronous schedule's S) is the price of
one tick per hop in both directions. Bubble work is masked: a zero cotangent, so it adds exact zeros.

The head runs in every stage's tick (vmap: one program), masked to the last stage's: S times the
head's FLOPs of GPipe's spread head (jaxpar/pipeline.py), a cost this schedule does not avoid yet.

Weight gradients are accumulated in the loop's carry, so they must not be reduced over the batch axes
there (GSPMD would all-reduce every tick's contribution): the stage and head weights are gathered over
fsdp once, before the loop, and copied once per batch shard ([S, N, ...] and [N, ...], N = data x fsdp
devices, a broadcast sharded on the batch axes: each device keeps its own copy), and a vmap over the N
shards (spmd_axis_name = the batch axes) runs each shard's rows with its copy, as jaxpar/pipeline.py
does for fsdp alone. Around the loop one jax.vjp carries the gradients to the parameters: the
embedding, the stage view (an uneven split's all-to-alls), the gathers and the copies, whose
transposes reduce over the batch axes once per step. Communication per step over `pipeline`: T
permutes of the stage state each way; the input's cotangent (only stage 0's is non-zero) and the
head's gradients summed over the stages (all-reduces).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.pipeline import _axis_name, _merge, _shift_fn, _split, _valid_slots, _without, stage_chunks
from jaxpar.schedule import schedule_of
from jaxpar.sharding import Layout, constrain, spec_for, use_layout
from jaxpar.strategy import Strategy


def _used_leaves(fn, leaves: list, *args) -> list[int]:
    """Indices of `leaves` that fn(leaves, *args) reads (from its jaxpr): the head's parameters among
    the model's non-stacked ones, found without naming any layer."""
    jaxpr = jax.make_jaxpr(fn)(leaves, *args).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [i for i, v in enumerate(jaxpr.invars[:len(leaves)]) if id(v) in used]


class _PerShard(Layout):
    """The layout inside the vmap over batch shards: the vmapped dim is the batch's whole device share."""

    def rules(self, purpose: str):
        rules = dict(super().rules(purpose))
        rules["batch"] = ()
        return type(super().rules(purpose))(rules)


def _spec(names, layout: Layout, lead: tuple, drop: tuple[str, ...]):
    """PartitionSpec of a parameter with logical `names` without the `drop` axes, after `lead` dims."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    spec = tuple(spec_for(names, layout.rules("params"), layout.mesh))
    return P(*lead, *(_without(d, drop) if isinstance(d, (str, tuple)) else d for d in spec))


def loss_and_grads(graphdef, params, batch: dict, strategy: Strategy, layout: Layout, dtype: str):
    """(loss, gradients w.r.t. `params`) of one batch under the 1F1B schedule (module docstring): what
    jax.value_and_grad of Trainer._loss computes. Called under `use_layout(layout)`."""
    from jaxpar.models.transformer import RESIDUAL  # noqa: PLC0415

    model = nnx.merge(graphdef, params)
    sched = schedule_of(strategy, model.cfg.units)
    S, M = sched.stages, sched.microbatches
    T, D = M + 2 * (S - 1), 2 * S - 1
    mesh, stage_axes, batch_axes = layout.mesh, layout.axes("stages"), layout.axes("batch")
    N = int(np.prod([mesh.shape[a] for a in batch_axes]))       # batch shards: one weight copy each
    bspec = _axis_name(batch_axes) if batch_axes else None
    dt = jnp.dtype(dtype)
    inner = _PerShard(mesh, layout.strategy, layout.replicate_kv_heads)

    def cast(tree):
        return tree if dt == jnp.float32 else jax.tree.map(lambda p: p.astype(dt), tree)

    # The head's parameters: the non-stacked leaves the loss reads.
    head_def, units_state, rest = nnx.split(model, nnx.PathContains("units"), ...)
    variables = jax.tree.leaves(rest, is_leaf=lambda a: isinstance(a, nnx.Variable))
    rest_leaves, rest_def = jax.tree.flatten(rest)

    def head_loss(leaves, y, labels):                 # one micro-batch's mean token loss
        return nnx.merge(head_def, units_state, jax.tree.unflatten(rest_def, leaves)).loss(y, labels)

    mb = batch["labels"].shape[0] // M
    y0 = jax.ShapeDtypeStruct((mb,) + batch["labels"].shape[1:] + (model.cfg.d_model,), dt)
    used = _used_leaves(head_loss, rest_leaves, y0, jax.ShapeDtypeStruct(y0.shape[:2], jnp.int32))
    drop = ("fsdp",) + tuple(batch_axes)

    def copies(a, names, lead, lead_spec):
        """a broadcast to one copy per batch shard after `lead` dims (each device keeps what it holds)."""
        a = jnp.broadcast_to(jnp.expand_dims(a, lead), a.shape[:lead] + (N,) + a.shape[lead:])
        sharding = jax.sharding.NamedSharding(mesh, _spec(names, layout, lead_spec + (bspec,), drop))
        return jax.lax.with_sharding_constraint(a, sharding)

    box = {}

    def prologue(params):
        """Differentiable in the parameters: the embedding, the stage weights and the head's weights,
        both gathered over fsdp and copied per batch shard [S, N, 1, k, ...] / [N, ...]."""
        model = nnx.merge(graphdef, cast(params))
        x = model.embed(batch["inputs"])
        weights, chunk, _ = stage_chunks(model, sched, layout, per_shard=False)
        box["chunk"] = chunk
        names = [tuple(v.get_metadata().get("out_sharding") or (None,) * a.ndim)[1:] for v, a in
                 zip(jax.tree.leaves(nnx.split(model.units)[1], is_leaf=lambda a: isinstance(a, nnx.Variable)),
                     weights)]
        stage_spec = _spec(("stages",), layout, (), ())[0]
        weights = [copies(w, (None, None) + n, 1, (stage_spec,)) for w, n in zip(weights, names)]
        leaves = jax.tree.leaves(nnx.split(model, nnx.PathContains("units"), ...)[2])
        head = [copies(leaves[i], tuple(variables[i].get_metadata().get("out_sharding")
                                       or (None,) * leaves[i].ndim), 0, ()) for i in used]
        return x, weights, head

    (x, weights, head_w), pull_back = jax.vjp(prologue, params)
    chunk = box["chunk"]
    valid = None if sched.even else jnp.asarray(_valid_slots(sched))
    consts = list(cast(rest_leaves))

    def head_of(hw, y, labels):
        leaves = list(consts)
        for i, w in zip(used, hw):
            leaves[i] = w
        return head_loss(leaves, y, labels)

    def shards(a, lead_names):
        """[..., mb, rest] (mb on the batch axes) -> [..., N, mb/N, rest]: each shard's rows, in place."""
        k = len(lead_names)
        a = a.reshape(a.shape[:k] + (N, a.shape[k] // N) + a.shape[k + 1:])
        return constrain(a, lead_names + ("batch", None) + (None,) * (a.ndim - k - 2))

    state = ("stages", "batch", None, "res_seq", "act_embed")
    xs = shards(constrain(_split(x, M), (None,) + RESIDUAL), (None,))          # [M, N, rows, s, d]
    ps = shards(constrain(_split(batch["positions"], M), (None, "batch", "seq")), (None,))
    ls = shards(constrain(_split(batch["labels"], M), (None, "batch", "seq")), (None,))
    stage = jnp.arange(S)
    shift_up = _shift_fn(mesh, stage_axes)

    def tick_shard(ws, ok, s, fwd_in, bwd_in, stash, hw, x_t, t, pos_f, pos_b, labels):
        """One batch shard of stage s's tick: forward of micro-batch t - s, backward of t - 2(S-1) + s."""
        i_f, i_b = t - s, t - 2 * (S - 1) + s
        f_ok, b_ok = (i_f >= 0) & (i_f < M), (i_b >= 0) & (i_b < M)
        h = jnp.where(s == 0, x_t, fwd_in)
        stash = jax.lax.dynamic_update_index_in_dim(stash, h, t % D, 0)
        y = chunk(ws, ok, 0, h, pos_f)
        loss, head_vjp = jax.vjp(lambda hw, y: head_of(hw, y, labels), hw, y)
        seed = jnp.where((s == S - 1) & f_ok, 1.0 / (M * N), 0.0).astype(loss.dtype)
        d_hw, dy = head_vjp(seed)
        g = jnp.where(b_ok, jnp.where(s == S - 1, dy, bwd_in), jnp.zeros_like(bwd_in))
        h_b = jax.lax.dynamic_index_in_dim(stash, (t - 2 * (S - 1 - s)) % D, 0, keepdims=False)
        _, chunk_vjp = jax.vjp(lambda ws, h: chunk(ws, ok, 0, h, pos_b), ws, h_b)
        d_ws, d_h = chunk_vjp(g)
        return y, d_h, stash, d_ws, d_hw, loss * seed

    def tick_stage(ws, ok, s, fwd_in, bwd_in, stash, hw, x_t, t, pos_f, pos_b, labels):
        with use_layout(inner):
            return jax.vmap(tick_shard, in_axes=(0, None, None, 0, 0, 0, 0, 0, None, 0, 0, 0),
                            spmd_axis_name=bspec)(ws, ok, s, fwd_in, bwd_in, stash, hw, x_t, t, pos_f, pos_b,
                                                  labels)

    in_axes = (0, None if valid is None else 0, 0, 0, 0, 0, None, None, None, 0, 0, 0)
    tick_all = jax.vmap(tick_stage, in_axes=in_axes, spmd_axis_name=_axis_name(stage_axes))

    def tick(carry, t):
        fwd, bwd, stash, d_w, d_head, d_xs, loss = carry
        x_t = jax.lax.dynamic_index_in_dim(xs, jnp.clip(t, 0, M - 1), 0, keepdims=False)
        i_f, i_b = t - stage, t - 2 * (S - 1) + stage
        pos_f = constrain(jnp.take(ps, i_f % M, axis=0), ("stages", "batch", None, "seq"))
        pos_b = constrain(jnp.take(ps, i_b % M, axis=0), ("stages", "batch", None, "seq"))
        labels = constrain(jnp.take(ls, i_f % M, axis=0), ("stages", "batch", None, "seq"))
        y, d_h, stash, dws, dhw, li = tick_all(weights, valid, stage, fwd, bwd, stash, head_w, x_t, t,
                                                pos_f, pos_b, labels)
        d_w = [a + g.astype(a.dtype) for a, g in zip(d_w, dws)]
        d_head = [a + g.astype(a.dtype) for a, g in zip(d_head, dhw)]
        # stage 0's input cotangent is micro-batch t - 2(S-1)'s: kept for the embedding's backward
        j = t - 2 * (S - 1)
        keep = ((stage == 0) & (j >= 0)).reshape((S,) + (1,) * (d_xs.ndim - 1))
        old = jax.lax.dynamic_index_in_dim(d_xs, jnp.clip(j, 0, M - 1), 1, keepdims=True)
        d_xs = jax.lax.dynamic_update_index_in_dim(d_xs, jnp.where(keep, d_h[:, None], old),
                                                   jnp.clip(j, 0, M - 1), 1)
        fwd = constrain(shift_up(constrain(y, state)), state)
        # stage s+1's input cotangent to stage s: the up-shift's transpose (one permute, phase "backward")
        bwd = jax.linear_transpose(shift_up, y)(constrain(d_h, state))[0]
        return (fwd, constrain(bwd, state), stash, d_w, d_head, d_xs, loss + li), None

    zeros = constrain(jnp.zeros((S,) + xs.shape[1:], dt), state)
    stash = constrain(jnp.zeros((S, xs.shape[1], D) + xs.shape[2:], dt), ("stages", "batch", None, None) + state[3:])
    d_xs = constrain(jnp.zeros((S,) + xs.shape, dt), ("stages", None) + state[1:])
    d_w = [jnp.zeros(w.shape, jnp.float32) for w in weights]
    d_head = [jnp.zeros((S,) + w.shape, jnp.float32) for w in head_w]
    carry = (zeros, zeros, stash, d_w, d_head, d_xs, jnp.zeros((S, N), jnp.float32))
    (_, _, _, d_w, d_head, d_xs, loss), _ = jax.lax.scan(tick, carry, jnp.arange(T))

    d_x = jnp.sum(d_xs, axis=0)                                       # [M, N, rows, s, d]
    d_x = constrain(d_x.reshape((M, mb) + d_x.shape[3:]), (None,) + RESIDUAL)
    d_x = constrain(_merge(d_x), RESIDUAL)
    d_head = [jnp.sum(g, axis=0).astype(w.dtype) for g, w in zip(d_head, head_w)]
    (grads,) = pull_back((d_x, [g.astype(w.dtype) for g, w in zip(d_w, weights)], d_head))
    return jnp.sum(loss), grads

