"""FSDP prefetch: the layer scan gathers the next unit's weights while the current unit computes.

Under FSDP (ZeRO-3) each stacked weight is stored sharded over `fsdp` and XLA all-gathers a unit's
slice inside the scan body, right before the matmuls that read it: the gather and the unit's compute
are dependent, so nothing can overlap them unless the compiler pipelines the loop (the `gpu_overlap`
xla_preset asks XLA's collective pipeliner to). `fsdp_prefetch = true` writes the pipelining into the
program instead (the schedule of PyTorch FSDP's forward/backward prefetch; Zhao et al. 2023, "PyTorch
FSDP", section 3.3):

    forward  iteration i: gather unit i+1's weights (no dependence on unit i)  |  unit i on the
                          weights gathered in iteration i-1 (the scan carry)
    backward iteration i: gather unit i-1's weights                           |  recompute unit i from
                          its saved input and take its vector-Jacobian product; reduce-scatter unit
                          i's weight gradient to its fsdp shards

Autodiff of such a scan would keep every iteration's carry, i.e. every unit's gathered weights, for
the backward pass: the whole model unsharded on each device. So the backward is written out
(`jax.custom_vjp`): the forward saves only each unit's input (as remat = "full" does, which this option
therefore requires: jaxpar/core/validate.py), and the backward gathers the weights again, one unit ahead.

Memory: two units' gathered weights at a time (the one computing and the one arriving), in the
parameters' dtype and tensor shard, instead of one; plus the units' inputs, as under remat = "full".
Bytes: the same gathers and reduce-scatters as without the option (one gather per unit forward, one
backward, one gradient reduce-scatter per unit); the first unit's weights are gathered before the loop
and the loop's last prefetch gathers a unit that is not used (index clamped): one extra gather each way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.core.sharding import current_layout, spec_for


def _leaf_shardings(stacked) -> tuple[list[NamedSharding], list[NamedSharding]]:
    """Per weight leaf (one unit's slice): the gathered layout its matmuls read (rules "compute": no
    fsdp) and its stored layout (rules "params"), both without the leading `layers` dim."""
    layout = current_layout()
    variables = jax.tree.leaves(stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
    gathered, stored = [], []
    for v in variables:
        names = tuple(v.get_metadata().get("out_sharding") or ())[1:] or (None,) * (len(v.shape) - 1)
        gathered.append(NamedSharding(layout.mesh, spec_for(names, layout.rules("compute"), layout.mesh)))
        stored.append(NamedSharding(layout.mesh, spec_for(names, layout.rules("params"), layout.mesh)))
    return gathered, stored


def prefetched_scan(unit_fn, x: jax.Array, stacked):
    """`jax.lax.scan(unit_fn, x, stacked)` for unit_fn(x, unit) -> (x, aux or None), with each unit's
    FSDP weight gather issued one iteration ahead, forward and backward (module docstring)."""
    arrays, treedef = jax.tree.flatten(stacked)
    gathered, stored = _leaf_shardings(stacked)
    units = arrays[0].shape[0]

    def take(ws, i):
        return [jax.lax.dynamic_index_in_dim(w, i, 0, keepdims=False) for w in ws]

    def gather(ws, i):
        return [jax.lax.with_sharding_constraint(w, s) for w, s in zip(take(ws, i), gathered)]

    def apply(h, unit):
        return unit_fn(h, jax.tree.unflatten(treedef, unit))

    def forward(h, ws):
        def body(carry, i):
            h, cur = carry
            nxt = gather(ws, jnp.minimum(i + 1, units - 1))    # independent of this unit's compute
            out, aux = apply(h, cur)
            return (out, nxt), (h, aux)
        (h, _), (inputs, aux) = jax.lax.scan(body, (h, gather(ws, 0)), jnp.arange(units))
        return (h, aux), inputs

    @jax.custom_vjp
    def run(h, ws):
        return forward(h, ws)[0]

    def run_fwd(h, ws):
        out, inputs = forward(h, ws)
        return out, (inputs, ws)

    def run_bwd(residuals, cotangent):
        inputs, ws = residuals
        g_out, g_aux = cotangent

        def body(carry, i):
            g_h, cur = carry
            prv = gather(ws, jnp.maximum(i - 1, 0))             # independent of this unit's backward
            _, vjp = jax.vjp(apply, inputs[i], cur)
            g_in, g_unit = vjp((g_h, None if g_aux is None else g_aux[i]))
            g_unit = [jax.lax.with_sharding_constraint(g, s) for g, s in zip(g_unit, stored)]
            return (g_in, prv), g_unit
        (g_h, _), g_ws = jax.lax.scan(body, (g_out, gather(ws, units - 1)), jnp.arange(units), reverse=True)
        return g_h, g_ws

    run.defvjp(run_fwd, run_bwd)
    return run(x, arrays)
