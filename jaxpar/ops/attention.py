"""Attention: the dense reference, and the dispatch to context-parallel kernels.

Shapes: q [b, s, hq, d]; k, v [b, s, hkv, d] with hq a multiple of hkv (GQA); positions [b, s]
are the tokens' global positions, so causal masking is right for any token order (zigzag layouts).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # a large finite negative: fully masked rows stay finite (no NaN from -inf - -inf)


def dense_attention(q, k, v, q_pos, kv_pos, *, causal: bool = True):
    """softmax(q k^T / sqrt(d) + mask) v, with K/V heads shared by hq/hkv query heads each."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    if causal:
        allowed = q_pos[:, None, None, :, None] >= kv_pos[:, None, None, None, :]
        scores = jnp.where(allowed, scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(b, sq, hq, d)


def attention(q, k, v, positions, *, impl: str = "dense", causal: bool = True):
    """Dispatch on the strategy's `attention` option.

    dense: plain attention; XLA partitions it on batch and heads (the context axis must be 1).
    ring / allgather: context parallelism over the `seq` mesh axes (jaxpar.ops.context_parallel).
    """
    if impl == "dense":
        return dense_attention(q, k, v, positions, positions, causal=causal)
    from jaxpar.ops import context_parallel  # noqa: PLC0415 (optional kernel)
    return context_parallel.context_attention(q, k, v, positions, impl=impl, causal=causal)
