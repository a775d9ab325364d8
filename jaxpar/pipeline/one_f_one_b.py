"""The 1F1B (one-forward-one-backward) pipeline schedule: activation memory bounded by the stage count.

GPipe and circular (jaxpar/pipeline/gpipe.py) are a forward loop that jax.grad differentiates: the backward
starts after every micro-batch's forward, so each stage keeps what its backward needs of all M
micro-batches (T = M + S - 1 iterations' stage inputs, and with remat "none" their inventories). 1F1B
(PipeDream-flush: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", 2.2.1) starts a micro-batch's backward as soon as its forward leaves the last stage,
so a stage holds a bounded number of micro-batches in flight whatever M is. No autodiff through the
loop can order work that way, so this module writes the backward itself and hands the trainer the loss
and the gradients (Trainer._value_and_grads), instead of a loss for jax.grad.

The schedule, one program on every device (`vmap` over the stage dim, spmd_axis_name = the pipeline
axes, as jaxpar/pipeline/gpipe.py). With v = 1 (plain 1F1B), M + 2(S-1) ticks in three loops; in tick t stage s
  1. forward: micro-batch i = t - s (valid when 0 <= i < M) through its chunk; stage 0 takes the
     embedding output of micro-batch t, stage s > 0 what stage s-1 produced in tick t-1. The chunk's
     input goes into the stage's stash, a ring of D = 2S-1 slots (slot t % D);
  2. the last stage's output (micro-batch t - (S-1)) is spread over the stages by one all-to-all over
     `pipeline`: stage p takes the p-th S-th of every device's local sequence and runs the final norm,
     head and loss on it, and their vjp (seeded 1/(M S): the loss is the mean over micro-batches and
     pieces); the cotangent goes back by the all-to-all's transpose: the head's FLOPs once per step in
     all, as GPipe's spread head, not once per stage;
  3. backward: micro-batch j = t - 2(S-1) + s (valid when 0 <= j < M): the chunk recomputed from its
     stashed input (slot (t - 2(S-1-s)) % D) and its vjp taken with the cotangent that stage s+1 sent
     in tick t-1 (the last stage: step 2's, for j = i, the micro-batch it has just run forward). The
     weights' gradient is added to an accumulator in the loop's carry, the input's cotangent sent on;
  4. the forward outputs shift one stage up and the input cotangents one stage down: a
     collective-permute over `pipeline` each (the second is the first's transpose).
The first S-1 ticks (warm-up) have no valid backward on any stage and the last S-1 (cool-down) no
valid forward, so they run as their own loops, forward only and backward only: M + S - 1 forwards and
as many backwards per stage, the work of GPipe's schedule, bubble (S-1)/(M+S-1) (jaxpar/core/schedule.py).
Stage s stashes a micro-batch from its forward (tick i + s) to its backward (tick i + 2(S-1) - s):
at most 2(S-1-s) + 1 <= 2S-1 inputs [mb, s, d], whatever M is; the backward's recompute is transient:
the chunk's k units' activations under remat none, its unit inputs and one unit's activations under
remat full (the run's policy applies to the units inside the chunk, jaxpar/pipeline/stages.py). Stage 0's input cotangents are collected per micro-batch for the
embedding's backward. The stash (2S-1 against the asynchronous schedule's S) is the price of one tick
per hop in both directions in one SPMD program. Bubble work is masked: a zero cotangent, so it adds
exact zeros. The spread needs each device's sequence piece divisible by S (jaxpar/core/validate.py).

Interleaved 1F1B (pp_repeats = v > 1; Narayanan et al. 2021, 2.2.2): stage s holds v chunks (chunk r*S + s
in repeat r, stored stage-major as the circular schedule's, jaxpar/pipeline/order.py) and the micro-batches
go round the stages v times in groups of S (M a multiple of S): forward item i = t - s is micro-batch
(i // Sv) S + i % S in repeat (i // S) % v, and the last stage's output of repeat r < v-1 reaches stage 0
exactly when it takes that micro-batch's next repeat (the up-shift is cyclic), so nothing waits in a
buffer. Backward items run the repeats in reverse, B0 = vS - 1 ticks behind (the cotangent of stage 0
in repeat r goes round to stage S-1 in repeat r-1 by the same cyclic down-shift), and the head runs in the
S ticks of each group whose last-stage forward is a last repeat: an outer loop over the groups, each S
head ticks and (v-1)S without. The stash holds D = 2vS-1 inputs; each stage runs vM + S - 1 chunk
forwards and backwards, bubble (S-1)/(vM+S-1), as the circular schedule's and Megatron's interleaved one.

Weight gradients are accumulated in the loop's carry, so they must not be reduced over the batch axes
there (GSPMD would all-reduce every tick's contribution): the stage and head weights are gathered over
fsdp once, before the loop, and copied once per batch shard ([S, N, ...] and [N, ...], N = data x fsdp
devices, a broadcast sharded on the batch axes: each device keeps its own copy), and a vmap over the N
shards (spmd_axis_name = the batch axes) runs each shard's rows with its copy, as jaxpar/pipeline/gpipe.py
does for fsdp alone. Around the loop one jax.vjp carries the gradients to the parameters: the
embedding, the stage view (an uneven split's all-to-alls), the gathers and the copies, whose
transposes reduce over the batch axes once per step. Communication per step over `pipeline`: M + S - 1
permutes of the stage state each way; M all-to-alls of the last stage's output forward and M of its
cotangent backward; the input's cotangent (only stage 0's is non-zero) and the head's gradients summed
over the stages (all-reduces).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.gpipe import _axis_name, _shift_fn, _split, _valid_slots, _without, stage_chunks
from jaxpar.core.schedule import schedule_of
from jaxpar.core.sharding import Layout, constrain, spec_for, use_layout
from jaxpar.core.strategy import Strategy

STATE = ("stages", "batch", None, "res_seq", "act_embed")   # [S, N, rows, s, d]: the stage state
LABELS = ("stages", "batch", None, "seq")                    # [S, N, rows, s]


def _used_leaves(fn, leaves: list, *args) -> list[int]:
    """Indices of `leaves` that fn(leaves, *args) reads (from its jaxpr): the head's parameters among
    the model's non-stacked ones, found without naming any layer."""
    jaxpr = jax.make_jaxpr(fn)(leaves, *args).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [i for i, v in enumerate(jaxpr.invars[:len(leaves)]) if id(v) in used]


def _replaced(leaves: list, at: list[int], new: list) -> list:
    """`leaves` with leaves[at[j]] replaced by new[j]."""
    out = list(leaves)
    for i, w in zip(at, new):
        out[i] = w
    return out


class _PerShard(Layout):
    """The layout inside the vmap over batch shards: the vmapped dim is the batch's whole device share
    (`in_vmap`: shard_map kernels there run without their replication check, jaxpar/pipeline/stages.py)."""
    in_vmap = True

    def rules(self, purpose: str):
        rules = dict(super().rules(purpose))
        rules["batch"] = ()
        return type(super().rules(purpose))(rules)


def _spec(names, layout: Layout, lead: tuple, drop: tuple[str, ...]):
    """PartitionSpec of a parameter with logical `names` without the `drop` axes, after `lead` dims."""
    spec = tuple(spec_for(names, layout.rules("params"), layout.mesh))
    return P(*lead, *(_without(d, drop) if isinstance(d, (str, tuple)) else d for d in spec))


def _pieces_fns(layout: Layout, S: int):
    """(spread, piece): spread(y [S, N, rows, s, d]) -> [S, N, rows, s/S, d], stage p holding the p-th
    S-th of the last stage's local sequence (one all-to-all over the stage axes; its transpose, one more,
    backward); piece(labels [S, N, rows, s]) -> the labels of stage p's tokens, sharded as `seq` (the
    head's layout: under SP a `seq` shard holds `sub` = tensor residual shards, whose p-th S-ths it
    takes; no communication). Manual over every mesh axis, as jaxpar/pipeline/gpipe.py's `_spread_fn`."""
    name = _axis_name(layout.axes("stages"))
    mesh, rules = layout.mesh, layout.rules("activations")
    state, labels = spec_for(STATE, rules, mesh), spec_for(LABELS, rules, mesh)
    sub = int(np.prod([mesh.shape[a] for a in layout.axes("res_seq") if a not in layout.axes("seq")]))

    def spread(y):                                            # local [1, n, rows, s_l, d]
        y = y.reshape(y.shape[:3] + (S, y.shape[3] // S) + y.shape[4:])
        return jax.lax.all_to_all(y, name, 3, 3)[:, :, :, S - 1]   # [.., S (source), s_l/S, d]: the last's

    def piece(l):                                             # local [1, n, rows, sub * s_l]
        l = l.reshape(l.shape[:3] + (sub, S, l.shape[3] // (sub * S)))
        l = jax.lax.dynamic_index_in_dim(l, jax.lax.axis_index(name), 4, keepdims=False)
        return l.reshape(l.shape[:3] + (-1,))
    return (jax.shard_map(spread, mesh=mesh, in_specs=state, out_specs=state),
            jax.shard_map(piece, mesh=mesh, in_specs=labels, out_specs=labels))


def loss_and_grads(graphdef, params, batch: dict, strategy: Strategy, layout: Layout, dtype: str):
    """(loss, gradients w.r.t. `params`) of one batch under the 1F1B schedule (module docstring): what
    jax.value_and_grad of Trainer._loss computes. Called under `use_layout(layout)`."""
    from jaxpar.models.transformer import RESIDUAL  # noqa: PLC0415

    model = nnx.merge(graphdef, params)
    sched = schedule_of(strategy, model.cfg.units)
    S, M, v = sched.stages, sched.microbatches, sched.repeats
    B0, D = v * S - 1, 2 * v * S - 1     # the first backward tick; stash slots
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

    def head_loss(leaves, y, labels):                 # one piece's mean token loss
        return nnx.merge(head_def, units_state, jax.tree.unflatten(rest_def, leaves)).loss(y, labels)

    mb = batch["labels"].shape[0] // M
    y0 = jax.ShapeDtypeStruct((mb,) + batch["labels"].shape[1:] + (model.cfg.d_model,), dt)
    used = _used_leaves(head_loss, rest_leaves, y0, jax.ShapeDtypeStruct(y0.shape[:2], jnp.int32))

    def embed(leaves, ids):                           # the embedding output of token ids [rows, s]
        return nnx.merge(head_def, units_state, jax.tree.unflatten(rest_def, leaves)).embed(ids)
    embedding = _used_leaves(embed, rest_leaves, jax.ShapeDtypeStruct(y0.shape[:2], jnp.int32))
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
        weights, chunk, _ = stage_chunks(model, sched, layout, per_shard=False, policy=strategy.options.remat)
        box["chunk"] = chunk
        names = [tuple(v.get_metadata().get("out_sharding") or (None,) * a.ndim)[1:] for v, a in
                 zip(jax.tree.leaves(nnx.split(model.units)[1], is_leaf=lambda a: isinstance(a, nnx.Variable)),
                     weights)]
        stage_spec = _spec(("stages",), layout, (), ())[0]
        weights = [copies(w, (None, None) + n, 1, (stage_spec,)) for w, n in zip(weights, names)]
        leaves = jax.tree.leaves(nnx.split(model, nnx.PathContains("units"), ...)[2])

        def per_shard(i):
            return copies(leaves[i], tuple(variables[i].get_metadata().get("out_sharding") or (None,) * leaves[i].ndim),
                          0, ())
        head = [per_shard(i) for i in used]

        # The embedding per batch shard (its table copied, as the head's) and micro-batch by micro-batch
        # (a loop): the vocab-parallel lookup's partial sums exist for one micro-batch at a time, and the
        # table's gradient accumulates on each device, summed over the batch axes once (the copy's transpose).
        def embed_shard(table, ids):                 # ids [M, rows, s] of one batch shard
            own = _replaced(leaves, embedding, table)
            return jax.lax.map(lambda t: embed(own, t), ids)
        with use_layout(inner):
            x = jax.vmap(embed_shard, in_axes=(0, 1), out_axes=1, spmd_axis_name=bspec)(
                [per_shard(i) for i in embedding], ids)
        return constrain(x, (None, "batch", None) + RESIDUAL[1:]), weights, head

    def shards(a, names):
        """[B, rest] (B on the batch axes, rest named `names`) -> [M, N, mb/N, rest]: micro-batches
        (`_split`), then each batch shard's rows, in place."""
        a = constrain(_split(a, M), (None, "batch") + names)
        a = a.reshape((M, N, a.shape[1] // N) + a.shape[2:])
        return constrain(a, (None, "batch", None) + names)

    ids = shards(batch["inputs"], ("seq",))                                     # [M, N, rows, s]
    (xs, weights, head_w), pull_back = jax.vjp(prologue, params)                # xs [M, N, rows, s, d]
    chunk = box["chunk"]
    valid = None if sched.even else jnp.asarray(_valid_slots(sched))
    consts = list(cast(rest_leaves))
    seed = 1.0 / (M * N * S)          # every piece's share of the batch's mean loss

    def head_of(hw, y, labels):
        return head_loss(_replaced(consts, used, hw), y, labels)

    ps = shards(batch["positions"], ("seq",))
    ls = shards(batch["labels"], ("seq",))
    stage = jnp.arange(S)
    last = (stage == S - 1).reshape((S,) + (1,) * (xs.ndim - 1))
    shift_up = _shift_fn(mesh, stage_axes)
    spread, piece = _pieces_fns(layout, S)

    def forward_item(t, s):
        """(valid, micro-batch, repeat) of stage s's forward in tick t: item i = t - s, in groups of S
        micro-batches taken through the v repeats in turn (v = 1: micro-batch i)."""
        i = t - s
        return (i >= 0) & (i < v * M), (i // (S * v)) * S + i % S, (i // S) % v

    def backward_item(t, s):
        """(valid, micro-batch, repeat) of stage s's backward in tick t: the forward items in reverse
        repeat order, B0 + S-1-s ticks later (the last stage's last repeat: in its head's tick)."""
        b = t - B0 - (S - 1 - s)
        return (b >= 0) & (b < v * M), (b // (S * v)) * S + b % S, v - 1 - (b // S) % v

    # One batch shard of one stage: its forward, its head piece, its backward (module docstring).
    def forward(ws, ok, s, h_in, stash, x_t, t, pos):
        _, _, r = forward_item(t, s)
        h = jnp.where((s == 0) & (r == 0), x_t, h_in)   # stage 0 in repeat 0: the embedding output
        return chunk(ws, ok, r, h, pos), jax.lax.dynamic_update_index_in_dim(stash, h, t % D, 0)

    def head(hw, z, labels):
        loss, head_vjp = jax.vjp(lambda hw, z: head_of(hw, z, labels), hw, z)
        d_hw, dz = head_vjp(jnp.asarray(seed, loss.dtype))
        return loss * seed, d_hw, dz

    def backward(ws, ok, s, g, stash, t, pos):
        ok_b, _, r = backward_item(t, s)
        g = jnp.where(ok_b, g, jnp.zeros_like(g))
        # its input, stashed by the forward 2(vS - 1 - rS - s) ticks earlier
        h = jax.lax.dynamic_index_in_dim(stash, (t - 2 * (v * S - 1 - r * S - s)) % D, 0, keepdims=False)
        _, chunk_vjp = jax.vjp(lambda ws, h: chunk(ws, ok, r, h, pos), ws, h)
        d_ws, d_h = chunk_vjp(g)
        return d_h, d_ws

    def staged(fn, stage_axes_in, shard_axes_in):
        """fn over the stages (spmd: the pipeline axes) and, in each, over the batch shards."""
        def per_stage(*args):
            with use_layout(inner):
                return jax.vmap(fn, in_axes=shard_axes_in, spmd_axis_name=bspec)(*args)
        return jax.vmap(per_stage, in_axes=stage_axes_in, spmd_axis_name=_axis_name(stage_axes))

    ok_axis = None if valid is None else 0
    forward_all = staged(forward, (0, ok_axis, 0, 0, 0, None, None, 0), (0, None, None, 0, 0, 0, None, 0))
    head_all = staged(head, (None, 0, 0), (0, 0, 0))
    backward_all = staged(backward, (0, ok_axis, 0, 0, 0, None, 0), (0, None, None, 0, 0, None, 0))

    def positions(item):             # each stage's micro-batch positions [S, N, rows, s] for its item
        return constrain(jnp.take(ps, item[1] % M, axis=0), ("stages", "batch", None, "seq"))

    def tick(carry, t, fwd_on: bool, bwd_on: bool, head_on: bool = False):
        """Tick t: forward (fwd_on), the head (head_on: in exactly the ticks where the last stage's
        forward is a micro-batch's last repeat), backward (bwd_on)."""
        fwd, bwd, stash, d_w, d_head, d_xs, loss = carry
        g = bwd
        if fwd_on:
            x_t = jax.lax.dynamic_index_in_dim(xs, forward_item(t, 0)[1] % M, 0, keepdims=False)
            y, stash = forward_all(weights, valid, stage, fwd, stash, x_t, t, positions(forward_item(t, stage)))
            y = constrain(y, STATE)
            if head_on:                 # the last stage's output through the head
                labels = jax.lax.dynamic_index_in_dim(ls, forward_item(t, S - 1)[1] % M, 0, keepdims=False)
                labels = piece(constrain(jnp.broadcast_to(labels, (S,) + labels.shape), LABELS))
                z, spread_back = jax.vjp(spread, y)
                li, d_hw, dz = head_all(head_w, constrain(z, STATE), labels)
                g = jnp.where(last, spread_back(constrain(dz, STATE))[0], bwd)
                d_head = [a + b.astype(a.dtype) for a, b in zip(d_head, d_hw)]
                loss = loss + li
            fwd = constrain(shift_up(y), STATE)
        if bwd_on:
            d_h, d_ws = backward_all(weights, valid, stage, constrain(g, STATE), stash, t,
                                     positions(backward_item(t, stage)))
            d_w = [a + b.astype(a.dtype) for a, b in zip(d_w, d_ws)]
            # stage 0's input cotangent in repeat 0 is the embedding output's: kept per micro-batch
            ok0, j, r0 = backward_item(t, 0)
            keep = ((stage == 0) & ok0 & (r0 == 0)).reshape((S,) + (1,) * (d_xs.ndim - 1))
            old = jax.lax.dynamic_index_in_dim(d_xs, j % M, 1, keepdims=True)
            d_xs = jax.lax.dynamic_update_index_in_dim(d_xs, jnp.where(keep, d_h[:, None], old), j % M, 1)
            # stage s+1's input cotangent to stage s (stage 0's to S-1, its previous repeat): the
            # up-shift's transpose (one permute, phase "backward")
            bwd = constrain(jax.linear_transpose(shift_up, d_h)(constrain(d_h, STATE))[0], STATE)
        return (fwd, bwd, stash, d_w, d_head, d_xs, loss), None

    def ticks(carry, first, length, **flags):
        return jax.lax.scan(functools.partial(tick, **flags), carry, first + jnp.arange(length))[0]

    def group(carry, g):
        """v > 1: S ticks with the head (the group's last repeat leaves the last stage), (v-1)S without."""
        carry = ticks(carry, B0 + g * S * v, S, fwd_on=True, bwd_on=True, head_on=True)
        return ticks(carry, B0 + g * S * v + S, (v - 1) * S, fwd_on=True, bwd_on=True), None

    zeros = constrain(jnp.zeros((S,) + xs.shape[1:], dt), STATE)
    stash = constrain(jnp.zeros((S, xs.shape[1], D) + xs.shape[2:], dt), ("stages", "batch", None, None) + STATE[3:])
    d_xs = constrain(jnp.zeros((S,) + xs.shape, dt), ("stages", None) + STATE[1:])
    d_w = [jnp.zeros(w.shape, jnp.float32) for w in weights]
    d_head = [jnp.zeros((S,) + w.shape, jnp.float32) for w in head_w]
    carry = (zeros, zeros, stash, d_w, d_head, d_xs, jnp.zeros((S, N), jnp.float32))
    # warm-up (forwards only), steady state (forward, head, backward), cool-down (backwards only)
    carry = ticks(carry, 0, B0, fwd_on=True, bwd_on=False)
    if v == 1:
        carry = ticks(carry, B0, M, fwd_on=True, bwd_on=True, head_on=True)
    else:                                   # M/S groups, the last one's head ticks alone (then no forwards)
        if M // S > 1:
            carry, _ = jax.lax.scan(group, carry, jnp.arange(M // S - 1))
        carry = ticks(carry, B0 + (M // S - 1) * S * v, S, fwd_on=True, bwd_on=True, head_on=True)
    carry = ticks(carry, B0 + v * M - (v - 1) * S, v * S - 1, fwd_on=False, bwd_on=True)
    _, _, _, d_w, d_head, d_xs, loss = carry

    d_x = constrain(jnp.sum(d_xs, axis=0), (None, "batch", None) + RESIDUAL[1:])   # as xs: [M, N, rows, s, d]
    d_head = [jnp.sum(g, axis=0).astype(w.dtype) for g, w in zip(d_head, head_w)]
    (grads,) = pull_back((d_x, [g.astype(w.dtype) for g, w in zip(d_w, weights)], d_head))
    return jnp.sum(loss), grads
