"""Mixture-of-experts dispatch: token copies to their experts and back, locally or expert-parallel.

    x [g, s, d] tokens in g groups, ids and weights [g, s, k] (the router's, models/moe.py), w_gate, w_up
    [E, d, f], w_down [E, f, d]  ->  y [g, s, d] = sum_j weights_j * kept_j * FFN_{ids_j}(x), kept [g, s, k]

Each group gives each expert at most C copies (dropless: C = s; capacity: ceil(cf * s * k / E)), queued
first choices first in token order (GShard), so the drops do not depend on how the batch is split. The
`padded` kernel fills static buffers [E, C, d] per group and runs the experts as one batched matmul; the
`grouped` kernel (jaxpar/ops/moe_grouped.py) sorts the kept copies by expert and multiplies only those
(ragged_dot); both keep and drop the same copies (`queue_slots`). Under expert parallelism the kernel runs
in `jax.shard_map`: one all_to_all over `expert` sends each block of buffers to its experts' owner, a second
brings the outputs back (Lepikhin et al. 2020); an expert width split over `tensor` is summed by one psum
after the combine; under context parallelism each shard gathers every shard's queue counts. docs/kernels.md
has the buffers, the layouts and the pipeline's vmaps at length.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core import validate
from jaxpar.ops.capacity import bucket_rows, group_capacity
from jaxpar.ops.fp8 import ExpertRows, Recipe, expert_weights
from jaxpar.ops.moe_grouped import Route, expert_parallel_grouped, local_grouped
from jaxpar.core.sharding import current_layout
from jaxpar.core.rules import spec_entry
from jaxpar.xla_workarounds import ragged_all_to_all_runs, ragged_dot_nests


def expert_ffn(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               rows: ExpertRows = ExpertRows()) -> jax.Array:
    """SwiGLU of each expert's rows: xs [..., E, R, d] with w [E, d, f], [E, f, d] -> [..., E, R, d]; under
    float8 each GEMM's rows scaled by `rows` (jaxpar/ops/fp8.py)."""
    xs = rows.inputs(xs)
    gate = rows.gradient(jnp.einsum("...erd,edf->...erf", xs, w_gate), hidden=True)
    up = rows.gradient(jnp.einsum("...erd,edf->...erf", xs, w_up), hidden=True)
    h = rows.inputs(jax.nn.silu(gate) * up, hidden=True)
    return rows.gradient(jnp.einsum("...erf,efd->...erd", h, w_down))


# ---- the queue -----------------------------------------------------------------------------------

def queue_slots(ids: jax.Array, experts: int, capacity: int, context_axes: tuple[str, ...] = ()):
    """(slot, kept), both [g, s, k]: a copy's row in this shard's buffer of its (group, expert), and
    whether its place in the sequence's queue (first choices first, then token order) is < capacity.

    Inside a shard_map over a sequence split on `context_axes`, the queue runs over every shard's
    tokens in shard order: the place adds the copies that earlier shards queue before it. A shard's
    kept copies of one (group, expert) are a prefix of its own queue, so its slots stay < min(s, C).
    """
    onehot = jax.nn.one_hot(jnp.swapaxes(ids, 1, 2), experts, dtype=jnp.int32)   # [g, k, s, E]
    within = jnp.sum((jnp.cumsum(onehot, axis=2) - onehot) * onehot, axis=-1)     # [g, k, s]
    counts = onehot.sum(axis=2)                                                    # [g, k, E]

    def before(c):  # copies of the same (group, expert) in earlier choices: [g, k, E] -> [g, k, s]
        earlier = jnp.cumsum(c, axis=1) - c
        return jnp.sum(earlier[:, :, None, :] * onehot, axis=-1)

    slot = before(counts) + within
    if context_axes:
        every = jax.lax.all_gather(counts, context_axes)                          # [c, g, k, E]
        me = jax.lax.axis_index(context_axes)
        earlier_shards = jnp.sum(jnp.where((jnp.arange(every.shape[0]) < me)[:, None, None, None], every, 0), 0)
        place = before(every.sum(0)) + jnp.sum(earlier_shards[:, :, None, :] * onehot, axis=-1) + within
    else:
        place = slot
    return jnp.swapaxes(slot, 1, 2), jnp.swapaxes(place < capacity, 1, 2)


def _dispatch_group(x, ids, slot, kept, experts: int, cap: int):
    """One group: x [s, d] -> buffers [E, cap, d] (dropped copies go to a spare row, cut off)."""
    s, d = x.shape
    row = jnp.where(kept, slot, cap)
    copies = jnp.broadcast_to(x[:, None, :], (s, ids.shape[-1], d))
    return jnp.zeros((experts, cap + 1, d), x.dtype).at[ids, row].add(copies)[:, :cap]


def _combine_group(out, ids, slot, kept, weights):
    """One group: expert outputs [E, cap, d] -> [s, d], weighted by the router (float32 sum)."""
    cap = out.shape[1]
    out = jnp.pad(out, ((0, 0), (0, 1), (0, 0)))          # the spare row: zeros for dropped copies
    picked = out[ids, jnp.where(kept, slot, cap)]         # [s, k, d]
    w = jnp.where(kept, weights, 0.0).astype(jnp.float32)
    return jnp.einsum("skd,sk->sd", picked.astype(jnp.float32), w)


_dispatch = jax.vmap(_dispatch_group, in_axes=(0, 0, 0, 0, None, None))
_combine = jax.vmap(_combine_group)


# ---- the kernels ---------------------------------------------------------------------------------

def local_moe(x, ids, weights, experts, *, capacity: int, context_axes: tuple[str, ...] = (),
              scaling: ExpertRows = ExpertRows()):
    """Every expert on this device (or XLA-partitioned on the global view; `experts`: w_gate, w_up,
    w_down): dispatch, FFN, combine."""
    w_gate, w_up, w_down = experts
    experts = w_gate.shape[0]
    cap = min(x.shape[1], capacity)
    slot, kept = queue_slots(ids, experts, capacity, context_axes)
    buffers = _dispatch(x, ids, slot, kept, experts, cap)                  # [g, E, cap, d]
    out = expert_ffn(buffers, w_gate, w_up, w_down, scaling)
    return _combine(out, ids, slot, kept, weights).astype(x.dtype), kept


@dataclasses.dataclass(frozen=True)
class ExpertKernel:
    """How the routed experts compute: `name` (the strategy option moe_kernel: grouped | padded) and the
    float8 recipe of their GEMMs (`fp8`, jaxpar/ops/fp8.py; None: none)."""
    name: str = "grouped"
    fp8: Recipe | None = None


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one shard's dispatch needs (`_local`, `_expert_parallel_shard`): the experts in all, the
    per-sequence capacity, `n` shards over the mesh axes `expert_axes`, the sequence's and the expert width's
    axes, the kernel, the grouped kernel's transfer (`ragged`) and matmul form (`dense`), and under float8
    how its rows are scaled (`scaling`)."""
    experts: int
    capacity: int
    n: int
    expert_axes: object
    context_axes: tuple[str, ...]
    tensor_axes: tuple[str, ...]
    kernel: str
    ragged: bool = False
    dense: bool = False
    scaling: ExpertRows = ExpertRows()


def _local(x, ids, weights, experts, plan: Shard):
    """y, kept with every expert here (`experts`: w_gate, w_up, w_down), by the plan's kernel (padded:
    `local_moe`; grouped: jaxpar/ops/moe_grouped.py), under float8 its rows scaled by `plan.scaling`."""
    if plan.kernel == "padded":
        return local_moe(x, ids, weights, experts, capacity=plan.capacity, context_axes=plan.context_axes,
                         scaling=plan.scaling)
    _, kept = queue_slots(ids, experts[0].shape[0], plan.capacity, plan.context_axes)
    return local_grouped(x, ids, kept, weights, experts, plan.dense, plan.scaling).astype(x.dtype), kept


def _expert_parallel_shard(x, ids, weights, weights_of_experts, plan: Shard):
    """One shard: its tokens' copies out to the experts' owners and back (padded: two all_to_alls of
    the dispatch buffers; grouped: the counts, then the routed copies, jaxpar/ops/moe_grouped.py)."""
    w_gate, w_up, w_down = weights_of_experts
    experts, capacity, n, expert_axes = plan.experts, plan.capacity, plan.n, plan.expert_axes
    context_axes, tensor_axes, kernel = plan.context_axes, plan.tensor_axes, plan.kernel
    g, s, d = x.shape
    cap = min(s, capacity)
    x = _varying(x, tensor_axes)
    slot, kept = queue_slots(ids, experts, capacity, context_axes)
    if kernel == "grouped":
        bucket = bucket_rows(g, s, ids.shape[-1], experts, n, cap)
        y = expert_parallel_grouped(x, ids, kept, weights, weights_of_experts,
                                    Route(n, expert_axes, bucket, plan.ragged, plan.dense, plan.scaling)
                                    ).astype(x.dtype)
    else:
        buffers = _dispatch(x, ids, slot, kept, experts, cap)              # [g, E, cap, d]
        send = jnp.swapaxes(buffers, 0, 1).reshape(n, experts // n, g * cap, d)
        received = jax.lax.all_to_all(send, expert_axes, 0, 0, tiled=True)    # [source, E/n, g*cap, d]
        out = expert_ffn(received, w_gate, w_up, w_down, plan.scaling)     # partial over `tensor`
        back = jax.lax.all_to_all(out, expert_axes, 0, 0, tiled=True)     # [owner, E/n, g*cap, d]
        back = jnp.swapaxes(back.reshape(experts, g, cap, d), 0, 1)
        y = _combine(back, ids, slot, kept, weights).astype(x.dtype)
    if tensor_axes:
        y = jax.lax.psum(y, tensor_axes)
    return y, kept


def moe_experts(x, ids, weights, w_gate, w_up, w_down, *, capacity_factor: float = 0.0,
                kernel: ExpertKernel = ExpertKernel()):
    """y, kept for tokens x [g, s, d] (see the module docstring), on the layout in force, by `kernel`
    (the strategy option moe_kernel: grouped | padded; under float8 its recipe scales the experts' GEMMs,
    jaxpar/ops/fp8.py: the weights quantized here, as global arrays, the rows in the kernels).

    No layout, or for the padded kernel one with no `experts`, `seq` or `mlp` axes: the local kernel on
    the global view (XLA partitions it over the batch). A sequence split over `context` runs per shard
    in shard_map (its queue needs the other shards' counts), and so does an expert width split over
    `tensor` (the shard sums its output after the combine; XLA's partitioner would sum the E-times-larger
    buffers), and the grouped kernel under any layout (its sort of the copies by expert is a shard's
    own: on the global view XLA would sort across the batch shards). `experts` axes > 1: expert
    parallelism in shard_map.
    """
    experts, k = w_gate.shape[0], ids.shape[-1]
    capacity = group_capacity(x.shape[1], k, experts, capacity_factor)
    w_gate, w_up, w_down = (expert_weights(w, kernel.fp8) for w in (w_gate, w_up, w_down))
    layout = current_layout()
    if layout is None or (kernel.name == "padded" and layout.size("experts") == 1 and layout.size("seq") == 1
                          and layout.size("mlp") == 1):
        here = Shard(experts, capacity, 1, None, (), (), kernel.name, scaling=ExpertRows(kernel.fp8))
        return _local(x, ids, weights, (w_gate, w_up, w_down), here)
    n = layout.size("experts")
    validate.check_expert_parallel(experts, n)
    expert_axes, batch_axes, seq_axes = layout.axes("experts"), layout.axes("batch"), layout.axes("seq")
    tensor_axes = layout.axes("mlp")
    tokens = P(spec_entry(batch_axes), spec_entry(seq_axes))
    w_in = P(spec_entry(expert_axes), None, spec_entry(tensor_axes))
    w_out = P(spec_entry(expert_axes), spec_entry(tensor_axes))
    platform = layout.mesh.devices.flat[0].platform
    dense = getattr(layout, "in_vmap", False) and not ragged_dot_nests(platform)
    plan = Shard(experts, capacity, n, spec_entry(expert_axes), seq_axes, tensor_axes, kernel.name,
                 ragged_all_to_all_runs(platform), dense, ExpertRows(kernel.fp8, tensor_axes))
    if n == 1:
        def shard(x, ids, weights, w_gate, w_up, w_down):
            y, kept = _local(_varying(x, tensor_axes), ids, weights, (w_gate, w_up, w_down), plan)
            return (jax.lax.psum(y, tensor_axes) if tensor_axes else y), kept
    else:
        def shard(x, ids, weights, w_gate, w_up, w_down):
            return _expert_parallel_shard(x, ids, weights, (w_gate, w_up, w_down), plan)
    call = jax.shard_map(shard, mesh=layout.mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
                         out_specs=(tokens, tokens), check_vma=not getattr(layout, "in_vmap", False))
    return jax.checkpoint(call, policy=_save_all_but_weight_copies)(x, ids, weights, w_gate, w_up, w_down)


def _save_all_but_weight_copies(prim, *_, **__) -> bool:
    """The kernel's checkpoint policy: every residual saved except the experts' weights as the shard's
    matmuls read them (their `pvary` copies, varying over the token axes), which the backward pass takes
    again from the stored weights: under ZeRO-3 (jaxpar.core.rules.zero3_axes) those arrive gathered at
    the shard_map's boundary, and saved they would keep every layer's gathered experts until the backward
    pass; recomputed, the backward gathers each layer's again (one all-gather per weight, as FSDP does)."""
    return prim.name != "pvary"


def _varying(x: jax.Array, tensor_axes: tuple[str, ...]) -> jax.Array:
    """The tokens, marked as varying over `tensor` where the experts' width is split: the backward
    all-reduce over `tensor` then sums the tokens' gradient [g, s, d] (a column-parallel layer's
    input gradient), not that of the E-times-larger dispatch buffers."""
    return jax.lax.pcast(x, tensor_axes, to="varying") if tensor_axes else x
