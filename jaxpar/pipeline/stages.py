"""What every pipeline schedule shares: the stage weights, what one stage runs, and how the stages and
micro-batches are laid out.

jaxpar/pipeline/gpipe.py (GPipe, circular) and jaxpar/pipeline/one_f_one_b.py run a stage's chunk of k unit
slots on every stage at once, a vmap over the stage dim. This module gives them
  * `stage_weights`: each run's stacked units [U_j, ...] viewed as [S, v, k_j, ...] (stage-major storage
    makes an even split a reshape, jaxpar/pipeline/order.py; an uneven one, and every run of a model of
    several, pads with zero slots that run as the identity, `valid_slots`), gathered over fsdp once per
    step, and copied once per data x fsdp shard so that each shard's weight gradient accumulates on its own
    device through the schedule's loop and is summed once after it (jaxpar/pipeline/gpipe.py);
  * `stage_chunk`: the function one stage runs on those weights, run by run, with the MoE blocks' router
    statistics per unit slot (models/moe.py) for the schedule to accumulate;
  * the layout inside the stages' vmap (`InStages`), the cyclic shift of the stage state from one
    stage to the next (`stage_shift`), and the micro-batch split of a batch (`split_microbatches`).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.core.schedule import Schedule
from jaxpar.core.sharding import Layout, spec_for, use_layout
from jaxpar.core.rules import spec_entry
from jaxpar.models.lm import unit_body
from jaxpar.ops.layer_scan import LayerScan

WEIGHTS_NAME = "pipeline_stage_weights"   # checkpoint_name of the per-iteration weight slice
COPY_AXES = ("data", "fsdp")              # the batch axes that hold one copy of the stage weights each
                                          # (`expert` rows run the expert kernel's all-to-alls instead)


# ---- mesh axes and specs -------------------------------------------------------------------------------

def _without(dim, drop: tuple[str, ...]):
    """One PartitionSpec entry with the mesh axes `drop` removed."""
    return spec_entry(tuple(a for a in ((dim,) if isinstance(dim, str) else dim) if a not in drop))


def param_spec(names: tuple, layout: Layout, drop: tuple[str, ...] = (), lead: tuple = (),
               gathered: bool = False) -> P:
    """PartitionSpec of a parameter with logical `names` (the params rules; `gathered`: the compute rules,
    its ZeRO-3 gather target), without the mesh axes `drop` (those it is copied over), after `lead` dims
    given as they are."""
    spec = tuple(spec_for(names, layout.rules("compute" if gathered else "params"), layout.mesh))
    return P(*lead, *(_without(d, drop) if isinstance(d, (str, tuple)) else d for d in spec))


def _constrained(a: jax.Array, names: tuple, layout: Layout, gathered: bool = False) -> jax.Array:
    spec = param_spec(names, layout, gathered=gathered)
    return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(layout.mesh, spec))


class InStages(Layout):
    """The layout inside the pipeline's vmap over stages: a shard_map there (the MoE kernel, jaxpar/ops/moe.py)
    is batched over the vmapped mesh axes, which its own replication check cannot yet follow (JAX 0.12
    compares its unbatched out_specs with values that vary over them too), so it runs unchecked."""
    in_vmap = True


class _WithoutFsdpBatch(InStages):
    """The layout inside the pipeline's vmap over fsdp (x data) shards: the vmapped dim is their batch share."""

    def rules(self, purpose: str):
        rules = dict(super().rules(purpose))
        rules["batch"] = tuple(a for a in rules["batch"] if a not in COPY_AXES)
        return type(super().rules(purpose))(rules)


# ---- the stage weights ---------------------------------------------------------------------------------

def _run_states(model) -> list:
    """(graphdef, stacked state) of each run's units, in layer order."""
    return [nnx.split(units) for units in model.runs]


def unit_names(model) -> list[tuple]:
    """Per weight leaf of the stacked runs (run by run, jax.tree order in each), its logical names without
    the `layers` dim."""
    names = []
    for _, stacked in _run_states(model):
        variables = jax.tree.leaves(stacked, is_leaf=lambda a: isinstance(a, nnx.Variable))
        names += [tuple(var.get_metadata().get("out_sharding") or (None,) * a.ndim)[1:]
                  for var, a in zip(variables, jax.tree.leaves(stacked), strict=True)]
    return names


def stacked_leaves(model) -> list[jax.Array]:
    """Every weight leaf of the stacked runs, in `unit_names` order."""
    return [a for _, stacked in _run_states(model) for a in jax.tree.leaves(stacked)]


def _stage_view(a: jax.Array, sched: Schedule, layout: Layout, names: tuple) -> jax.Array:
    """A stacked weight [U, ...] in stored order as [S, v, k, ...]: chunk r*S + s at [s, r], padded with
    zeros to k. Even splits are stored stage-major (jaxpar/pipeline/order.py): a reshape, each stage's
    block already on it."""
    S, v, k = sched.stages, sched.repeats, sched.per_chunk
    names = ("stages", None, None) + names
    if sched.even:
        return _constrained(a.reshape(S, v, k, *a.shape[1:]), names, layout)
    # stage-major order straight away (a [v, S] -> [S, v] swap would split a sharded dim backward)
    starts = np.cumsum((0,) + sched.split)
    pad = jnp.zeros((k - min(sched.split),) + a.shape[1:], a.dtype)
    chunks = [jnp.concatenate([a[b:b + n], pad[:k - n]]) for b, n in zip(starts, sched.split)]
    a = jnp.stack([chunks[r * S + s] for s in range(S) for r in range(v)])
    return _constrained(a.reshape(S, v, k, *a.shape[2:]), names, layout)


def valid_slots(sched: Schedule) -> tuple[jax.Array, ...] | None:
    """Per run, [S, v, k_j] bool: slot j of stage s's chunk in repeat r holds a unit of the run (not
    padding); None for an even split (no padding)."""
    if sched.even:
        return None
    S, v, masks = sched.stages, sched.repeats, []
    for run in (sched.for_run(j) for j in range(len(sched.runs))):
        sizes = np.asarray(run.split).reshape(v, S).T          # [S, v]
        masks.append(jnp.asarray(np.arange(run.per_chunk)[None, None, :] < sizes[:, :, None]))
    return tuple(masks)


def _copy_axes(layout: Layout, per_shard: bool) -> tuple[tuple[str, ...], int]:
    """(the batch axes that hold one copy of the stage weights each, F = their devices); none without
    `per_shard`."""
    copies = tuple(a for a in layout.axes("batch") if a in COPY_AXES) if per_shard else ()
    return copies, layout.group(copies)


def _shard_copies(w: jax.Array, view: jax.Array, names: tuple, copies: tuple[str, ...], F: int,
                  layout: Layout) -> jax.Array:
    """The gathered stage weight w [S, v, k, ...] as one copy per shard of the `copies` axes, [S, F, ...]
    (a broadcast: each device keeps what it holds). With `data` beside fsdp the data copies are made of the
    fsdp-sharded `view` first, so that the gradient is summed over fsdp into its shards (a reduce-scatter)
    before the shards are summed over data, and nothing is reduced over `data` inside the loop either."""
    mesh, S = layout.mesh, w.shape[0]
    spec = tuple(spec_for(("stages", None, None) + names, layout.rules("params"), mesh))
    spec = (spec + (None,) * w.ndim)[:w.ndim]
    rest = tuple(param_spec(("stages", None, None) + names, layout, copies, gathered=True))
    rest = (rest + (None,) * w.ndim)[1:w.ndim]
    if "fsdp" in copies and copies != ("fsdp",):   # [S, D, ...] data copies of the fsdp-sharded view
        D = F // mesh.shape["fsdp"]
        view = jnp.broadcast_to(view[:, None], (S, D) + view.shape[1:])
        view = jax.lax.with_sharding_constraint(view, jax.sharding.NamedSharding(mesh, P(spec[0], "data", *spec[1:])))
        w = jnp.broadcast_to(view[:, :, None], (S, D, F // D) + view.shape[2:])
        w = w.reshape((S, F) + w.shape[3:])
    else:
        w = jnp.broadcast_to(w[:, None], (S, F) + w.shape[1:])
    spec = P(spec[0], spec_entry(copies), *rest)
    return jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, spec))


def stage_weights(model, sched: Schedule, layout: Layout, per_shard: bool = True) -> list[jax.Array]:
    """Per weight leaf of the stacked runs (`unit_names` order), the stage view [S, v, k_j, ...] gathered over
    fsdp here, once per step (module docstring); differentiable in the units. With F > 1 data x fsdp
    shards and `per_shard`: [S, F, v, k, ...], one gathered copy per shard. per_shard=False: no copies, for
    a caller that makes its own (jaxpar/pipeline/one_f_one_b.py)."""
    names = unit_names(model)
    run_of = [j for j, (_, stacked) in enumerate(_run_states(model)) for _ in jax.tree.leaves(stacked)]
    views = [_stage_view(a, sched.for_run(j), layout, n) for a, j, n in zip(stacked_leaves(model), run_of, names)]
    weights = [_constrained(w, ("stages", None, None) + n, layout, gathered=True) for w, n in zip(views, names)]
    copies, F = _copy_axes(layout, per_shard)
    if F == 1:
        return weights
    return [_shard_copies(w, view, n, copies, F, layout) for w, view, n in zip(weights, views, names)]


# ---- what one stage runs -------------------------------------------------------------------------------

def _slots(step, h, units, real):
    """A run's unit slots applied in turn to h by the scan body `step`: (y, their per-slot outputs); `real`
    [k] marks the slots that hold a unit (None: all), a padding slot being the identity that sees no token."""
    if real is None:
        return jax.lax.scan(step, h, units)

    def slot(h, unit):
        w, ok = unit
        y, aux = step(h, w)
        return jnp.where(ok, y, h), None if aux is None else jnp.where(ok, aux, 0.0)
    return jax.lax.scan(slot, h, (units, real))


def _unit_chunk(runs: list, repeats: int, policy: str, moe: bool) -> Callable:
    """chunk(ws, ok, r, h, pos): every run's unit slots of repeat r applied in turn to h [rows, s, d]
    (`runs`: (graphdef, treedef, leaf count) of each; weights ws, the runs' leaves [v, k_j, ...] in order;
    real slots ok, per run [v, k_j], or None); (y, the slots' MoE statistics flattened [K]) with `moe`,
    else y."""
    def chunk(ws, ok, r, h, pos):
        ws = [jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False) if repeats > 1 else w[0] for w in ws]
        ws = checkpoint_name(ws, WEIGHTS_NAME)
        stats, start = [], 0
        for j, (graphdef, treedef, n) in enumerate(runs):
            units = jax.tree.unflatten(treedef, ws[start:start + n])
            real = None if ok is None else (jax.lax.dynamic_index_in_dim(ok[j], r, 0, keepdims=False)
                                            if repeats > 1 else ok[j][0])
            h, aux = _slots(LayerScan(policy).step(unit_body(graphdef, pos)), h, units, real)
            stats += [] if aux is None else [aux.reshape(-1)]
            start += n
        return (h, jnp.concatenate(stats)) if moe else h
    return chunk


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


def _per_shard_chunk(chunk: Callable, copies: tuple[str, ...], F: int, layout: Layout, moe: bool) -> Callable:
    """`chunk` run by each of the F weight-copy shards on its rows with its own copy of the weights
    ([F, v, k, ...]); the MoE statistics per shard, [K, F]."""
    batch_axes = layout.axes("batch")
    before = layout.group(batch_axes[:batch_axes.index(copies[0])])
    inner_layout = _WithoutFsdpBatch(layout.mesh, layout.strategy, layout.replicate_kv_heads)

    def sharded_chunk(ws, ok, r, h, pos):
        with use_layout(inner_layout):
            out = jax.vmap(chunk, in_axes=(0, None, None, 0, 0), spmd_axis_name=spec_entry(copies))(
                ws, ok, r, _fsdp_split(h, F, before), _fsdp_split(pos, F, before))
        y = _fsdp_merge((out[0] if moe else out)[None], before)[0]
        return (y, jnp.swapaxes(out[1], 0, 1)) if moe else y
    return sharded_chunk


def stage_chunk(model, sched: Schedule, layout: Layout, per_shard: bool = True, with_aux: bool = False,
                policy: str = "none") -> Callable:
    """chunk(ws, ok, r, h, pos): one stage's k unit slots of repeat r applied to h [mb, s, d], with ws and
    ok that stage's slices of `stage_weights(model, sched, layout, per_shard)` and `valid_slots(sched)`;
    with F > 1 weight copies (`per_shard`), h's rows run per data x fsdp shard with that shard's copy.
    policy: the remat policy of each unit inside the chunk ("none": the schedule rematerialises whole
    iterations, jaxpar/pipeline/gpipe.py; 1F1B passes the run's, so its backward tick's recompute keeps one
    unit's activations at a time, not the chunk's k; under "selective" the units are not rematerialised and
    their attention cores recompute themselves, models/transformer.py).
    with_aux: chunk returns (y, aux) with aux the MoE blocks' router statistics per unit slot and rows
    shard, [K, R] (K: the slots' statistics flattened, run by run; R = F copies, else 1; zeros in padding
    slots; models/moe.py: sums over the tokens, to be summed over R and micro-batches), or None for a
    model without MoE blocks."""
    runs = [(graphdef, jax.tree.structure(stacked), len(jax.tree.leaves(stacked)))
            for graphdef, stacked in _run_states(model)]
    moe = with_aux and model.cfg.has_moe
    chunk = _unit_chunk(runs, sched.repeats, policy, moe)
    copies, F = _copy_axes(layout, per_shard)
    if F > 1:
        return _per_shard_chunk(chunk, copies, F, layout, moe)
    if not moe:
        return chunk

    def one_shard_chunk(ws, ok, r, h, pos):      # the rows' one shard
        y, aux = chunk(ws, ok, r, h, pos)
        return y, aux[:, None]
    return one_shard_chunk


# ---- moving stage state and micro-batches --------------------------------------------------------------

def stage_shift(mesh, axes: tuple[str, ...]) -> Callable:
    """y[s] -> y[s+1] cyclically (the last stage's to stage 0): one collective-permute over the stage axes
    (a ppermute, whose transpose is the reverse permute: one more backward)."""
    n = math.prod(mesh.shape[a] for a in axes)
    perm = [(i, (i + 1) % n) for i in range(n)]
    name = spec_entry(axes)
    return jax.shard_map(lambda y: jax.lax.ppermute(y, name, perm), mesh=mesh, in_specs=P(name),
                         out_specs=P(name), axis_names=set(axes))


def split_microbatches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]: micro-batch i takes rows i, i+M, i+2M, ... (as gradient accumulation in
    jaxpar.training.trainer does), a reshape that keeps every row on the devices that hold it."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def merge_microbatches(a: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`."""
    a = jnp.swapaxes(a, 0, 1)
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
