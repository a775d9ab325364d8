"""Mamba-2's sequence mixer as pure functions: the causal depthwise conv and SSD.

SSD (Dao & Gu 2024, "Transformers are SSMs", section 7 and its minimal listing) computes, per head,
the selective state-space recurrence

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        (state [p, n])
    y_t = h_t C_t

with the sequence cut into chunks of Q tokens, in four terms:
    1. intra-chunk outputs: a masked "attention" (C B^T ∘ L) X within each chunk (diagonal blocks);
    2. each chunk's final state, from its own inputs only;
    3. the inter-chunk recurrence over those states (a segment-sum over chunks);
    4. the state entering each chunk, read out by C (off-diagonal blocks).

Shapes: x [b, l, h, p]; dt [b, l, h] (after softplus and bias); A [h] (negative); B, C [b, l, g, n]
with head i using group i // (h/g) (heads of a group are contiguous, so sharding heads and groups
over the same mesh axis keeps every head with its group). States are [b, h, p, n].
Everything is computed in float32 whatever the input dtype; y is returned in x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segsum(a: jax.Array) -> jax.Array:
    """[..., T] -> [..., T, T] with out[..., i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    The stable form: masked copies of `a` are summed (no difference of two cumulative sums), and
    the causal mask is applied *inside* the exponent its caller takes, so masked entries become
    exp(-inf) = 0 with zero (not NaN) gradients.
    """
    t = a.shape[-1]
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    x = jnp.where(i > j, a[..., :, None], 0.0)   # x[..., i, j] = a[i] where i > j
    x = jnp.cumsum(x, axis=-2)
    return jnp.where(i >= j, x, -jnp.inf)


def ssd(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, chunk: int,
        initial_state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Chunked SSD. Returns (y [b, l, h, p], final state [b, h, p, n] in float32).

    A length that is not a multiple of `chunk` is padded with dt = 0 (decay 1, no input: an
    identity step), so the padded tail changes neither the outputs kept nor the final state.
    """
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    out_dtype = x.dtype
    f32 = jnp.float32
    x, dt, A, B, C = (t.astype(f32) for t in (x, dt, A, B, C))
    q = min(chunk, l)
    pad = (-l) % q
    if pad:
        widths = lambda t: ((0, 0), (0, pad)) + ((0, 0),) * (t.ndim - 2)  # noqa: E731
        x, dt, B, C = (jnp.pad(t, widths(t)) for t in (x, dt, B, C))
    c = (l + pad) // q

    X = (x * dt[..., None]).reshape(b, c, q, g, r, p)                        # dt-scaled input
    a = (dt * A).reshape(b, c, q, g, r).transpose(0, 1, 3, 4, 2)             # [b, c, g, r, q]
    Bc, Cc = B.reshape(b, c, q, g, n), C.reshape(b, c, q, g, n)
    a_cs = jnp.cumsum(a, axis=-1)                                             # within each chunk

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) X_s
    scores = jnp.einsum("bclgn,bcsgn->bcgls", Cc, Bc)[:, :, :, None] * jnp.exp(segsum(a))
    y_diag = jnp.einsum("bcgrls,bcsgrp->bclgrp", scores, X)

    # 2. each chunk's final state from its own inputs: decay from token s to the chunk's end
    decay_to_end = jnp.exp(a_cs[..., -1:] - a_cs).transpose(0, 1, 4, 2, 3)   # [b, c, q, g, r]
    states = jnp.einsum("bclgn,bclgrp->bcgrpn", Bc, X * decay_to_end[..., None])

    # 3. inter-chunk recurrence: the state entering chunk z is sum_{c'<z} decay(c'->z) states[c']
    init = (jnp.zeros((b, g, r, p, n), f32) if initial_state is None
            else initial_state.astype(f32).reshape(b, g, r, p, n))
    states = jnp.concatenate([init[:, None], states], axis=1)               # [b, c+1, g, r, p, n]
    chunk_decay = jnp.pad(a_cs[..., -1].transpose(0, 2, 3, 1), ((0, 0), (0, 0), (0, 0), (1, 0)))
    carried = jnp.einsum("bgrzc,bcgrpn->bzgrpn", jnp.exp(segsum(chunk_decay)), states)
    states, final = carried[:, :-1], carried[:, -1]

    # 4. state -> output (off-diagonal blocks): C_l exp(a_1 + ... + a_l) h_in
    decay_in = jnp.exp(a_cs).transpose(0, 1, 4, 2, 3)                        # [b, c, q, g, r]
    y_off = jnp.einsum("bclgn,bcgrpn->bclgrp", Cc, states) * decay_in[..., None]

    y = (y_diag + y_off).reshape(b, c * q, h, p)[:, :l]
    return y.astype(out_dtype), final.reshape(b, h, p, n)


def initial_state_output(C: jax.Array, dt: jax.Array, A: jax.Array, h0: jax.Array) -> jax.Array:
    """What an initial state h0 [b, h, p, n] adds to SSD's output: y_t = exp(sum_{k<=t} dt_k A) C_t h0.

    SSD is linear in its initial state, so ssd(..., h0) = ssd(...) + this (float32, [b, l, h, p]).
    """
    b, l, h = dt.shape
    g, n = C.shape[-2:]
    r = h // g
    decay = jnp.exp(jnp.cumsum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1))   # [b, l, h]
    y = jnp.einsum("blgn,bgrpn->blgrp", C.astype(jnp.float32), h0.astype(jnp.float32).reshape(b, g, r, -1, n))
    return y.reshape(b, l, h, -1) * decay[..., None]


def ssd_reference(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array,
                  initial_state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The recurrence one token at a time (lax.scan), in the inputs' dtype: the test oracle."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    rep = h // B.shape[2]
    Bh, Ch = jnp.repeat(B, rep, axis=2), jnp.repeat(C, rep, axis=2)          # [b, l, h, n]
    decay = jnp.exp(dt * A)                                                   # [b, l, h]
    state0 = jnp.zeros((b, h, p, n), x.dtype) if initial_state is None else initial_state

    def step(state, inp):
        xt, dtt, dec, bt, ct = inp
        state = dec[..., None, None] * state + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return state, jnp.einsum("bhpn,bhn->bhp", state, ct)

    final, ys = jax.lax.scan(step, state0, tuple(jnp.moveaxis(t, 1, 0) for t in (x, dt, decay, Bh, Ch)))
    return jnp.moveaxis(ys, 0, 1), final


def causal_conv(u: jax.Array, w: jax.Array, bias: jax.Array, halo: jax.Array | None = None) -> jax.Array:
    """Depthwise causal conv along axis 1: out_t = bias + sum_k w[k] u[t - K + 1 + k].

    u [b, l, *c]; w [K, *c]; bias [*c]; halo [b, K-1, *c] = the K-1 tokens before u (zeros, i.e.
    the sequence start, when None; context parallelism passes the previous shard's tail).
    """
    k, l = w.shape[0], u.shape[1]
    if halo is None:
        halo = jnp.zeros((u.shape[0], k - 1) + u.shape[2:], u.dtype)
    padded = jnp.concatenate([halo.astype(u.dtype), u], axis=1)
    out = bias.astype(u.dtype)
    for i in range(k):
        out = out + padded[:, i:i + l] * w[i].astype(u.dtype)
    return out
