"""The 1F1B (one-forward-one-backward) pipeline schedule: activation memory bounded by the stage count.

1F1B (PipeDream-flush: Narayanan et al. 2021, 2.2.1) starts a micro-batch's backward as soon as its forward
leaves the last stage, so a stage holds at most 2S-1 stashed stage inputs whatever M is. No autodiff through
a loop orders work that way, so this module writes the backward itself and hands the trainer the loss and
the gradients (Trainer._value_and_grad). M + 2(S-1) lockstep ticks in three phases (`_warm_up`: S-1
forwards; `_steady_state`: M ticks of a forward and a backward; `_cool_down`: S-1 backwards), each
backward tick recomputing its chunk from the stashed input; in the steady ticks the last stage's output is
spread over the stages for the head (its FLOPs once per step). Interleaved 1F1B (pp_repeats = v: 2.2.2)
runs v stage-major chunks per stage, micro-batches in groups of S: bubble (S-1)/(vM+S-1), 2vS-1 stashed
inputs. Weight gradients accumulate in the loop's carry over per-batch-shard weight copies, reduced once per
step; MoE runs one forward pass for the router statistics first, so the losses are the whole batch's.
docs/pipelines.md has the timetable, the stash, the interleaving and the MoE pass step by step.

The code follows that order: `Ticks` (the timetable), `_Plan` (the step before any array), `_prologue` (the
differentiable part before the loop), `_forward`, `_head`, `_recompute` (one batch shard of one stage),
`_backward_fn`, `_router_statistics`, and `_warm_up`, `_steady_state`, `_cool_down` over the carry `_Carry`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.schedule import Schedule, schedule_of
from jaxpar.core.sharding import Layout, constrain, spec_for, use_layout
from jaxpar.core.rules import spec_entry
from jaxpar.core.strategy import Strategy
from jaxpar.models.moe import aux_loss, aux_sum
from jaxpar.models.transformer import RESIDUAL
from jaxpar.pipeline.shards import Shards, ShardedLayout
from jaxpar.pipeline.stages import param_spec, stage_chunk, stage_shift, stage_weights, unit_names, valid_slots

STATE = ("stages", "shards", "rows", "res_seq", "act_embed")   # [S, N, rows, s, d]: the stage state
LABELS = ("stages", "shards", "rows", "seq")                    # [S, N, rows, s]


# ---- the timetable -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ticks:
    """Which micro-batch and repeat each stage runs forward and backward in tick t (module docstring), and
    where a forward's input waits in the stash for its backward. S stages, M micro-batches, v repeats."""
    stages: int
    microbatches: int
    repeats: int

    @property
    def first_backward(self) -> int:
        """B0 = vS - 1: the tick of the first backward (the last stage's last repeat of micro-batch 0)."""
        return self.repeats * self.stages - 1

    @property
    def stash_slots(self) -> int:
        """D = 2vS - 1: the ring of stashed forward inputs per stage."""
        return 2 * self.repeats * self.stages - 1

    def forward_item(self, t, s):
        """(valid, micro-batch, repeat) of stage s's forward in tick t: item i = t - s, in groups of S
        micro-batches taken through the v repeats in turn (v = 1: micro-batch i)."""
        S, M, v = self.stages, self.microbatches, self.repeats
        i = t - s
        return (i >= 0) & (i < v * M), (i // (S * v)) * S + i % S, (i // S) % v

    def backward_item(self, t, s):
        """(valid, micro-batch, repeat) of stage s's backward in tick t: the forward items in reverse
        repeat order, B0 + S-1-s ticks later (the last stage's last repeat: in its head's tick)."""
        S, M, v = self.stages, self.microbatches, self.repeats
        b = t - self.first_backward - (S - 1 - s)
        return (b >= 0) & (b < v * M), (b // (S * v)) * S + b % S, v - 1 - (b // S) % v

    def stashed_at(self, t, s, r):
        """The stash slot of the input of stage s's backward in tick t (repeat r): its forward stored it
        (in slot tick % D) 2(vS - 1 - rS - s) ticks earlier."""
        S, v = self.stages, self.repeats
        return (t - 2 * (v * S - 1 - r * S - s)) % self.stash_slots


# ---- the parameters outside the stages ----------------------------------------------------------------

def _used_leaves(fn, leaves: list, *args) -> list[int]:
    """Indices of `leaves` that fn(leaves, *args) reads (from its jaxpr)."""
    jaxpr = jax.make_jaxpr(fn)(leaves, *args).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [i for i, v in enumerate(jaxpr.invars[:len(leaves)]) if id(v) in used]


def _replaced(leaves: list, at: list[int], new: list) -> list:
    """`leaves` with leaves[at[j]] replaced by new[j]."""
    out = list(leaves)
    for i, w in zip(at, new):
        out[i] = w
    return out


@dataclasses.dataclass(frozen=True)
class _Outside:
    """The model's parameters outside the stacked units as one flat leaf list, and which of them the head
    (final norm, head and loss) and the embedding read: found from their jaxprs, without naming any layer."""
    graphdef: Any
    units: Any                    # the units' state: merged back for the model's structure, never read
    treedef: Any
    leaves: list
    variables: list
    head: tuple[int, ...] = ()
    embedding: tuple[int, ...] = ()

    @classmethod
    def of(cls, model, rows: int, seq: int, dtype) -> _Outside:
        graphdef, units, rest = nnx.split(model, nnx.PathContains("runs"), ...)
        variables = jax.tree.leaves(rest, is_leaf=lambda a: isinstance(a, nnx.Variable))
        leaves, treedef = jax.tree.flatten(rest)
        part = cls(graphdef, units, treedef, leaves, variables)
        y = jax.ShapeDtypeStruct((rows, seq, model.cfg.d_model), dtype)
        ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
        return dataclasses.replace(part, head=tuple(_used_leaves(part.loss, leaves, y, ids)),
                                   embedding=tuple(_used_leaves(part.embed, leaves, ids)))

    def _model(self, leaves: list):
        return nnx.merge(self.graphdef, self.units, jax.tree.unflatten(self.treedef, leaves))

    def loss(self, leaves: list, y, labels):
        """One piece's mean token loss."""
        return self._model(leaves).loss(y, labels)

    def embed(self, leaves: list, ids):
        """The embedding output of token ids [rows, s]."""
        return self._model(leaves).embed(ids)

    def names(self, i: int) -> tuple:
        """Leaf i's logical names."""
        return tuple(self.variables[i].get_metadata().get("out_sharding") or (None,) * self.leaves[i].ndim)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The step's fixed parts, known before any array: the schedule and its timetable, the layouts, the
    parameters outside the stages, the compute dtype, the chunk one stage runs (with MoE blocks, `moe`:
    it returns (y, router statistics [K, 1]), jaxpar/pipeline/stages.py) and the model's config."""
    graphdef: Any
    layout: Layout
    sched: Schedule
    ticks: Ticks
    outside: _Outside
    shards: Shards
    dtype: Any
    chunk: Callable
    cfg: Any                      # the model's ModelConfig

    @classmethod
    def of(cls, graphdef, params, batch: dict, strategy: Strategy, layout: Layout, dtype: str) -> _Plan:
        model = nnx.merge(graphdef, params)
        sched = schedule_of(strategy, model.cfg.run_units)
        rows, seq = batch["labels"].shape[0] // sched.microbatches, batch["labels"].shape[1]
        dt = jnp.dtype(dtype)
        return cls(graphdef, layout, sched, Ticks(sched.stages, sched.microbatches, sched.repeats),
                   _Outside.of(model, rows, seq, dt), Shards.of(layout), dt,
                   stage_chunk(model, sched, layout, per_shard=False, with_aux=True, policy=strategy.options.remat),
                   model.cfg)

    @property
    def moe(self) -> bool:
        return self.cfg.has_moe

    def cast(self, tree):
        """`tree` in the compute dtype."""
        return tree if self.dtype == jnp.float32 else jax.tree.map(lambda p: p.astype(self.dtype), tree)


# ---- before the loop: what it reads, differentiable in the parameters ----------------------------------

def _embedded(plan: _Plan, leaves: list, ids):
    """The embedding output [M, N, rows, s, d] of ids [M, N, rows, s], per batch shard (its table copied,
    as the head's) and micro-batch by micro-batch (a loop): the vocab-parallel lookup's partial sums exist
    for one micro-batch at a time, and the table's gradient accumulates on each device, summed over the
    batch axes once (the copy's transpose)."""
    outside, shards = plan.outside, plan.shards

    def embed_shard(table, ids):                 # ids [M, rows, s] of one batch shard
        own = _replaced(leaves, outside.embedding, table)
        return jax.lax.map(lambda t: outside.embed(own, t), ids)
    with use_layout(shards.inner):
        x = jax.vmap(embed_shard, in_axes=(0, 1), out_axes=1, spmd_axis_name=shards.axis)(
            [shards.copies(leaves[i], outside.names(i), 0, ()) for i in outside.embedding], ids)
    return constrain(x, (None, "shards", "rows") + RESIDUAL[1:])


def _prologue(plan: _Plan, ids, params):
    """(xs, stage weights, head weights): the embedding output of every micro-batch [M, N, rows, s, d],
    the stage weights [S, N, v, k, ...] and the head's weights [N, ...], both gathered over fsdp and
    copied per batch shard. Differentiable in the parameters: its vjp carries the loop's gradients to
    them (the embedding, the stage view, the gathers and the copies)."""
    model = nnx.merge(plan.graphdef, plan.cast(params))
    weights = stage_weights(model, plan.sched, plan.layout, per_shard=False)
    stage_spec = param_spec(("stages",), plan.layout)[0]
    weights = [plan.shards.copies(w, (None, None) + n, 1, (stage_spec,)) for w, n in zip(weights, unit_names(model))]
    leaves = jax.tree.leaves(nnx.split(model, nnx.PathContains("runs"), ...)[2])
    head = [plan.shards.copies(leaves[i], plan.outside.names(i), 0, ()) for i in plan.outside.head]
    return _embedded(plan, leaves, ids), weights, head


def _pieces_fns(layout: Layout, S: int):
    """(spread, piece): spread(y [S, N, rows, s, d]) -> [S, N, rows, s/S, d], stage p holding the p-th
    S-th of the last stage's local sequence (one all-to-all over the stage axes; its transpose, one more,
    backward); piece(labels [S, N, rows, s]) -> the labels of stage p's tokens, sharded as `seq` (the
    head's layout: under SP a `seq` shard holds `sub` = tensor residual shards, whose p-th S-ths it
    takes; no communication). Manual over every mesh axis, as jaxpar/pipeline/gpipe.py's `_spread_fn`."""
    name = spec_entry(layout.axes("stages"))
    mesh, rules = layout.mesh, layout.rules("activations")
    state, labels = spec_for(STATE, rules, mesh), spec_for(LABELS, rules, mesh)
    sub = layout.group(a for a in layout.axes("res_seq") if a not in layout.axes("seq"))

    def spread(y):                                            # local [1, n, rows, s_l, d]
        y = y.reshape(y.shape[:3] + (S, y.shape[3] // S) + y.shape[4:])
        return jax.lax.all_to_all(y, name, 3, 3)[:, :, :, S - 1]   # [.., S (source), s_l/S, d]: the last's

    def piece(l):                                             # local [1, n, rows, sub * s_l]
        l = l.reshape(l.shape[:3] + (sub, S, l.shape[3] // (sub * S)))
        l = jax.lax.dynamic_index_in_dim(l, jax.lax.axis_index(name), 4, keepdims=False)
        return l.reshape(l.shape[:3] + (-1,))
    return (jax.shard_map(spread, mesh=mesh, in_specs=state, out_specs=state),
            jax.shard_map(piece, mesh=mesh, in_specs=labels, out_specs=labels))


# ---- one batch shard of one stage: its forward, its head piece, its backward ---------------------------

def _forward(work, ws, ok, s, h_in, stash, x_t, when):
    """Stage s's forward in tick t on the state it received (stage 0 in repeat 0: the embedding output
    x_t), its input stashed for the backward: (output, stash). `work`: (the chunk, the timetable); `when`:
    (the tick t, the item's positions)."""
    (chunk, ticks), (t, pos) = work, when
    _, _, r = ticks.forward_item(t, s)
    h = jnp.where((s == 0) & (r == 0), x_t, h_in)
    return chunk(ws, ok, r, h, pos), jax.lax.dynamic_update_index_in_dim(stash, h, t % ticks.stash_slots, 0)


def _head(loss_fn, seed: float, hw, z, labels):
    """One piece's loss through the head and its vjp seeded with the piece's share of the mean:
    (weighted loss, head weights' gradient, the piece's cotangent)."""
    loss, head_vjp = jax.vjp(lambda hw, z: loss_fn(hw, z, labels), hw, z)
    d_hw, dz = head_vjp(jnp.asarray(seed, loss.dtype))
    return loss * seed, d_hw, dz


def _stashed(ticks: Ticks, s, stash, t):
    """The input of stage s's backward in tick t, from its stash."""
    _, _, r = ticks.backward_item(t, s)
    return jax.lax.dynamic_index_in_dim(stash, ticks.stashed_at(t, s, r), 0, keepdims=False)


def _recompute(chunk, ticks: Ticks, ws, ok, s, h, t, pos):
    """Stage s's chunk in the repeat of its backward in tick t, on its stashed input h."""
    return chunk(ws, ok, ticks.backward_item(t, s)[2], h, pos)


def _seed(ticks: Ticks, s, g, g_aux, t):
    """The cotangent of stage s's chunk output in tick t: the received g, zero for a bubble; with MoE
    blocks also its router statistics', g_aux [v, K, 1] in the repeat's row (`_aux_cotangent`)."""
    ok_b, _, r = ticks.backward_item(t, s)
    g = jnp.where(ok_b, g, jnp.zeros_like(g))
    if g_aux is None:
        return g
    return g, jnp.where(ok_b, jax.lax.dynamic_index_in_dim(g_aux, r, 0, keepdims=False), 0.0)


def _backward_fn(shards: Shards, chunk, ticks: Ticks, ok) -> Callable:
    """backward(ws, valid, stage, g, g_aux, stash, t, pos) -> (input cotangents, weights' gradients): every
    stage's chunk recomputed from its stashed input and its vjp taken with the received cotangents. The vjp
    is of the stage- and shard-vmapped recompute (the vmap is traced first, as jax.grad of GPipe's loop
    does: JAX 0.12 cannot vmap some transposes, ragged_dot's among them)."""
    stashed = shards.staged(functools.partial(_stashed, ticks), (0, 0, None), (None, 0, None))
    recompute = shards.staged(functools.partial(_recompute, chunk, ticks), (0, ok, 0, 0, None, 0),
                              (0, None, None, 0, None, 0))
    seed = shards.staged(functools.partial(_seed, ticks), (0, 0, 0, None), (None, 0, None, None))

    def backward(ws, valid, stage, g, g_aux, stash, t, pos):
        _, chunk_vjp = jax.vjp(lambda ws, h: recompute(ws, valid, stage, h, t, pos), ws, stashed(stage, stash, t))
        d_ws, d_h = chunk_vjp(seed(stage, g, g_aux, t))
        return d_h, d_ws
    return backward


def _stats_forward(work, ws, ok, s, h_in, x_t, when):
    """Stage s's forward in tick t for its router statistics alone: (output, the statistics [v, K, 1]
    in the row of its repeat, zeros for a bubble); `work` and `when` as `_forward`'s."""
    (chunk, ticks), (t, pos) = work, when
    valid, _, r = ticks.forward_item(t, s)
    y, aux = chunk(ws, ok, r, jnp.where((s == 0) & (r == 0), x_t, h_in), pos)
    at = valid & (jnp.arange(ticks.repeats) == r)
    return y, jnp.where(at.reshape((-1,) + (1,) * aux.ndim), aux[None], 0.0)


# ---- the loop --------------------------------------------------------------------------------------------

class _Carry(NamedTuple):
    """The loop's state, per stage: the forward state each stage receives [S, N, rows, s, d] and the
    cotangent (`bwd`), the stash ring [S, N, D, rows, s, d], the stage and head weights' gradient
    accumulators (float32), the embedding output's cotangent per micro-batch (stage 0's row the one that
    counts) and the loss."""
    fwd: jax.Array
    bwd: jax.Array
    stash: jax.Array
    d_w: list
    d_head: list
    d_xs: jax.Array
    loss: jax.Array


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What every tick reads and nothing changes: the timetable, the weights, the micro-batches' embedding
    outputs, positions and labels [M, N, rows, ...], the stage-vmapped work, and with MoE blocks the
    forward that only collects router statistics and the statistics' cotangent [S, v, K, 1]
    (`_aux_cotangent`; None until it is known, and without MoE blocks)."""
    ticks: Ticks
    weights: list
    valid: Any
    head_w: list
    xs: jax.Array
    ps: jax.Array
    ls: jax.Array
    forward: Callable
    head: Callable
    backward: Callable
    shift_up: Callable
    spread: Callable
    piece: Callable
    stage: jax.Array
    last: jax.Array
    dtype: Any
    stats_forward: Callable | None = None
    g_aux: Any = None

    @classmethod
    def of(cls, plan: _Plan, batch: dict, xs, weights: list, head_w: list) -> _Loop:
        tk, shards = plan.ticks, plan.shards
        S, M, N = tk.stages, tk.microbatches, shards.count
        valid = valid_slots(plan.sched)
        consts = list(plan.cast(plan.outside.leaves))

        def head_loss(hw, y, labels):
            return plan.outside.loss(_replaced(consts, plan.outside.head, hw), y, labels)
        seed = 1.0 / (M * N * S)          # every piece's share of the batch's mean loss
        ps, ls = shards.rows(batch["positions"], ("seq",), M), shards.rows(batch["labels"], ("seq",), M)
        stage = jnp.arange(S)
        last = (stage == S - 1).reshape((S,) + (1,) * (xs.ndim - 1))
        spread, piece = _pieces_fns(plan.layout, S)
        ok = None if valid is None else 0
        chunk = (lambda *a: plan.chunk(*a)[0]) if plan.moe else plan.chunk
        return cls(tk, weights, valid, head_w, xs, ps, ls,
                   shards.staged(functools.partial(_forward, (chunk, tk)), (0, ok, 0, 0, 0, None, (None, 0)),
                                 (0, None, None, 0, 0, 0, (None, 0))),
                   shards.staged(functools.partial(_head, head_loss, seed), (None, 0, 0), (0, 0, 0)),
                   _backward_fn(shards, plan.chunk, tk, ok),
                   stage_shift(plan.layout.mesh, plan.layout.axes("stages")), spread, piece, stage, last,
                   plan.dtype,
                   shards.staged(functools.partial(_stats_forward, (plan.chunk, tk)), (0, ok, 0, 0, None, (None, 0)),
                                 (0, None, None, 0, 0, (None, 0))) if plan.moe else None)

    def positions(self, item):
        """Each stage's micro-batch positions [S, N, rows, s] for its item."""
        return constrain(jnp.take(self.ps, item[1] % self.ticks.microbatches, axis=0), LABELS)

    def zeros(self) -> _Carry:
        """The carry before tick 0."""
        S, D, xs, dt = self.ticks.stages, self.ticks.stash_slots, self.xs, self.dtype
        zeros = constrain(jnp.zeros((S,) + xs.shape[1:], dt), STATE)
        stash = constrain(jnp.zeros((S, xs.shape[1], D) + xs.shape[2:], dt),
                          ("stages", "shards", None, "rows") + STATE[3:])
        d_xs = constrain(jnp.zeros((S,) + xs.shape, dt), ("stages", None) + STATE[1:])
        d_w = [jnp.zeros(w.shape, jnp.float32) for w in self.weights]
        d_head = [jnp.zeros((S,) + w.shape, jnp.float32) for w in self.head_w]
        return _Carry(zeros, zeros, stash, d_w, d_head, d_xs, jnp.zeros((S, xs.shape[1]), jnp.float32))


def _head_tick(loop: _Loop, c: _Carry, y, t) -> _Carry:
    """The last stage's forward output y spread over the stages, each piece through the head and back: the
    last stage's cotangent to start its backward with, the head's gradient and the loss accumulated."""
    M, S = loop.ticks.microbatches, loop.ticks.stages
    labels = jax.lax.dynamic_index_in_dim(loop.ls, loop.ticks.forward_item(t, S - 1)[1] % M, 0, keepdims=False)
    labels = loop.piece(constrain(jnp.broadcast_to(labels, (S,) + labels.shape), LABELS))
    z, spread_back = jax.vjp(loop.spread, y)
    li, d_hw, dz = loop.head(loop.head_w, constrain(z, STATE), labels)
    g = jnp.where(loop.last, spread_back(constrain(dz, STATE))[0], c.bwd)
    return c._replace(bwd=g, d_head=[a + b.astype(a.dtype) for a, b in zip(c.d_head, d_hw)], loss=c.loss + li)


def _forward_tick(loop: _Loop, c: _Carry, t, head_on: bool) -> _Carry:
    """Every stage's forward in tick t (the head too: `head_on`), the outputs shifted one stage up."""
    tk = loop.ticks
    x_t = jax.lax.dynamic_index_in_dim(loop.xs, tk.forward_item(t, 0)[1] % tk.microbatches, 0, keepdims=False)
    y, stash = loop.forward(loop.weights, loop.valid, loop.stage, c.fwd, c.stash, x_t,
                            (t, loop.positions(tk.forward_item(t, loop.stage))))
    y = constrain(y, STATE)
    c = c._replace(stash=stash)
    if head_on:
        c = _head_tick(loop, c, y, t)
    return c._replace(fwd=constrain(loop.shift_up(y), STATE))


def _backward_tick(loop: _Loop, c: _Carry, t) -> _Carry:
    """Every stage's backward in tick t: the weights' gradient accumulated, stage 0's input cotangent
    (repeat 0: the embedding output's) kept per micro-batch, the input cotangents shifted one stage down."""
    tk, stage, M = loop.ticks, loop.stage, loop.ticks.microbatches
    d_h, d_ws = loop.backward(loop.weights, loop.valid, stage, constrain(c.bwd, STATE), loop.g_aux, c.stash, t,
                              loop.positions(tk.backward_item(t, stage)))
    d_w = [a + b.astype(a.dtype) for a, b in zip(c.d_w, d_ws)]
    ok0, j, r0 = tk.backward_item(t, 0)
    keep = ((stage == 0) & ok0 & (r0 == 0)).reshape((tk.stages,) + (1,) * (c.d_xs.ndim - 1))
    old = jax.lax.dynamic_index_in_dim(c.d_xs, j % M, 1, keepdims=True)
    d_xs = jax.lax.dynamic_update_index_in_dim(c.d_xs, jnp.where(keep, d_h[:, None], old), j % M, 1)
    # stage s+1's input cotangent to stage s (stage 0's to S-1, its previous repeat): the up-shift's
    # transpose (one permute, phase "backward")
    bwd = constrain(jax.linear_transpose(loop.shift_up, d_h)(constrain(d_h, STATE))[0], STATE)
    return c._replace(bwd=bwd, d_w=d_w, d_xs=d_xs)


def _ticks(loop: _Loop, c: _Carry, first: int, length: int, fwd_on: bool, bwd_on: bool,
           head_on: bool = False) -> _Carry:
    """Ticks first .. first+length-1 as one loop, each running forwards (fwd_on, with the head: head_on)
    and backwards (bwd_on)."""
    def tick(c, t):
        if fwd_on:
            c = _forward_tick(loop, c, t, head_on)
        if bwd_on:
            c = _backward_tick(loop, c, t)
        return c, None
    return jax.lax.scan(tick, c, first + jnp.arange(length))[0]


def _warm_up(loop: _Loop, c: _Carry) -> _Carry:
    """Ticks 0 .. B0-1: forwards only, no stage has a backward yet."""
    return _ticks(loop, c, 0, loop.ticks.first_backward, fwd_on=True, bwd_on=False)


def _steady_state(loop: _Loop, c: _Carry) -> _Carry:
    """Ticks B0 .. B0 + vM - (v-1)S - 1: forward and backward on every stage, the head in the ticks whose
    last-stage forward is a micro-batch's last repeat. v = 1: every tick. v > 1: M/S groups of S head
    ticks and (v-1)S without, the last group's head ticks alone (its other ticks have no forwards: the
    cool-down's)."""
    S, M, v, B0 = loop.ticks.stages, loop.ticks.microbatches, loop.ticks.repeats, loop.ticks.first_backward
    if v == 1:
        return _ticks(loop, c, B0, M, fwd_on=True, bwd_on=True, head_on=True)

    def group(c, g):
        c = _ticks(loop, c, B0 + g * S * v, S, fwd_on=True, bwd_on=True, head_on=True)
        return _ticks(loop, c, B0 + g * S * v + S, (v - 1) * S, fwd_on=True, bwd_on=True), None
    if M // S > 1:
        c, _ = jax.lax.scan(group, c, jnp.arange(M // S - 1))
    return _ticks(loop, c, B0 + (M // S - 1) * S * v, S, fwd_on=True, bwd_on=True, head_on=True)


def _cool_down(loop: _Loop, c: _Carry) -> _Carry:
    """The last vS - 1 ticks: backwards only, no stage has a forward left."""
    S, M, v = loop.ticks.stages, loop.ticks.microbatches, loop.ticks.repeats
    return _ticks(loop, c, loop.ticks.first_backward + v * M - (v - 1) * S, v * S - 1, fwd_on=False, bwd_on=True)


# ---- the router's auxiliary losses ------------------------------------------------------------------------

def _router_statistics(loop: _Loop) -> jax.Array:
    """Every MoE layer's router statistics summed over the whole batch, [S, v, K, 1] (per stage, repeat
    and unit slot, flattened: jaxpar/pipeline/stages.py), from a forward pass of every micro-batch through
    the stages (the 1F1B timetable's forwards, vM + S - 1 ticks, nothing stashed and no head): the balance
    loss's gradient needs them before the first backward (module docstring)."""
    tk, S, M, v = loop.ticks, loop.ticks.stages, loop.ticks.microbatches, loop.ticks.repeats

    def tick(c, t):
        fwd, acc = c
        x_t = jax.lax.dynamic_index_in_dim(loop.xs, tk.forward_item(t, 0)[1] % M, 0, keepdims=False)
        y, aux = loop.stats_forward(loop.weights, loop.valid, loop.stage, fwd, x_t,
                                    (t, loop.positions(tk.forward_item(t, loop.stage))))
        return (constrain(loop.shift_up(constrain(y, STATE)), STATE), acc + aux), None
    fwd = loop.zeros().fwd
    acc = jax.eval_shape(lambda f: tick((f, 0.0), 0)[0][1], fwd)
    (_, acc), _ = jax.lax.scan(tick, (fwd, jnp.zeros(acc.shape, jnp.float32)), jnp.arange(v * M + S - 1))
    return jnp.sum(acc, axis=1)


def _aux_cotangent(cfg, stats: jax.Array):
    """(the MoE layers' auxiliary loss, their AUX_FIELDS summed over the layers, the loss's gradient
    w.r.t. the statistics [S, v, K, 1]) from the whole batch's statistics. The losses are functions of
    sums over the batch (models/moe.py), so a micro-batch's statistics take this same cotangent in every
    backward: the balance loss's E f_e / tokens per router probability, f_e the whole batch's routed
    fraction (the routed copies carry no gradient), and the z-loss's 1 / tokens."""
    def loss(st):
        fields = aux_sum(cfg, st)
        return aux_loss(cfg, fields), fields
    (value, fields), g = jax.value_and_grad(loss, has_aux=True)(stats)
    return value, fields, g


# ---- the step ----------------------------------------------------------------------------------------------

def pipelined_loss_and_grads(graphdef, params, batch: dict, strategy: Strategy, layout: Layout, dtype: str):
    """(loss, the MoE layers' AUX_FIELDS summed over the layers or None without MoE blocks, gradients
    w.r.t. `params`) of one batch under the 1F1B schedule (module docstring): what jax.value_and_grad of
    Trainer._loss computes."""
    layout = ShardedLayout(layout.mesh, layout.strategy, layout.replicate_kv_heads)
    with use_layout(layout):
        plan = _Plan.of(graphdef, params, batch, strategy, layout, dtype)
        ids = plan.shards.rows(batch["inputs"], ("seq",), plan.ticks.microbatches)       # [M, N, rows, s]
        (xs, weights, head_w), pull_back = jax.vjp(functools.partial(_prologue, plan, ids), params)
        loop = _Loop.of(plan, batch, xs, weights, head_w)
        aux_value, fields = 0.0, None
        if plan.moe:
            aux_value, fields, g_aux = _aux_cotangent(plan.cfg, _router_statistics(loop))
            loop = dataclasses.replace(loop, g_aux=g_aux)
        c = _cool_down(loop, _steady_state(loop, _warm_up(loop, loop.zeros())))
        d_x = constrain(jnp.sum(c.d_xs, axis=0), (None, "shards", "rows") + RESIDUAL[1:])   # as xs: [M, N, rows, s, d]
        d_head = [jnp.sum(g, axis=0).astype(w.dtype) for g, w in zip(c.d_head, head_w)]
        (grads,) = pull_back((d_x, [g.astype(w.dtype) for g, w in zip(c.d_w, weights)], d_head))
        return jnp.sum(c.loss) + aux_value, fields, grads
