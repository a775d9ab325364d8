"""Grouped expert matmuls: each expert computes only the token copies routed to it (the strategy option
`moe_kernel = grouped`; jaxpar/ops/moe.py holds the queue, the layouts and the `padded` kernel).

    copies   a shard's N = g*s*k (token, choice) pairs, each with its expert ids[..., j] and kept[..., j]
             (moe.queue_slots: both kernels keep and drop the same copies)
    sort     the kept copies by expert, stably (token order within an expert), the dropped ones last
    FFN      SwiGLU as three `jax.lax.ragged_dot`s with the kept copies per expert as group sizes
    unsort   each copy's output back to its (token, choice): y = sum_j weights * kept * out (float32)

`jax.lax.ragged_dot` is one grouped matmul over the experts' contiguous row blocks on GPU and TPU (as
Megatron-Core's grouped GEMM and MaxText's megablox / ragged dot compute the routed copies only). XLA:CPU
expands it to a dense masked product over every expert (E x the routed FLOPs in its cost analysis): the
same code runs there for correctness, not for speed.

Expert parallelism (inside moe.py's shard_map; the `expert` axes of size n, E/n experts per shard):
    counts    each shard's kept copies per expert [E], all-gathered over `expert` -> [n, E]: every shard
              knows what it receives from whom and where its rows land (the counts travel first);
    dispatch  the sorted copies for owner j (experts [j*E/n, (j+1)*E/n)) are contiguous: they go to j,
              which holds them as [n sources, B, d], source i's rows at i*B, sorted by expert;
    compute   the owner sorts what it received by its local expert and applies its experts (ragged_dot);
              under `tensor` each rank's output is a partial sum, reduced after the combine (moe.py);
    return    the outputs travel back the same way; the copy at sorted position p of the rows for
              owner j comes back at row p - start_j.
The transfer is `jax.lax.ragged_all_to_all` (only the routed rows travel) where the backend implements it,
else one fixed-capacity all_to_all of B rows per (source, owner) pair, B = capacity.bucket_rows: the
exact worst case, so nothing the queue keeps is dropped (xla_workarounds.ragged_all_to_all_runs says
which). Both forms leave the owner the same [n*B, d] layout; autodiff transposes either one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.ops.fp8 import ExpertRows


def grouped_ffn(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                sizes: jax.Array, dense: bool = False, rows: ExpertRows = ExpertRows()) -> jax.Array:
    """SwiGLU of rows xs [R, d] sorted by expert, sizes[e] rows for expert e (w [E, d, f], [E, f, d]);
    rows past sum(sizes) come out as zeros on CPU and are masked by the callers everywhere.

    JAX 0.12 batches ragged_dot only when all three operands carry the vmapped dim ("ragged_dot vmap
    over any dim but 0 - NYI"), and inside the pipeline's vmaps over stages and weight copies some do
    not: every operand is tied to the others by an integer zero read from them (`_tie`), so under a vmap
    all are batched alike, and outside one the zero is a constant XLA folds away. `dense`: the products
    as `masked_dot` (XLA:CPU inside nested vmaps: xla_workarounds.ragged_dot_nests)."""
    dot = masked_dot if dense else jax.lax.ragged_dot
    zero = _tie(xs, w_gate, w_up, w_down, sizes)
    xs, sizes = xs + zero.astype(xs.dtype), sizes + zero
    w_gate, w_up, w_down = (w + zero.astype(w.dtype) for w in (w_gate, w_up, w_down))
    xs = rows.inputs(xs)                        # float8 (`rows`, jaxpar/ops/fp8.py): rows scaled as read
    gate = rows.gradient(dot(xs, w_gate, sizes), hidden=True)
    up = rows.gradient(dot(xs, w_up, sizes), hidden=True)
    return rows.gradient(dot(rows.inputs(jax.nn.silu(gate) * up, hidden=True), w_down, sizes))


def masked_dot(xs: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """ragged_dot's definition as one dense product: row r times w[e] for the group e that holds r (rows
    past sum(sizes): zeros), every row through every expert, masked: what XLA:CPU expands ragged_dot into."""
    ends = jnp.cumsum(sizes)
    row = jnp.arange(xs.shape[0])
    mask = (row[None] >= (ends - sizes)[:, None]) & (row[None] < ends[:, None])          # [E, R]
    return jnp.einsum("er,erf->rf", mask.astype(xs.dtype), jnp.einsum("rd,edf->erf", xs, w))


def _tie(*arrays: jax.Array) -> jax.Array:
    """int32 zero that depends on the first element of each array (no gradient flows through it)."""
    zero = jnp.int32(0)
    for a in arrays:
        first = jax.lax.stop_gradient(a.reshape(-1)[0])
        bits = first if first.dtype == jnp.int32 else jax.lax.bitcast_convert_type(first.astype(jnp.float32),
                                                                                   jnp.int32)
        zero = zero + (bits & 0)
    return zero


def _by_expert(expert: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, sizes): the stable sort of rows by expert id (`experts` marks a row that goes nowhere:
    sorted last) and the rows per expert [experts] (int32)."""
    order = jnp.argsort(expert, stable=True)
    sizes = jax.ops.segment_sum(jnp.ones_like(expert), expert, num_segments=experts)
    return order, sizes.astype(jnp.int32)


def _unsort(values: jax.Array, order: jax.Array) -> jax.Array:
    """values in sorted order -> in the order before the sort (`order` a permutation)."""
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return values[inverse]


def _combine(out: jax.Array, kept: jax.Array, weights: jax.Array) -> jax.Array:
    """Copy outputs in (token, choice) order [g*s*k, d] -> y [g, s, d], weighted by the router (float32)."""
    g, s, k = kept.shape
    out = jnp.where(kept[..., None], out.reshape(g, s, k, -1), 0).astype(jnp.float32)
    return jnp.einsum("gskd,gsk->gsd", out, jnp.where(kept, weights, 0.0).astype(jnp.float32))


def _sorted_copies(x, ids, kept, experts: int):
    """(rows [N, d] of the kept copies sorted by expert, order, kept copies per expert [E], each sorted
    row's expert id: `experts` for a dropped copy)."""
    g, s, d = x.shape
    k = ids.shape[-1]
    expert = jnp.where(kept, ids, experts).reshape(-1)
    order, sizes = _by_expert(expert, experts)
    return x.reshape(g * s, d)[order // k], order, sizes, expert[order]


def local_grouped(x, ids, kept, weights, experts, dense: bool = False, scaling: ExpertRows = ExpertRows()) -> jax.Array:
    """y [g, s, d] (float32) with every expert here (`experts`: w_gate, w_up, w_down): x [g, s, d],
    ids / kept / weights [g, s, k]."""
    w_gate, w_up, w_down = experts
    rows, order, sizes, _ = _sorted_copies(x, ids, kept, w_gate.shape[0])
    return _combine(_unsort(grouped_ffn(rows, w_gate, w_up, w_down, sizes, dense, scaling), order), kept, weights)


@dataclasses.dataclass(frozen=True)
class Route:
    """How one shard's copies travel under expert parallelism: over `n` shards of mesh `axis`, in buckets of
    `bucket` rows, by a ragged all-to-all (`ragged`) or fixed-capacity ones; `dense`: the matmuls as the
    dense masked product (jaxpar.xla_workarounds.ragged_dot_nests)."""
    n: int
    axis: object
    bucket: int
    ragged: bool
    dense: bool = False
    scaling: ExpertRows = ExpertRows()   # float8 rows (jaxpar/ops/fp8.py)


def expert_parallel_grouped(x, ids, kept, weights, experts, route: Route) -> jax.Array:
    """One shard of expert parallelism (module docstring): its tokens' kept copies to their experts' owners
    and back; `experts` (w_gate, w_up, w_down) hold this shard's E/n experts. y [g, s, d] (float32; partial
    under `tensor`)."""
    w_gate, w_up, w_down = experts
    n, axis, bucket, ragged, dense = route.n, route.axis, route.bucket, route.ragged, route.dense
    per = w_gate.shape[0]
    rows, order, sizes, expert = _sorted_copies(x, ids, kept, per * n)
    counts = jax.lax.all_gather(sizes, axis).reshape(n, n, per)     # [source, owner, local expert]
    me = jax.lax.axis_index(axis)
    move = _ragged_moves if ragged else _bucketed_moves
    there, back = move(counts, me, n, bucket, axis)
    received = there(rows)                                           # [n*B, d]: source i's rows at i*B
    mine = counts[:, me]                                             # [source, local expert]
    bounds = jnp.cumsum(mine, axis=1)
    local = jnp.sum(jnp.arange(bucket)[None, :, None] >= bounds[:, None, :], axis=-1).reshape(-1)
    order_here, sizes_here = _by_expert(local, per)                  # padding rows: local id `per`, last
    out = _unsort(grouped_ffn(received[order_here], w_gate, w_up, w_down, sizes_here, dense, route.scaling),
                  order_here)
    returned = back(out, expert // per, rows.shape[0])               # [N, d] in this shard's sorted order
    return _combine(_unsort(returned, order), kept, weights)


def _starts(sent: jax.Array) -> jax.Array:
    """Exclusive prefix sums along the last axis: where each owner's rows begin in a sorted array."""
    return jnp.cumsum(sent, axis=-1) - sent


def _bucketed_moves(counts, me, n: int, bucket: int, axis):
    """(there, back) as fixed-capacity all_to_alls: owner j gets B rows from every source, the first
    sent[j] of them this shard's copies for j, the rest zeros."""
    sent = counts[me].sum(-1)                                        # [owner]
    start = _starts(sent)
    row = jnp.arange(bucket)

    def there(rows):
        index = jnp.minimum(start[:, None] + row[None], rows.shape[0] - 1)
        send = jnp.where((row[None] < sent[:, None])[..., None], rows[index], 0)     # [owner, B, d]
        return jax.lax.all_to_all(send, axis, 0, 0, tiled=True).reshape(n * bucket, -1)

    def back(out, owner, total):
        returned = jax.lax.all_to_all(out.reshape(n, bucket, -1), axis, 0, 0, tiled=True)  # [owner, B, d]
        owner = jnp.minimum(owner, n - 1)                           # a dropped copy: any row (masked)
        at = jnp.clip(jnp.arange(total) - start[owner], 0, bucket - 1)
        return returned[owner, at]

    return there, back


def _ragged_moves(counts, me, n: int, bucket: int, axis):
    """(there, back) as ragged_all_to_alls: only the routed rows travel; source i's rows land at i*B of
    the owner's buffer and come back to where they were in the source's sorted array."""
    totals = counts.sum(-1)                                          # [source, owner] rows
    sent, received = totals[me], totals[:, me]
    offsets = _starts(totals)                                        # [source, owner] start in the source

    def there(rows):
        output = jnp.zeros((n * bucket, rows.shape[1]), rows.dtype)
        lands = jnp.full((n,), me * bucket, jnp.int32)
        return jax.lax.ragged_all_to_all(rows, output, offsets[me], sent, lands, received, axis_name=axis)

    def back(out, owner, total):
        output = jnp.zeros((total, out.shape[1]), out.dtype)
        return jax.lax.ragged_all_to_all(out, output, jnp.arange(n, dtype=jnp.int32) * bucket, received,
                                         offsets[:, me], sent, axis_name=axis)

    return there, back
