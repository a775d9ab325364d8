"""Blockwise (flash-style) attention in pure JAX: memory linear in the sequence, forward and backward.

Shapes as in jaxpar/ops/attention.py: q [b, sq, hq, d]; k, v [b, sk, hkv, d] with hq a multiple of hkv
(GQA: each K/V head serves hq/hkv query heads, read in place, never repeated); q_pos [b, sq] and
kv_pos [b, sk] are the tokens' positions, so the causal mask is right for any token order (zigzag
context layouts); optional segment ids [b, sq] / [b, sk] keep packed documents apart (a query sees
a key only in its own segment).

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). For one query row, with
scores s_j arriving in blocks, keep
    m = max_j s_j,   l = sum_j exp(s_j - m),   acc = sum_j exp(s_j - m) v_j
and on a new block B:  m' = max(m, max_B s);  alpha = exp(m - m')
    l' = alpha l + sum_B exp(s - m'),   acc' = alpha acc + sum_B exp(s - m') v.
After all blocks, out = acc / l = softmax(s) v exactly. `online_update` is that step; ring attention
(jaxpar/ops/attention.py) folds the blocks arriving from its neighbours with it too. Masked scores are
MASKED (finite) and their probabilities set to 0, so a block fully masked for a row adds nothing.

Memory. A scan over blocks differentiated by autodiff (even under remat) keeps every iteration's carry
for the backward pass: O(s / block x s x d) per row block, quadratic overall. So `blockwise_attention`
is a custom VJP that saves only q, k, v, the output and each row's logsumexp (lse = m + log l), and its
backward pass recomputes each block's probabilities p = exp(s - lse) (FlashAttention-2's backward,
Dao 2023, algorithm 2):
    dV += p^T dO,   dP = dO V^T,   dS = p * (dP - D) with D = rowsum(dO * O),   dQ += dS K,   dK += dS^T Q.
The largest temporary is one block of scores, [b, hq, block_q, block_k].

Lengths that are not a multiple of the block are padded and the padding masked (its keys are in no
query's segment; its queries' rows are sliced off). Under a causal mask a (q block, k block) pair where
no query may see any key is skipped (`lax.cond`), halving the work.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.ops.tiles import BLOCK_K, BLOCK_Q
from jaxpar.xla_workarounds import loop_variant

MASKED = -1e30  # a large finite negative: fully masked rows stay finite (no NaN from -inf - -inf)

RESIDUAL_NAMES = ("flash_out", "flash_lse")
"""checkpoint_names of the kernel's output and logsumexp, the residuals its backward reads beside q, k, v.
A custom VJP's forward rule is rematerialised under the ambient checkpoint policy (JAX's custom_vjp.defremat
docs): under a policy that saves dot outputs (jaxpar/ops/layer_scan.py's `dots`, `dots_no_batch`) and not these two, the
backward pass would rerun the forward's scans from the saved dots, and so keep every block pair's QK^T and
PV products, the s x s memory of dense attention that the kernel exists to avoid (llama3-70b, seq 8,192,
fsdp=256 x tensor=2 under `dots`, XLA:CPU's memory analysis: 726 GiB per device that way, 64 with these
names saved). A policy that also saves these names keeps O(s) per layer and reruns nothing of the forward."""


# ---- the block update, shared with ring attention -------------------------------------------------

def block_mask(q_pos, kv_pos, q_seg=None, kv_seg=None, *, causal: bool):
    """Which (query, key) pairs may attend, [b, 1, 1, sq, sk] (broadcast over kv heads and groups), or
    None where every pair may. Causal compares positions, never indices; segments must be equal."""
    allowed = None
    if causal:
        allowed = q_pos[:, :, None] >= kv_pos[:, None, :]
    if q_seg is not None:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        allowed = same if allowed is None else allowed & same
    return None if allowed is None else allowed[:, None, None]


def online_update(stats, qg, k, v, allowed):
    """One online-softmax step: fold the scores of qg [b, sq, hkv, g, d] (already scaled by 1/sqrt(d))
    x k [b, sk, hkv, d] into stats (m, l [b, hkv, g, sq]; acc [b, hkv, g, sq, d], float32).

    m is held out of autodiff (stop_gradient): the result does not depend on it, so that is exact and
    saves its backward pass (ring attention differentiates through this function)."""
    m, l, acc = stats
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    if allowed is not None:
        scores = jnp.where(allowed, scores, MASKED)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, scores.max(axis=-1)))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv


def empty_stats(shape, d):
    """Statistics before any block: m = MASKED, l = 0, acc = 0 for rows of `shape` [b, hkv, g, sq]."""
    return (jnp.full(shape, MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (d,), jnp.float32))


# ---- the kernel ---------------------------------------------------------------------------------

def blockwise_attention(q, k, v, q_pos, kv_pos, *, causal: bool = True, q_segments=None, kv_segments=None,  # many parameters: the kernels' shared signature, and the block sizes
                        blocks: tuple[int, int] = (BLOCK_Q, BLOCK_K)):
    """softmax(q k^T / sqrt(d) + mask) v in `blocks` of (block_q queries, block_k keys); equals
    jaxpar.ops.attention.dense_attention (with segment ids: attention within each segment)."""
    block_q, block_k = blocks
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("blockwise_attention: give both q_segments and kv_segments, or neither")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"blockwise_attention: kv heads {hkv} do not divide query heads {hq}")
    bq, bk = min(block_q, sq), min(block_k, sk)
    # Padding: padded keys get segment -1 and padded queries -2, so no pair involving one is allowed.
    q_seg = jnp.zeros((b, sq), jnp.int32) if q_segments is None else q_segments.astype(jnp.int32)
    kv_seg = jnp.zeros((b, sk), jnp.int32) if kv_segments is None else kv_segments.astype(jnp.int32)
    qg = _pad(q.reshape(b, sq, hkv, hq // hkv, d), bq)
    k, v, kv_pos, kv_seg = (_pad(x, bk) for x in (k, v, kv_pos, kv_seg))
    q_pos, q_seg = _pad(q_pos, bq), _pad(q_seg, bq)
    kv_seg = kv_seg.at[:, sk:].set(-1)
    q_seg = q_seg.at[:, sq:].set(-2)
    out = _flash(qg, k, v, Mask(q_pos, kv_pos, q_seg, kv_seg), causal, bq, bk)
    return out[:, :sq].reshape(b, sq, hq, d)


class Mask(NamedTuple):
    """What decides which (query, key) pairs are allowed: their positions and segment ids (padding -2, -1)."""
    q_pos: jax.Array
    kv_pos: jax.Array
    q_seg: jax.Array
    kv_seg: jax.Array


def _pad(x, block):
    """x padded with zeros along dim 1 to a multiple of `block`."""
    extra = -x.shape[1] % block
    return x if not extra else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _blocks(x, block):
    """[b, s, ...] -> [s / block, b, block, ...]: the leading axis is what the scans iterate over."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """The inverse of `_blocks`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _visible(causal, q_pos, kv_pos):
    """Whether some query of a block may see some key of another (always, without a causal mask)."""
    return jnp.any(q_pos[:, :, None] >= kv_pos[:, None, :]) if causal else jnp.bool_(True)


def _varying_like(tree, x):
    """Constants (a scan's or a cond's starting values) typed as varying over the manual mesh axes x varies
    over, as a carry must keep one type under shard_map's check_vma (all-gather attention calls this kernel
    per device); outside shard_map, the constants as they are. (JAX 0.12 types them as
    manual_axis_type.varying, earlier releases as vma.)"""
    aval = jax.typeof(x)
    axes = tuple(aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying)
    return jax.lax.pcast(tree, axes, to="varying") if axes else tree


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(qg, k, v, mask: Mask, causal, bq, bk):
    return _forward(qg, k, v, mask, causal, bq, bk)[0]


def _forward(qg, k, v, mask: Mask, causal, bq, bk):
    """(out [b, sq, hkv, g, d] in q's dtype, lse [b, hkv, g, sq] float32): a map over query blocks, each
    a scan over key blocks folding them with `online_update`."""
    b, sq, hkv, g, d = qg.shape
    scale = 1.0 / math.sqrt(d)
    qg, q_pos, q_seg, k, v, kv_pos, kv_seg = loop_variant(qg, mask.q_pos, mask.q_seg, k, v, mask.kv_pos, mask.kv_seg)
    kv_blocks = tuple(_blocks(x, bk) for x in (k, v, kv_pos, kv_seg))

    def one_q_block(args):
        qb, qpos, qseg = args
        qb = qb * jnp.asarray(scale, qb.dtype)

        def fold(stats, kv):
            kb, vb, kpos, kseg = kv
            update = lambda st: online_update(st, qb, kb, vb, block_mask(qpos, kpos, qseg, kseg, causal=causal))
            return jax.lax.cond(_visible(causal, qpos, kpos), update, lambda st: st, stats), None

        (m, l, acc), _ = jax.lax.scan(fold, _varying_like(empty_stats((b, hkv, g, bq), d), qb), kv_blocks)
        seen = l > 0   # rows with no visible key (padding) give 0 and a finite lse
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return jnp.moveaxis(out, 3, 1).astype(qg.dtype), lse          # [b, bq, hkv, g, d], [b, hkv, g, bq]

    out, lse = jax.lax.map(one_q_block, tuple(_blocks(x, bq) for x in (qg, q_pos, q_seg)))
    return _unblocks(out), jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, sq)


def _flash_fwd(qg, k, v, mask: Mask, causal, bq, bk):
    out, lse = _forward(qg, k, v, mask, causal, bq, bk)
    out, lse = (checkpoint_name(x, name) for x, name in zip((out, lse), RESIDUAL_NAMES))
    return out, (qg, k, v, *mask, out, lse)


def _flash_bwd(causal, bq, bk, res, dout):
    """dq, dk, dv from the saved row statistics: a scan over key blocks (carrying dq), each a scan over
    query blocks (carrying that key block's dk, dv), recomputing one block of probabilities at a time."""
    qg, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = res
    qg, q_pos, q_seg, k, v, kv_pos, kv_seg = loop_variant(qg, q_pos, q_seg, k, v, kv_pos, kv_seg)
    b, sq, hkv, g, d = qg.shape
    scale = 1.0 / math.sqrt(d)
    dout = dout.astype(jnp.float32)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dout, out.astype(jnp.float32))   # D = rowsum(dO * O)
    q_blocks = (_blocks(qg, bq), _blocks(dout, bq), _blocks(jnp.moveaxis(lse, 3, 1), bq),
                _blocks(jnp.moveaxis(delta, 3, 1), bq), _blocks(q_pos, bq), _blocks(q_seg, bq))

    def one_k_block(dq, kv):
        kb, vb, kpos, kseg = kv

        def pair(grads, qs):
            qb, dob, lse_b, delta_b, qpos, qseg = qs
            return jax.lax.cond(_visible(causal, qpos, kpos), _pair_grads,
                                lambda grads, *_: (grads, _varying_like(jnp.zeros(qb.shape, jnp.float32), dob)),
                                grads, (qb, dob, lse_b, delta_b), (kb, vb),
                                block_mask(qpos, kpos, qseg, kseg, causal=causal), scale)

        zeros = _varying_like((jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32)), kb)
        (dk, dv), dq_blocks = jax.lax.scan(pair, zeros, q_blocks)
        return dq + dq_blocks, (dk, dv)

    dq0 = _varying_like(jnp.zeros((sq // bq, b, bq, hkv, g, d), jnp.float32), dout)
    dq, (dk, dv) = jax.lax.scan(one_k_block, dq0, tuple(_blocks(x, bk) for x in (k, v, kv_pos, kv_seg)))
    return (_unblocks(dq).astype(qg.dtype), _unblocks(dk).astype(k.dtype), _unblocks(dv).astype(v.dtype),
            Mask(None, None, None, None))


def _pair_grads(grads, q_block, kv_block, allowed, scale):
    """One (q block, k block) pair of the backward pass: ((dk, dv) + this pair's, this pair's dq). `q_block`:
    (qb, dob, lse_b, delta_b), lse_b and delta_b [b, bq, hkv, g] (the blocks' layout), qb not yet scaled;
    `kv_block`: (kb, vb)."""
    (dk, dv), (qb, dob, lse_b, delta_b), (kb, vb) = grads, q_block, kv_block
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
    p = jnp.exp(scores - jnp.moveaxis(lse_b, 1, 3)[..., None])
    if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
    dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p, dob)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dob, vb.astype(jnp.float32))
    ds = p * (dp - jnp.moveaxis(delta_b, 1, 3)[..., None])
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb.astype(jnp.float32)) * scale
    dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qb.astype(jnp.float32)) * scale
    return (dk, dv), dq


_flash.defvjp(_flash_fwd, _flash_bwd)
