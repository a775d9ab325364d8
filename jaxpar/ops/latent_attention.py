"""Decode-step attention over a latent attention cache (models/mla.py, models/decode.py `mla_block`).

The cache holds, per token, the K/V latent c [kv_lora_rank] and the RoPE key k_rope [qk_rope_head_dim]
shared by the heads. Two ways to read it, equal in exact arithmetic (a run chooses one: RunConfig.mla_decode):

    absorbed_read   DeepSeek-V2 section 2.1.2: W_k_b folded into the query (q_nope W_k_b^T, a query in the
                    latent space, scored against c itself beside q_rope . k_rope) and W_v_b applied after
                    the probabilities weight c: per cached token 2 (2 kv_lora_rank + qk_rope) FLOPs per head
    expanded_read   every head's K and V rebuilt from each cached latent, then ordinary attention: the
                    reference the absorbed form is tested against (tests/test_deepseek.py)

Arguments, for both: q_nope [b, s, h, qk_nope], q_rope [b, s, h, qk_rope] (RoPE applied); `cached` = (c
[b, S, C], k_rope [b, S, r]); `up` = (W_k_b [C, h, qk_nope], W_v_b [C, h, v_head_dim]); `pos` = (query
positions [b, s], cache slot positions [b, S]). Returns [b, s, h, v_head_dim].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.ops.attention import dense_attention
from jaxpar.ops.blockwise_attention import MASKED


def absorbed_read(q_nope, q_rope, cached, up, pos):
    (c, k_rope), (wk_b, wv_b), (q_pos, kv_pos) = cached, up, pos
    q_lat = jnp.einsum("bshk,chk->bshc", q_nope, wk_b)
    scores = (jnp.einsum("bshc,btc->bhst", q_lat, c, preferred_element_type=jnp.float32)
              + jnp.einsum("bshr,btr->bhst", q_rope, k_rope, preferred_element_type=jnp.float32))
    scores = scores / np.sqrt(q_nope.shape[-1] + q_rope.shape[-1]).astype(np.float32)
    scores = jnp.where(q_pos[:, None, :, None] >= kv_pos[:, None, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_nope.dtype)
    return jnp.einsum("bshc,chk->bshk", jnp.einsum("bhst,btc->bshc", probs, c), wv_b)


def expanded_read(q_nope, q_rope, cached, up, pos):
    (c, k_rope), (wk_b, wv_b), (q_pos, kv_pos) = cached, up, pos
    k_nope = jnp.einsum("btc,chk->bthk", c, wk_b)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])], -1)
    v = jnp.einsum("btc,chk->bthk", c, wv_b)
    return dense_attention(jnp.concatenate([q_nope, q_rope], -1), k, v, q_pos, kv_pos, causal=True)
