"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular schedules, GSPMD-style.

The model's layer units are stacked on a leading `layers` dim (models/lm.py). With S stages,
v repeats (1 for GPipe) and k = units / (S*v) units per chunk, logical unit u runs in

    repeat r = u // (S*k),   stage s = (u // k) % S,   position j = u % k in the chunk,

so an item (a micro-batch in repeat r) flows stage 0 -> 1 -> ... -> S-1, and under the circular
schedule back to stage 0 for repeat r+1. The stacked weights [U, ...] are viewed as
[v, S, k, ...] and the stage dim is moved first, [S, v, k, ...], sharded on `stages` (= pipeline).

Activations live in two stage-sharded buffers, the stage state [S, mb, s, d] and `buf`
[S, M, mb, s, d], and one `lax.scan` runs T = v*M + S - 1 iterations. At iteration t stage s
works on item i = t - s (valid when 0 <= i < v*M): micro-batch i % M in repeat i // M.
`buf` starts as every stage's copy of the M micro-batches (the embedding output is replicated over
`pipeline` anyway, so this costs no communication). Every iteration
  1. stage 0 takes `buf[0, t % M]`: the micro-batch itself in repeat 0, the last stage's output
     for it from the previous repeat afterwards (see 4); stage s > 0 takes what stage s-1
     produced in the previous iteration;
  2. every stage applies its chunk: `vmap` over the stage dim (spmd_axis_name = the pipeline
     axes, so the blocks' own sharding annotations keep the stage dim on `pipeline`) of a scan
     over its k units, rematerialised per iteration (see `_iteration_policy`);
  3. the outputs shift one stage up, the last stage's wrapping round to slot 0: a ppermute, one
     collective-permute over `pipeline` per iteration (and its transpose backward);
  4. slot 0 of the shifted outputs (the last stage's output of item t-S+1, micro-batch m) is
     written to `buf[:, m]` (stage 0's copy is the one that counts), unless the item is a bubble:
     masked, so bubble work never reaches the result and its gradients are exactly zero.
The circular schedule needs M >= S so that an output is back in `buf` before stage 0 reads it
for the next repeat; a slot is overwritten only after stage 0 has read what it held.
After the loop `buf[0]` holds the last repeat's output of every micro-batch: it is replicated
over `pipeline` (one all-reduce) and the micro-batches are merged back into the batch.
Micro-batch m takes rows m, m+M, m+2M, ... (as gradient accumulation in jaxpar.train does): the
split is a reshape that keeps every row on the devices of the `batch` axes that already hold it.

Communication per step, over `pipeline`: T collective-permutes of the stage state [mb, s, d]
(its per-device shard) forward and T backward; one all-reduce of the output [M, mb, s, d] forward
and one of the input's cotangent backward. The circular schedule's [S, v, k] view of weights stored
contiguously as [U] over `pipeline` is a transpose across stages: per weight leaf one all-to-all
(plus one collective-permute when v < S) forward, and the same for its gradient backward (GPipe's
view is free). Avoiding that would need the stacked weights stored in stage-major order. Under
FSDP a stage's weights are all-gathered in every iteration (T times per step, not once).
Bubble fraction (S-1)/(v*M+S-1) (GPipe: Huang et al. 2019; circular/interleaved: Narayanan et al.
2021, v model chunks per device).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.schedule import schedule_of
from jaxpar.sharding import Layout, constrain, spec_for
from jaxpar.strategy import Strategy

WEIGHTS_NAME = "pipeline_stage_weights"   # checkpoint_name of the per-iteration weight gather


# ---- the schedule ------------------------------------------------------------------------------

def _iteration_policy(policy: str):
    """jax.checkpoint policy of one iteration's stage work; never saves the gathered weights."""
    named = jax.checkpoint_policies
    if policy == "none":
        return named.save_anything_except_these_names(WEIGHTS_NAME)
    from jaxpar.models.lm import REMAT_POLICIES  # noqa: PLC0415
    return REMAT_POLICIES[policy]


def _shift_fn(mesh, axes: tuple[str, ...]):
    """y[s] -> y[s+1], the last stage's to stage 0: one collective-permute over the stage axes
    (a ppermute, whose transpose is the reverse permute: one more backward)."""
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    perm = [(i, (i + 1) % n) for i in range(n)]
    name = axes[0] if len(axes) == 1 else axes
    return jax.shard_map(lambda y: jax.lax.ppermute(y, name, perm), mesh=mesh, in_specs=P(name),
                         out_specs=P(name), axis_names=set(axes))


def _split(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]: micro-batch i takes rows i, i+M, i+2M, ..."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _merge(a: jax.Array) -> jax.Array:
    """Inverse of `_split`."""
    a = jnp.swapaxes(a, 0, 1)
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def pipelined_stack(model, x: jax.Array, positions: jax.Array, strategy: Strategy, layout: Layout) -> jax.Array:
    """The model's layer stack on [B, s, d] run as a pipeline over the `pipeline` mesh axis.

    Computes exactly `model.apply_stack(x, positions)`; called by Trainer under `use_layout`.
    """
    from jaxpar.models.lm import unit_step  # noqa: PLC0415
    from jaxpar.models.transformer import RESIDUAL  # noqa: PLC0415

    sched = schedule_of(strategy, model.cfg.units)
    S, v, M, k, T = sched.stages, sched.repeats, sched.microbatches, sched.per_chunk, sched.iterations
    stage_axes = layout.axes("stages")
    spmd_axis = stage_axes[0] if len(stage_axes) == 1 else stage_axes
    state_names = ("stages",) + RESIDUAL

    with jax.named_scope("pipeline"):
        # Weights: [U, ...] -> [S, v, k, ...]; stage s's repeat r is units (r*S + s)*k + [0, k).
        graphdef, stacked = nnx.split(model.units)
        variables = jax.tree.leaves(stacked, is_leaf=lambda a: isinstance(a, nnx.Variable))
        arrays, treedef = jax.tree.flatten(stacked)
        assert len(variables) == len(arrays)
        rules = layout.rules("params")
        w_names = [tuple(var.get_metadata().get("out_sharding") or (None,) * a.ndim)[1:] for var, a in
                   zip(variables, arrays)]

        def sharded(a, names):
            return jax.lax.with_sharding_constraint(
                a, jax.sharding.NamedSharding(layout.mesh, spec_for(names, rules, layout.mesh)))

        def to_stages(a, names):
            a = a.reshape(v, S, k, *a.shape[1:])
            if v > 1 and v % S == 0:   # [U] on `pipeline` is [v, S, k] with v on `pipeline`: say so,
                a = sharded(a, ("stages", None, None) + names)   # so the gradient's way back is too
            return sharded(jnp.swapaxes(a, 0, 1), ("stages", None, None) + names)

        weights = [to_stages(a, n) for a, n in zip(arrays, w_names)]

        # Micro-batches [M, mb, s, d], replicated over `pipeline` like the embedding output; they seed
        # `buf` (every stage's copy, so stage 0 reads its input locally) and their positions stay put.
        xs = constrain(_split(x, M), (None,) + RESIDUAL)
        ps = constrain(_split(positions, M), (None, "batch", "seq"))       # [M, mb, s]

        def stage_work(weights, repeat, h, pos):
            """Every stage applies its chunk of k units (repeat `repeat[s]`) to h[s]."""
            def one_stage(ws, r, h, pos):
                ws = [jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False) if v > 1 else w[0] for w in ws]
                ws = checkpoint_name(ws, WEIGHTS_NAME)
                chunk = jax.tree.unflatten(treedef, ws)
                h, _ = jax.lax.scan(unit_step(graphdef, "none", pos), h, chunk)
                return h
            return jax.vmap(one_stage, spmd_axis_name=spmd_axis)(weights, repeat, h, pos)

        stage_work = jax.checkpoint(stage_work, policy=_iteration_policy(strategy.options.remat),
                                    prevent_cse=False)
        stage = jnp.arange(S)

        def iteration(carry, t):
            shifted, buf = carry                     # [S, mb, s, d], [S, M, mb, s, d]
            item = t - stage
            # stage 0 takes micro-batch t % M from buf (the input in repeat 0, then the last stage's
            # output of the previous repeat), the others what their predecessor just produced.
            first = jax.lax.dynamic_index_in_dim(buf, t % M, 1, keepdims=False)
            h = constrain(jnp.where((stage == 0)[:, None, None, None], first, shifted), state_names)
            pos = constrain(jnp.take(ps, item % M, axis=0), ("stages", "batch", "seq"))
            y = constrain(stage_work(weights, jnp.clip(item // M, 0, v - 1), h, pos), state_names)
            shifted = constrain(shift(y), state_names)
            # slot 0 now holds the last stage's output of item t-S+1: keep it in buf unless it is
            # a bubble (then the slot still holds an input that stage 0 has yet to read).
            m_last = (t - (S - 1)) % M
            old = jax.lax.dynamic_index_in_dim(buf, m_last, 1, keepdims=True)
            new = jnp.where(t >= S - 1, shifted[:, None], old)
            buf = jax.lax.dynamic_update_index_in_dim(buf, new, m_last, 1)
            return (shifted, buf), None

        buf_names = ("stages", None) + RESIDUAL
        shift = _shift_fn(layout.mesh, stage_axes)
        shifted = constrain(jnp.zeros((S,) + xs.shape[1:], x.dtype), state_names)
        buf = constrain(jnp.broadcast_to(xs, (S,) + xs.shape), buf_names)
        (_, buf), _ = jax.lax.scan(iteration, (shifted, buf), jnp.arange(T))
        out = constrain(buf[0], (None,) + RESIDUAL)                      # from stage 0's devices to all
        return constrain(_merge(out), RESIDUAL)
