"""The pipeline's stage weights: the stacked layer units viewed per stage, and what one stage runs.

jaxpar/pipeline/gpipe.py (GPipe, circular) and jaxpar/pipeline/one_f_one_b.py run a stage's chunk of k unit slots on
every stage at once, a vmap over the stage dim. This module gives them that chunk and its weights: the
stacked units [U, ...] viewed as [S, v, k, ...] (stage-major storage makes an even split a reshape,
jaxpar/pipeline/order.py; an uneven one pads with zero slots that run as the identity), gathered over
fsdp once per step, and copied once per data x fsdp shard so that each shard's weight gradient
accumulates on its own device through the schedule's loop and is summed once after it (the module
docstring of jaxpar/pipeline/gpipe.py says why and what it costs). MoE blocks also return their router
statistics per unit slot (models/moe.py), which the schedule accumulates.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.core.schedule import Schedule
from jaxpar.core.sharding import Layout, spec_for, use_layout

WEIGHTS_NAME = "pipeline_stage_weights"   # checkpoint_name of the per-iteration weight slice


def _axis_name(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _stage_view(a: jax.Array, sched: Schedule, sharded, names) -> jax.Array:
    """A stacked weight [U, ...] in stored order as [S, v, k, ...]: chunk r*S + s at [s, r], padded with
    zeros to k. Even splits are stored stage-major (jaxpar/pipeline/order.py): a reshape, each stage's
    block already on it."""
    S, v, k = sched.stages, sched.repeats, sched.per_chunk
    if sched.even:
        return sharded(a.reshape(S, v, k, *a.shape[1:]), ("stages", None, None) + names)
    # stage-major order straight away (a [v, S] -> [S, v] swap would split a sharded dim backward)
    starts = np.cumsum((0,) + sched.split)
    pad = jnp.zeros((k - min(sched.split),) + a.shape[1:], a.dtype)
    chunks = [jnp.concatenate([a[b:b + n], pad[:k - n]]) for b, n in zip(starts, sched.split)]
    a = jnp.stack([chunks[r * S + s] for s in range(S) for r in range(v)])
    return sharded(a.reshape(S, v, k, *a.shape[2:]), ("stages", None, None) + names)


def _valid_slots(sched: Schedule) -> np.ndarray:
    """[S, v, k] bool: slot j of stage s's chunk in repeat r holds a unit (not padding)."""
    S, v, k = sched.stages, sched.repeats, sched.per_chunk
    sizes = np.asarray(sched.split).reshape(v, S).T          # [S, v]
    return np.arange(k)[None, None, :] < sizes[:, :, None]


def stage_chunks(model, sched: Schedule, layout: Layout, per_shard: bool = True, with_aux: bool = False,
                 policy: str = "none"):
    """(weights, chunk, valid): the stacked units viewed per stage and what one stage runs.

    weights: per weight leaf [S, v, k, ...] ([S, F, v, k, ...] with F > 1 data x fsdp shards: one (gathered)
    copy per shard), gathered over fsdp here, once per step (module docstring); differentiable in the units.
    chunk(ws, ok, r, h, pos): one stage's k unit slots of repeat r applied to h [mb, s, d] (its rows run
    per fsdp shard with that shard's copy), ws and ok that stage's slices of `weights` and `valid`.
    valid: [S, v, k] bool of the real (non-padding) slots, None for an even split.
    per_shard=False: no fsdp copies (weights [S, v, k, ...] gathered over fsdp, chunk on whatever rows
    it is given), for a caller that makes its own (jaxpar/pipeline/one_f_one_b.py).
    policy: the remat policy of each unit inside the chunk ("none": the schedule rematerialises whole
    iterations, jaxpar/pipeline/gpipe.py; 1F1B passes the run's, so its backward tick's recompute keeps one
    unit's activations at a time, not the chunk's k).
    with_aux: chunk returns (y, aux) with aux the MoE blocks' router statistics per unit slot and rows
    shard, [k, R, n] (R = F copies, else 1; zeros in padding slots; models/moe.py: sums over the tokens,
    to be summed over R and micro-batches), or None for a model without MoE blocks."""
    from jaxpar.models.lm import unit_step  # noqa: PLC0415

    S, v = sched.stages, sched.repeats
    graphdef, stacked = nnx.split(model.units)
    variables = jax.tree.leaves(stacked, is_leaf=lambda a: isinstance(a, nnx.Variable))
    arrays, treedef = jax.tree.flatten(stacked)
    assert len(variables) == len(arrays)
    rules = layout.rules("params")
    w_names = [tuple(var.get_metadata().get("out_sharding") or (None,) * a.ndim)[1:] for var, a in
               zip(variables, arrays)]
    mesh = layout.mesh

    def sharded(a, names, drop=()):
        spec = spec_for(names, rules, mesh)
        spec = P(*(d if not isinstance(d, (str, tuple)) else _without(d, drop) for d in spec))
        return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, spec))

    views = [_stage_view(a, sched, sharded, n) for a, n in zip(arrays, w_names)]
    weights = [sharded(w, ("stages", None, None) + n, drop=("fsdp",)) for w, n in zip(views, w_names)]
    # FSDP: one copy of the gathered weights per fsdp shard, [S, F, v, k, ...] (a broadcast: each device
    # keeps what it holds), so each shard's weight gradient accumulates on its own device through the
    # loop and is reduced (the broadcast's transpose) once after it (module docstring).
    batch_axes = layout.axes("batch")
    # With `data` too, the copies are per data x fsdp shard (nothing reduced over `data` in the loop
    # either), made as data copies of the fsdp-sharded view first, so that the gradient is summed over
    # fsdp into its shards (a reduce-scatter) before the shards are summed over data (found by
    # `plan --verify`: otherwise every iteration all-reduced the gathered weights' gradient over data).
    copies = tuple(a for a in batch_axes if a in _COPY_AXES) if per_shard else ()
    F = int(np.prod([mesh.shape[a] for a in copies])) if copies else 1
    if F > 1:
        def per_shard(w, view, n):
            spec = tuple(spec_for(("stages", None, None) + n, rules, mesh))
            spec = (spec + (None,) * w.ndim)[:w.ndim]
            rest = [_without(d, copies) if isinstance(d, (str, tuple)) else d for d in spec[1:]]
            if "fsdp" in copies and copies != ("fsdp",):   # [S, D, ...] data copies of the fsdp-sharded view
                D = F // mesh.shape["fsdp"]
                view = jnp.broadcast_to(view[:, None], (S, D) + view.shape[1:])
                view = jax.lax.with_sharding_constraint(
                    view, jax.sharding.NamedSharding(mesh, P(spec[0], "data", *spec[1:])))
                w = jnp.broadcast_to(view[:, :, None], (S, D, F // D) + view.shape[2:])
                w = w.reshape((S, F) + w.shape[3:])
            else:
                w = jnp.broadcast_to(w[:, None], (S, F) + w.shape[1:])
            spec = P(spec[0], _axis_name(copies), *rest)
            return jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, spec))
        weights = [per_shard(w, view, n) for w, view, n in zip(weights, views, w_names)]
        before = 1
        for a in batch_axes[:batch_axes.index(copies[0])]:
            before *= mesh.shape[a]
        inner_layout = _WithoutFsdpBatch(layout.mesh, layout.strategy, layout.replicate_kv_heads)
    valid = None if sched.even else jnp.asarray(_valid_slots(sched))
    moe = with_aux and "E" in model.cfg.pattern

    def chunk(ws, ok, r, h, pos):
        ws = [jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False) if v > 1 else w[0] for w in ws]
        ws = checkpoint_name(ws, WEIGHTS_NAME)
        units = jax.tree.unflatten(treedef, ws)
        step = unit_step(graphdef, policy, pos)
        if ok is None:
            y, aux = jax.lax.scan(step, h, units)
        else:
            ok = jax.lax.dynamic_index_in_dim(ok, r, 0, keepdims=False) if v > 1 else ok[0]

            def slot(h, unit):                   # a padding slot is the identity and sees no token
                w, real = unit
                y, aux = step(h, w)
                return jnp.where(real, y, h), None if aux is None else jnp.where(real, aux, 0.0)
            y, aux = jax.lax.scan(slot, h, (units, ok))
        return (y, aux) if moe else y

    def stage_chunk(ws, ok, r, h, pos):          # F == 1: the rows' one shard
        y, aux = chunk(ws, ok, r, h, pos)
        return y, aux[:, None]

    if F == 1:
        return weights, stage_chunk if moe else chunk, valid

    def sharded_chunk(ws, ok, r, h, pos):        # each fsdp shard its rows with its own copy of the weights
        with use_layout(inner_layout):
            out = jax.vmap(chunk, in_axes=(0, None, None, 0, 0), spmd_axis_name=_axis_name(copies))(
                ws, ok, r, _fsdp_split(h, F, before), _fsdp_split(pos, F, before))
        y = _fsdp_merge((out[0] if moe else out)[None], before)[0]
        return (y, jnp.swapaxes(out[1], 0, 1)) if moe else y
    return weights, sharded_chunk, valid



_COPY_AXES = ("data", "fsdp")   # the batch axes that FSDP inside the stages makes weight copies over


class _InStages(Layout):
    """The layout inside the pipeline's vmap over stages: a shard_map there (the MoE kernel, jaxpar/ops/moe.py)
    is batched over the vmapped mesh axes, which its own replication check cannot yet follow (JAX 0.12
    compares its unbatched out_specs with values that vary over them too), so it runs unchecked."""
    in_vmap = True


class _WithoutFsdpBatch(_InStages):
    """The layout inside the pipeline's vmap over fsdp (x data) shards: the vmapped dim is their batch share."""

    def rules(self, purpose: str):
        rules = dict(super().rules(purpose))
        rules["batch"] = tuple(a for a in rules["batch"] if a not in _COPY_AXES)
        return type(super().rules(purpose))(rules)


def _fsdp_split(a: jax.Array, F: int, before: int) -> jax.Array:
    """[B, ...] with B sharded over (axes of size `before`, fsdp, the rest) -> [F, B/F, ...]: each fsdp
    shard's rows (a reshape that moves no row between devices)."""
    a = a.reshape(before, F, a.shape[0] // (before * F), *a.shape[1:])
    return jnp.swapaxes(a, 0, 1).reshape(F, a.shape[0] * a.shape[2], *a.shape[3:])


def _fsdp_merge(a: jax.Array, before: int) -> jax.Array:
    """Inverse of `_fsdp_split` under the stage dim: [S, F, B/F, ...] -> [S, B, ...]."""
    S, F, rows = a.shape[:3]
    a = a.reshape(S, F, before, rows // before, *a.shape[3:])
    return jnp.swapaxes(a, 1, 2).reshape(S, F * rows, *a.shape[4:])


def _without(dim, drop: tuple[str, ...]):
    axes = tuple(a for a in ((dim,) if isinstance(dim, str) else dim) if a not in drop)
    return None if not axes else axes[0] if len(axes) == 1 else axes
