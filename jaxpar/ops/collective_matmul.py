"""Collective matmul: tensor parallelism's all-gather and reduce-scatter, cut into ring steps that overlap with
the matmuls they feed (Wang et al. 2023, ASPLOS; the shard_map notebook's and the scaling book's loop).

Under tensor + sequence parallelism a column-parallel projection is y = all_gather(x) @ W and a
row-parallel one z = reduce_scatter(h @ V). `column_parallel` runs the gather as n-1 `ppermute`s of the
sequence chunks, each step's dot beside the next chunk's permute (and keeps the gathered x for the
weight's gradient); `row_parallel` accumulates partial sums around the ring, each hop beside a dot.
Bidirectional rings move half a chunk each way per step. The backward is a custom VJP: each ring's input
gradient is the other ring, and a weight's gradient one dot with the gathered activation (autodiff would
give n partial ones, which XLA:CPU all-reduces one by one). Both run in `jax.shard_map` manual over the
residual stream's sequence axes (`res_seq`); with no layout or no ring they are plain matmuls, so a model
may call them unconditionally. docs/kernels.md has the steps at length; tests/test_collective_matmul.py
reads the compiled step: no all-gather or reduce-scatter over `tensor` left in the layer loop.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core.sharding import Layout, current_layout
from jaxpar.core.rules import spec_entry
from jaxpar.ops.fp8 import Recipe, gathered_input, project
from jaxpar.xla_workarounds import gathered


def _perm(n: int, shift: int) -> list[tuple[int, int]]:
    """Every device sends to the one `shift` places along the ring."""
    return [(i, (i + shift) % n) for i in range(n)]


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [b, c, *k] . w [*k, *out] -> [b, c, *out] (contract x's trailing dims with w's leading ones)."""
    k = x.ndim - 2
    return jnp.tensordot(x, w, axes=(tuple(range(2, 2 + k)), tuple(range(k))))


def _put(out: jax.Array, piece: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(out, piece, start, axis=1)


def _take(h: jax.Array, start, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(h, start, rows, axis=1)


# ---- the rings (inside shard_map, `axis` the ring) ------------------------------------------------

def _gather_ring(x, weights, axis, n: int, bidirectional: bool):
    """x [b, c, d] (this device's chunk of the sequence), weights ([d, *out], ...) -> ((y [b, n*c, *out]
    for each weight), x_all [b, n*c, d]): the all-gathered x times each weight, in n-1 ring steps (one
    ring for all the weights, e.g. q, k and v), and the gathered x, assembled from the chunks that
    went past (the weights' gradients read it)."""
    i = jax.lax.axis_index(axis)
    b, c = x.shape[:2]
    outs = [jnp.zeros((b, n * c) + w.shape[1:], jnp.result_type(x, w)) for w in weights]
    x_all = jnp.zeros((b, n * c) + x.shape[2:], x.dtype)
    if bidirectional:   # first halves travel right, second halves left
        pieces, shifts, half = [x[:, :c // 2], x[:, c // 2:]], (1, -1), c // 2
    else:
        pieces, shifts, half = [x], (1,), 0
    for k in range(n):
        # the permutes for step k+1 read what step k's dots read: XLA may run them side by side
        nxt = [jax.lax.ppermute(p, axis, _perm(n, s)) for p, s in zip(pieces, shifts)] if k < n - 1 else None
        for p, s, offset in zip(pieces, shifts, (0, half)):
            start = ((i - s * k) % n) * c + offset   # the chunk that left device i - s*k k steps ago
            outs = [_put(o, _dot(p, w), start) for o, w in zip(outs, weights)]
            x_all = _put(x_all, p, start)
        pieces = nxt
    return tuple(outs), x_all


def _scatter_ring(pairs, axis, n: int, bidirectional: bool):
    """pairs ((h [b, n*c, *k], w [*k, d]), ...) -> z [b, c, d]: this device's chunk of the sum over the
    ring (and the pairs) of h @ w, in n-1 ring steps of partial sums."""
    i = jax.lax.axis_index(axis)
    c = pairs[0][0].shape[1] // n
    rows = c // 2 if bidirectional else c

    def part(chunk, offset):   # this device's contribution to `chunk`'s rows [offset, offset + rows)
        start = (chunk % n) * c + offset
        return sum(_dot(_take(h, start, rows), w) for h, w in pairs)

    # an accumulator that moves `s` places a step is on device i at the last step when it started on
    # device i + s (1 - n): it holds chunk (i - s*k - s) at step k, and chunk i at step n - 1
    shifts = ((1, 0), (-1, rows)) if bidirectional else ((1, 0),)
    accs = [part(i - s, offset) for s, offset in shifts]
    for k in range(1, n):
        accs = [jax.lax.ppermute(acc, axis, _perm(n, s)) + part(i - s * k - s, offset)
                for acc, (s, offset) in zip(accs, shifts)]
    return jnp.concatenate(accs, axis=1) if bidirectional else accs[0]


def _transpose(w: jax.Array, inputs: int) -> jax.Array:
    """w [*in, *out] with `inputs` leading dims -> [*out, *in]."""
    return jnp.transpose(w, tuple(range(inputs, w.ndim)) + tuple(range(inputs)))


# ---- per-shard kernels, forward and backward ------------------------------------------------------
#
# Autodiff of the rings would already be a ring (a ppermute's transpose is a ppermute), but it
# differentiates each chunk's dot by itself: a weight's gradient becomes n partial dots, and XLA sums
# each over the batch axes (all-reduces over data) before adding them, n times the bytes. The
# backward passes below are written out instead: the input gradient is the other ring (an all-gather
# matmul's is a reduce-scatter ring of dy @ W^T, a reduce-scatter matmul's an all-gather ring of
# dz @ V^T), and each weight's gradient is one dot with the gathered activation.

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def allgather_matmul_shard(x, weights, axis, n: int, bidirectional: bool = False):
    """x [b, c, d], weights ([d, *out], ...) -> (y [b, n*c, *out], ...): all_gather(x) @ w per weight."""
    return _gather_ring(x, weights, axis, n, bidirectional)[0]


def _allgather_matmul_fwd(x, weights, axis, n, bidirectional):
    outs, x_all = _gather_ring(x, weights, axis, n, bidirectional)
    return outs, (x_all, weights)


def _allgather_matmul_bwd(axis, n, bidirectional, res, dys):
    x_all, weights = res
    dx = _scatter_ring(tuple((dy, _transpose(w, 1)) for dy, w in zip(dys, weights)), axis, n, bidirectional)
    dws = tuple(jnp.tensordot(x_all, dy, axes=((0, 1), (0, 1))).astype(w.dtype) for dy, w in zip(dys, weights))
    return dx.astype(x_all.dtype), dws


allgather_matmul_shard.defvjp(_allgather_matmul_fwd, _allgather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_reducescatter_shard(h, w, axis, n: int, bidirectional: bool = False):
    """h [b, n*c, *k] (the contracted dims split over the ring), w [*k, d] -> z [b, c, d]: this
    device's chunk of psum(h @ w) over the ring."""
    return _scatter_ring(((h, w),), axis, n, bidirectional)


def _matmul_reducescatter_fwd(h, w, axis, n, bidirectional):
    return _scatter_ring(((h, w),), axis, n, bidirectional), (h, w)


def _matmul_reducescatter_bwd(axis, n, bidirectional, res, dz):
    h, w = res
    (dh,), dz_all = _gather_ring(dz, (_transpose(w, w.ndim - 1),), axis, n, bidirectional)
    dw = jnp.tensordot(h, dz_all, axes=((0, 1), (0, 1)))
    return dh.astype(h.dtype), dw.astype(w.dtype)


matmul_reducescatter_shard.defvjp(_matmul_reducescatter_fwd, _matmul_reducescatter_bwd)


# ---- global-view entry points --------------------------------------------------------------------

def ring_axes(layout: Layout | None) -> tuple[str, ...]:
    """The mesh axes the collective matmul's ring runs over: those the residual stream's sequence is
    split on beyond the sequence inside a block (`tensor` under sequence parallelism); () for none."""
    if layout is None:
        return ()
    inner = layout.axes("seq")
    return tuple(a for a in layout.axes("res_seq") if a not in inner)


def _ring_size(layout: Layout, ring: tuple[str, ...]) -> int:
    n = 1
    for a in ring:
        n *= layout.mesh.shape[a]
    return n


def column_parallel(x: jax.Array, weights, *, bidirectional: bool = False) -> tuple[jax.Array, ...]:
    """x [b, s, d] in the residual layout (sequence split over `res_seq`), weights ([d, *out], ...)
    column-parallel (their first output dim split over the ring) -> (x @ w for each weight), each
    [b, s, *out] with the sequence split over `seq` and the first output dim over the ring."""
    layout = current_layout()
    ring = ring_axes(layout)
    if not ring:
        return tuple(_dot(x, w) for w in weights)
    n, inner = _ring_size(layout, ring), layout.axes("seq")
    x_spec = P(None, spec_entry(inner + ring))
    w_specs = tuple(P(None, spec_entry(ring)) for _ in weights)
    y_specs = tuple(P(None, spec_entry(inner), spec_entry(ring)) for _ in weights)

    def shard(x, *weights):
        weights = tuple(jax.lax.pcast(w, inner, to="varying") for w in weights) if inner else weights
        return allgather_matmul_shard(x, weights, spec_entry(ring), n, bidirectional)

    return jax.shard_map(shard, mesh=layout.mesh, in_specs=(x_spec, *w_specs), out_specs=y_specs,
                         axis_names=set(inner + ring), check_vma=True)(x, *weights)


def row_parallel(h: jax.Array, w: jax.Array, *, bidirectional: bool = False) -> jax.Array:
    """h [b, s, *k] (sequence split over `seq`, the first contracted dim over the ring), w [*k, d]
    row-parallel -> h @ w [b, s, d] in the residual layout (sequence split over `res_seq`)."""
    layout = current_layout()
    ring = ring_axes(layout)
    if not ring:
        return _dot(h, w)
    n, inner = _ring_size(layout, ring), layout.axes("seq")

    def shard(h, w):
        w = jax.lax.pcast(w, inner, to="varying") if inner else w
        return matmul_reducescatter_shard(h, w, spec_entry(ring), n, bidirectional)

    h_spec = P(None, spec_entry(inner), spec_entry(ring))
    return jax.shard_map(shard, mesh=layout.mesh, in_specs=(h_spec, P(spec_entry(ring))),
                         out_specs=P(None, spec_entry(inner + ring)), axis_names=set(inner + ring),
                         check_vma=True)(h, w)


# ---- the projections' implementation, chosen once by the strategy's `overlap` ----------------------

GATHERED = ("batch", "seq", "act_embed")         # a block's normed input, gathered over the sequence
RING_INPUT = ("batch", "res_seq", "act_embed")    # ... left in the residual stream's layout for the rings


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """A weight read in its stored layout with its logical names, for a projection that gathers it itself
    (in float8: `Matmuls.fp8_gather`)."""
    array: jax.Array
    names: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """How a layer's projections run: plain dots, whose tensor-parallel collectives XLA's partitioner
    inserts (`PLAIN`), or the collective-matmul rings above (`rings`, `bidirectional`), which gather their
    input themselves (so it stays in the residual layout: `input_names`); as scaled float8 GEMMs when `fp8`
    names a recipe (jaxpar/ops/fp8.py; never with the rings), reading their weights through `weight`. The
    model calls `column` for the column-parallel projections that read one input (q, k, v; gate, up), `row`
    for a row-parallel one, and `project` for any other (latent attention's down- and up-projections)."""
    rings: bool = False
    bidirectional: bool = False
    fp8: Recipe | None = None
    fp8_gather: bool = False    # float8 weights quantized on their FSDP shards and gathered as float8
    recomputed: bool = False    # the layer unit is recomputed in the backward pass (remat "full", ...)
    fp8_sp_gather: bool = False  # the column-parallel input quantized on its sequence shards, gathered as float8

    @property
    def input_names(self) -> tuple[str, ...]:
        """The logical names a block's normed input takes before its column-parallel projections."""
        return RING_INPUT if self.rings or self.fp8_sp_gather else GATHERED

    def weight(self, w: jax.Array, names: tuple[str | None, ...], dtype) -> jax.Array | StoredWeight:
        """A projection's weight `w` (logical `names`) in `dtype` as the projections take it: cast, for the
        partitioner to gather; under `fp8_gather` stored, for the float8 GEMM to gather; a float8 GEMM's in a
        recomputed unit gathered once for the recomputed forward and the input gradient
        (jaxpar.xla_workarounds.gathered: each quantizes the gathered weight), not once per quantization."""
        if self.fp8_gather:
            return StoredWeight(w.astype(dtype), tuple(names))
        return gathered(w, names, dtype) if self.fp8 is not None and self.recomputed else w.astype(dtype)

    def project(self, x: jax.Array, w: jax.Array | StoredWeight, out_names: tuple | None = None,
                input_quantized: bool = False) -> jax.Array:
        """x times w, x's trailing dims contracted with w's leading ones: a plain or a scaled float8 dot (its
        output's gradient gathered to the activation names `out_names` first, where given; x read as it is
        where it arrives quantized)."""
        if self.fp8 is None:
            return _dot(x, w)
        if isinstance(w, StoredWeight):
            return project(x, w.array, self.fp8, w.names, out_names, input_quantized)
        return project(x, w, self.fp8, out_names=out_names, input_quantized=input_quantized)

    def column(self, x: jax.Array, weights) -> tuple[jax.Array, ...]:
        """x times each weight, its trailing dims contracted with each weight's leading ones; under
        `fp8_sp_gather` x arrives in the residual layout and is gathered once, quantized, for them all."""
        if self.rings:
            return column_parallel(x, weights, bidirectional=self.bidirectional)
        if self.fp8_sp_gather:
            x = gathered_input(x, GATHERED, RING_INPUT)
        return tuple(self.project(x, w, input_quantized=self.fp8_sp_gather) for w in weights)

    def row(self, h: jax.Array, w: jax.Array | StoredWeight) -> jax.Array:
        """h times w (h's trailing dims with w's leading ones), summed back onto the residual stream; under
        sequence parallelism its gradient arrives split over the sequence, gathered once (`GATHERED`)."""
        if self.rings:
            return row_parallel(h, w, bidirectional=self.bidirectional)
        return self.project(h, w, GATHERED)


PLAIN = Matmuls()
