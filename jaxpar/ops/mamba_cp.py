"""Context parallelism for the Mamba-2 block: the sequence is split over the `seq` mesh axes.

Two things cross shard boundaries, both of a size independent of the sequence length:

* the causal conv's halo: the last d_conv-1 tokens of the previous piece of the sequence, moved
  with `ppermute` (the first shard's halo is the zeros of the sequence start);
* the SSD state. Each shard runs SSD on its piece from a zero state, giving its final state S_j
  and its total log-decay a_j = sum(dt A) per head. These are all-gathered (packed into one
  buffer: one all-gather forward, one reduce-scatter backward), and each piece's true initial
  state is the exclusive combine

      h0_i = sum_{j<i} exp(a_{j+1} + ... + a_{i-1}) S_j

  (a segment-sum with the mask inside the exponent, so unused terms are exp(-inf) = 0 and carry no
  inf/NaN gradients). SSD being linear in its initial state, the shard's output is then corrected
  by C_t exp(sum_{k<=t} dt_k A) h0_i (`jaxpar.ops.ssd.initial_state_output`).

Token layouts (the strategy's `cp_layout`): contiguous gives shard i the i-th of n pieces; zigzag
cuts the sequence into 2n pieces and gives shard i pieces i and 2n-1-i (first and second half of its
local tokens), so each shard holds two segments and the halo of piece 2n-1-i comes from shard i+1.

Heads/groups may be sharded over `tensor` and the batch over the data axes at the same time: every
mesh axis is manual inside the kernels (axes a spec does not name see replicated values), nothing
crosses the batch or head axes, and the kernels also run under the pipeline's
`vmap(spmd_axis_name=pipeline)`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core.sharding import Layout, current_layout, spec_for
from jaxpar.ops.ssd import causal_conv, initial_state_output, segsum, ssd

HEADS = ("batch", "seq", "ssm_heads", None)
GROUPS = ("batch", "seq", "ssm_groups", None)


def context_size(layout: Layout | None) -> int:
    """How many shards the sequence is split over (1 outside a layout)."""
    return 1 if layout is None else layout.size("seq")


def _spec(layout: Layout, names) -> P:
    return spec_for(names, layout.rules("activations"), layout.mesh)


def _checked(layout: Layout) -> bool:
    """shard_map's replication check, off inside a pipeline's vmaps over stages (a layout with `in_vmap`,
    jaxpar/pipeline/stages.py), whose batched mesh axes it cannot follow yet (as jaxpar/ops/moe.py)."""
    return not getattr(layout, "in_vmap", False)


def _segments(layout: Layout) -> int:
    """Contiguous pieces of the sequence each shard holds (1 contiguous, 2 zigzag)."""
    return 2 if layout.strategy.options.cp_layout == "zigzag" else 1


def _segment_order(n: int, m: int) -> np.ndarray:
    """order[s] = shard * m + j: where global segment s lives in the gathered [shard, j] list."""
    if m == 1:
        return np.arange(n)
    return np.array([s * 2 if s < n else (2 * n - 1 - s) * 2 + 1 for s in range(2 * n)])


def _split(t: jax.Array, m: int) -> jax.Array:
    """[b, m*L, ...] -> [b*m, L, ...]: the local segments become batch rows."""
    return t.reshape((t.shape[0] * m, t.shape[1] // m) + t.shape[2:])


def _merge(t: jax.Array, m: int) -> jax.Array:
    return t.reshape((t.shape[0] // m, t.shape[1] * m) + t.shape[2:])


# ---- the causal conv with a halo exchange --------------------------------------------------------

def causal_conv_cp(inputs, layout: Layout):
    """Depthwise causal convs of several activations under context parallelism, their halos packed
    into one ppermute (two under zigzag: one from each neighbour). `inputs`: [(u [b, l, c, d],
    w [K, c, d], bias [c, d], names)] with names HEADS or GROUPS; returns the conv outputs (before
    the activation), sharded like the inputs."""
    seq_axes = layout.axes("seq")
    n, m = layout.size("seq"), _segments(layout)
    k = inputs[0][1].shape[0]
    specs = [(_spec(layout, names), _spec(layout, (None,) + names[2:]), _spec(layout, names[2:]))
             for _, _, _, names in inputs]
    out_specs = tuple(s[0] for s in specs)
    flat_specs = tuple(s for triple in specs for s in triple)
    args = tuple(a for u, w, b, _ in inputs for a in (u, w, b))

    def body(*args):
        us, ws, bs = args[0::3], args[1::3], args[2::3]
        if k == 1:
            return tuple(causal_conv(u, w, b) for u, w, b in zip(us, ws, bs))
        # tails of every local segment, packed into one buffer: [b, m, K-1, sum of channel sizes]
        segs = [_split(u, m) for u in us]
        width = [int(np.prod(u.shape[2:])) for u in us]
        tails = jnp.concatenate([s[:, -(k - 1):].reshape(s.shape[0] // m, m, k - 1, -1) for s in segs],
                                axis=-1)
        # segment 0 of shard i follows segment 0 of shard i-1
        halo0 = jax.lax.ppermute(tails[:, 0], seq_axes, [(i, i + 1) for i in range(n - 1)])
        if m == 1:
            halo = halo0[:, None]
        else:  # zigzag: piece 2n-1-i follows piece 2n-2-i (shard i+1's second half, or my own first half)
            from_next = jax.lax.ppermute(tails[:, 1], seq_axes, [(i + 1, i) for i in range(n - 1)])
            last = jax.lax.axis_index(seq_axes) == n - 1
            halo = jnp.stack([halo0, jnp.where(last, tails[:, 0], from_next)], axis=1)
        halo = halo.reshape((-1, k - 1, halo.shape[-1]))                    # [b*m, K-1, channels]
        outs, start = [], 0
        for s, w, b, wd in zip(segs, ws, bs, width):
            h = halo[..., start:start + wd].reshape(s.shape[:1] + (k - 1,) + s.shape[2:])
            outs.append(_merge(causal_conv(s, w, b, halo=h), m))
            start += wd
        return tuple(outs)

    fn = jax.shard_map(body, mesh=layout.mesh, in_specs=flat_specs, out_specs=out_specs, check_vma=_checked(layout))
    return fn(*args)


# ---- SSD with state passing ----------------------------------------------------------------------

def ssd_cp(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, chunk: int,
           layout: Layout, *, with_state: bool = False):
    """`jaxpar.ops.ssd.ssd` with the sequence sharded over the layout's `seq` axes: its outputs, or
    (outputs, final state [b, h, p, n] float32) with `with_state` (a context-parallel prefill fills
    the decode cache with it: jaxpar/models/decode.py). The final state is the same combine one
    segment past the last, h_S = sum_j exp(a_{j+1} + ... + a_{S-1}) S_j, identical on every shard."""
    seq_axes = layout.axes("seq")
    n, m = layout.size("seq"), _segments(layout)
    order = _segment_order(n, m)
    in_specs = (_spec(layout, HEADS), _spec(layout, HEADS[:3]), _spec(layout, ("ssm_heads",)),
                _spec(layout, GROUPS), _spec(layout, GROUPS))
    out_spec = _spec(layout, HEADS)
    # the final state leaves the shard_map stacked over the seq shards (every copy equal)
    state_spec = P(seq_axes if len(seq_axes) > 1 else seq_axes[0], *_spec(layout, ("batch", "ssm_heads")))

    def body(x, dt, A, B, C):
        x, dt, B, C = (_split(t, m) for t in (x, dt, B, C))
        y, final = ssd(x, dt, A, B, C, chunk)                               # from a zero state
        bm, h, p, ns = final.shape
        log_decay = jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1)   # [b*m, h]
        # every segment's final state and decay (packed: one all-gather), in global segment order
        packed = jnp.concatenate([final.reshape(bm, h, p * ns), log_decay[..., None]], axis=-1)
        packed = jax.lax.all_gather(packed.reshape(bm // m, m, h, p * ns + 1), seq_axes)   # [n, b, m, h, .]
        packed = packed.transpose(1, 3, 0, 2, 4).reshape(bm // m, h, n * m, p * ns + 1)[:, :, order]
        finals = packed[..., :-1].reshape(bm // m, h, n * m, p, ns)                       # [b, h, S, p, N]
        decays = packed[..., -1]                                                           # [b, h, S]
        # weights[t, s] = exp(a_{s+1} + ... + a_{t-1}) for s < t: row t-1 of segsum, row -1 all -inf
        seg = segsum(decays)                                                 # [b, h, S, S]
        seg = jnp.concatenate([jnp.full(seg.shape[:2] + (1, n * m), -jnp.inf, seg.dtype), seg], axis=2)
        me = jax.lax.axis_index(seq_axes)
        mine = me[None] if m == 1 else jnp.stack([me, 2 * n - 1 - me])      # my segments' ids
        weights = jnp.exp(jnp.take(seg, mine, axis=2))                       # [b, h, m, S]
        h0 = jnp.einsum("bhjs,bhspn->bjhpn", weights, finals).reshape(bm, h, p, ns)
        y = y.astype(jnp.float32) + initial_state_output(C, dt, A, h0)
        if not with_state:
            return _merge(y.astype(x.dtype), m)
        last = jnp.exp(seg[:, :, -1])                                        # row S: after every segment
        return _merge(y.astype(x.dtype), m), jnp.einsum("bhs,bhspn->bhpn", last, finals)[None]

    fn = jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs,
                       out_specs=(out_spec, state_spec) if with_state else out_spec, check_vma=_checked(layout))
    if not with_state:
        return fn(x, dt, A, B, C)
    y, states = fn(x, dt, A, B, C)
    return y, states[-1]


@dataclasses.dataclass(frozen=True)
class SSMKernels:
    """Mamba-2's causal conv and SSD as the strategy runs them, chosen once: chunked on each device, or
    (`context`) with the sequence split over the layout's `seq` axes (`causal_conv_cp`, `ssd_cp`) wherever
    the layout in force splits it."""
    context: bool = False

    def _layout(self) -> Layout | None:
        layout = current_layout() if self.context else None
        return layout if context_size(layout) > 1 else None

    def conv(self, convs) -> tuple[jax.Array, ...]:
        """Each (u, w, bias, names) of `convs` through its depthwise causal conv."""
        layout = self._layout()
        if layout is not None:
            return causal_conv_cp(convs, layout)
        return tuple(causal_conv(u, w, b) for u, w, b, _ in convs)

    def ssd(self, x, dt, A, B, C, chunk: int) -> jax.Array:
        """The SSD scan's output y (jaxpar.ops.ssd.ssd, from a zero state)."""
        layout = self._layout()
        return ssd_cp(x, dt, A, B, C, chunk, layout) if layout is not None else ssd(x, dt, A, B, C, chunk)[0]
