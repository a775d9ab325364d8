"""Generation with a cache: prefill a prompt, then decode one token per sequence per step.

The decode path sits beside the training forward and reuses its blocks' parameters and pieces
(`Attention.project` / `output`, `MambaBlock.in_proj`, the conv and SSD kernels); only the state
that carries from one step to the next is new. That state, per block of a run's unit, stacked
over the run's units on `layers` like the parameters (`runs`: one list of blocks per run):

    A block   k, v      [units, b, S, kv_cached, head_dim]   (layers, cache_batch, cache_seq, cache_kv_heads, head_dim)
              or, with latent attention (models/mla.py), latent [units, b, S, kv_lora_rank] and
              k_rope [units, b, S, qk_rope_head_dim]: kv_lora_rank + qk_rope_head_dim values per token
    M block   conv_x    [units, b, K-1, ssm_heads, p]        the last K-1 conv inputs (the conv window)
              conv_B/C  [units, b, K-1, ngroups, d_state]
              ssm       [units, b, ssm_heads, p, d_state]    the SSM state, float32
    and once  pos       [b, S] int32                          each cache slot's token position (attention
                                                            stacks only: [b, 0] without attention)

S is the cache length (longest prompt + new tokens - 1). A Mamba layer's state does not grow with S.
`kv_cached` is kv_heads, or a multiple of it when the strategy replicates K/V heads across tensor
ranks (tensor > kv_heads, jaxpar.core.rules.rules_for): head c of the cache holds K/V head c // copies,
and query head i reads cache head i // (heads / kv_cached), which is a copy of its own K/V head.

Prompts of different lengths are LEFT-padded to a common width P, so every sequence writes slot
P + t at decode step t (one dynamic_update_slice, not a scatter) and the last column is every
sequence's newest token. A real token's position counts from its prompt's first token. A pad's
position is PAD_POSITION, larger than any real one, and so is every slot not yet written: the
causal mask (query position >= key position) then hides pads and empty slots from every real query,
with the attention kernel unchanged. In Mamba layers a pad is an identity step: its conv inputs
are zero (what a sequence start sees) and its dt is 0 (decay 1, no input), so the state entering a
prompt's first real token is the zero state, as without padding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.ops import mamba_cp
from jaxpar.ops.attention import attention, context_attention, dense_attention, resolve_kernel
from jaxpar.ops.ssd import causal_conv, ssd
from jaxpar.core.sharding import constrain, current_layout
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import dtype_of
from jaxpar.models.lm import LM
from jaxpar.models.mamba import GROUPS, HEADS, gated_rms_norm
from jaxpar.models.transformer import RESIDUAL

PAD_POSITION = 2**30  # the position of pads and empty cache slots: after every real token
KV_NAMES = ("layers", "cache_batch", "cache_seq", "cache_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One cache array: its shape, dtype, logical axis names and initial value (a leaf of the cache
    layout tree)."""
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...]
    fill: int = 0


def cache_layout(cfg: ModelConfig, run: RunConfig, batch: int, length: int, kv_copies: int = 1) -> dict:
    """The cache as a tree of Slots: {"pos": Slot, "runs": [per run, one dict per block of its unit]}."""
    dt = str(dtype_of(run))
    runs = [[_block_cache(cfg, kind, dt, (r.count, batch, length, kv_copies)) for kind in r.unit] for r in cfg.runs]
    # the slots' positions are for attention's causal mask: an attention-free stack keeps none, so its
    # decode state is the same size for any cache length
    slots = length if cfg.has_attention else 0
    return {"pos": Slot((batch, slots), "int32", ("cache_batch", "cache_seq"), PAD_POSITION), "runs": runs}


def _block_cache(cfg: ModelConfig, kind: str, dt: str, shape: tuple[int, int, int, int]) -> dict:
    """One block's cache Slots; `shape`: (its run's units, batch, cache length, K/V head copies)."""
    u, batch, length, kv_copies = shape
    if kind in ("A", "E") and cfg.mla:   # the latent and the shared RoPE key: no head dim to split
        return {"latent": Slot((u, batch, length, cfg.kv_lora_rank), dt, KV_NAMES[:3] + ("cache_latent",)),
                "k_rope": Slot((u, batch, length, cfg.qk_rope_head_dim), dt, KV_NAMES[:3] + ("head_dim",))}
    if kind in ("A", "E"):  # attention, then a dense or a mixture-of-experts MLP
        kv = Slot((u, batch, length, cfg.kv_heads * kv_copies, cfg.head_dim), dt, KV_NAMES)
        return {"k": kv, "v": kv}
    if kind == "M":
        k, h, p, g, n = cfg.d_conv - 1, cfg.ssm_heads, cfg.ssm_head_dim, cfg.ngroups, cfg.d_state
        window = ("layers", "cache_batch", "conv")
        return {"conv_x": Slot((u, batch, k, h, p), dt, window + ("ssm_heads", "head_dim")),
                "conv_B": Slot((u, batch, k, g, n), dt, window + ("ssm_groups", "ssm_state")),
                "conv_C": Slot((u, batch, k, g, n), dt, window + ("ssm_groups", "ssm_state")),
                "ssm": Slot((u, batch, h, p, n), "float32",
                            ("layers", "cache_batch", "ssm_heads", "head_dim", "ssm_state"))}
    raise ValueError(f"no decode path for block kind {kind!r} (jaxpar.core.validate.check_generate refuses it)")


def is_slot(x) -> bool:
    return isinstance(x, Slot)


def init_cache(layout: dict) -> dict:
    """Zeros for every array, PAD_POSITION for every slot's position (nothing written yet)."""
    return jax.tree.map(lambda s: jnp.full(s.shape, s.fill, s.dtype), layout, is_leaf=is_slot)


# ---- blocks --------------------------------------------------------------------------------------

def attention_block(block, x, positions, cache, cache_pos, index, prefill: bool, cp: str | None = None):
    """AttentionBlock with a K/V cache: x [b, s, d] at `positions` [b, s]; the new k, v are written
    at cache slots [index, index + s). A prefill (empty cache) attends over its own k, v -- with the
    context-parallel kernel `cp` (ring | allgather) when the sequence is split over `context` -- and
    a decode step over the whole cache, whose positions are `cache_pos` [b, S]."""
    h = constrain(block.attn_norm(x), ("batch", "seq", "act_embed"))
    q, k, v = block.attn.project(h, positions)
    kernel = block.attn.run.core.kernel   # the prefill's kernel; a decode step's one query reads the cache densely
    if cp:  # the kernel takes the K/V heads as projected (sharded like the query heads)
        out = context_attention(q, k, v, positions, impl=cp, kernel=resolve_kernel(kernel, q.dtype), causal=True)
    copies = cache["k"].shape[2] // k.shape[2]
    if copies > 1:  # tensor > kv_heads: each tensor rank keeps a copy of the one head it reads
        k, v = (jnp.repeat(t, copies, axis=2) for t in (k, v))
    k, v = (constrain(t, ("cache_batch", "cache_seq", "cache_kv_heads", "head_dim")) for t in (k, v))
    ck, cv = (jax.lax.dynamic_update_slice_in_dim(c, t.astype(c.dtype), index, axis=1)
              for c, t in ((cache["k"], k), (cache["v"], v)))
    if prefill and not cp:
        out = attention(q, k, v, positions, impl="dense", kernel=kernel, causal=True)
    elif not prefill:
        out = dense_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), positions, cache_pos, causal=True)
    return feed_forward(block, x, out), {"k": ck, "v": cv}


def feed_forward(block, x, out):
    """The rest of an attention block after its attention core's output `out`: the output projection onto
    the residual stream, then the MLP. An E block's MoE (models/moe.py: router, experts over `expert`,
    shared experts) drops its auxiliary router losses, which are for training. Dropless routing
    (capacity_factor=0) treats each token alone, so one token per step routes as it does in the full
    forward (jaxpar.core.validate.check_generation)."""
    x = constrain(x + block.attn.output(out), RESIDUAL)
    h = constrain(block.mlp_norm(x), ("batch", "seq", "act_embed"))
    y = block.moe(h)[0] if hasattr(block, "moe") else block.mlp(h)
    return constrain(x + y, RESIDUAL)


def mla_block(block, x, positions, cache, cache_pos, index, prefill: bool, cp: str | None = None):
    """An attention block with latent attention (models/mla.py): `attention_block`'s contract, caching the
    latent c and the RoPE key. A prefill attends over the expanded K/V with the strategy's kernel; a decode
    step reads the cache as the run chooses (run.mla_decode: jaxpar/ops/latent_attention.py, absorbed or
    expanded)."""
    attn = block.attn
    h = constrain(block.attn_norm(x), ("batch", "seq", "act_embed"))
    q_nope, q_rope = attn.query(h, positions)
    c, k_rope = attn.latent(h, positions)
    cc, cr = (jax.lax.dynamic_update_slice_in_dim(cache[key], t.astype(cache[key].dtype), index, axis=1)
              for key, t in (("latent", c), ("k_rope", k_rope)))
    if prefill:
        q, (k, v) = jnp.concatenate([q_nope, q_rope], -1), attn.expand(c, k_rope)
        kernel = resolve_kernel(attn.run.core.kernel, q.dtype)
        out = attention(q, k, v, positions, impl=cp or "dense", kernel=kernel, causal=True)
    else:
        dt = q_nope.dtype
        up = (attn.wk_b[...].astype(dt), attn.wv_b[...].astype(dt))
        out = attn.run.mla_decode(q_nope, q_rope, (cc.astype(dt), cr.astype(dt)), up, (positions, cache_pos))
    return feed_forward(block, x, out), {"latent": cc, "k_rope": cr}


def mamba_block(block, x, valid, cache, tail=None):
    """MambaBlock from a cached state: x [b, s, d]; `valid` [b, s] is False at pads (identity steps).
    The conv sees the cached window before its input, SSD starts from the cached state, and both
    are replaced by their values after the last of the s tokens.

    `tail` (a context-parallel prefill, from an empty cache): the columns of the last d_conv-1
    tokens in sequence order (the token layout may permute them). The conv and SSD then run on the
    sequence split over `context` (jaxpar/ops/mamba_cp.py: halo exchange, state passing, and the
    final state the cache keeps)."""
    cfg, dt_ = block.cfg, dtype_of(block.run)
    h = constrain(block.norm(x), ("batch", "seq", "act_embed"))
    z, xs, B, C, dt = block.in_proj(h)
    keep = valid[:, :, None, None]
    new = {}
    convs = []
    for key, u, w, b, names in (("conv_x", xs, block.conv_x, block.conv_x_bias, HEADS),
                                ("conv_B", B, block.conv_B, block.conv_B_bias, GROUPS),
                                ("conv_C", C, block.conv_C, block.conv_C_bias, GROUPS)):
        u = jnp.where(keep, u, jnp.zeros((), u.dtype))
        window = cache[key].astype(u.dtype)
        if tail is None:
            new[key] = jnp.concatenate([window, u], axis=1)[:, u.shape[1]:].astype(cache[key].dtype)
        else:
            new[key] = u[:, tail].astype(cache[key].dtype)
        convs.append((u, w[...], b[...], names, window))
    layout = current_layout()
    if tail is None:
        conved = [causal_conv(u, w, b, halo=window) for u, w, b, _, window in convs]
    else:
        conved = mamba_cp.causal_conv_cp([c[:4] for c in convs], layout)
    xs, B, C = (constrain(jax.nn.silu(c), names) for c, (_, _, _, names, _) in zip(conved, convs))
    dt = jnp.where(valid[:, :, None], jax.nn.softplus(dt.astype(jnp.float32) + block.dt_bias[...]), 0.0)
    if tail is None:
        y, new["ssm"] = ssd(xs, dt, -jnp.exp(block.A_log[...]), B, C, cfg.chunk, initial_state=cache["ssm"])
    else:
        y, new["ssm"] = mamba_cp.ssd_cp(xs, dt, -jnp.exp(block.A_log[...]), B, C, cfg.chunk, layout, with_state=True)
    y = y + xs * block.D[...].astype(dt_)[:, None]
    y = constrain(gated_rms_norm(y, z, block.gate_norm[...], cfg.ngroups, cfg.norm_eps), HEADS)
    out = jnp.einsum("bshp,hpd->bsd", y, block.w_out[...].astype(dt_))
    return constrain(x + out, RESIDUAL), new


# ---- the model -----------------------------------------------------------------------------------

def forward(model: LM, tokens: jax.Array, positions: jax.Array, cache: dict, index, *,
            prefill: bool, order: np.ndarray | None = None) -> tuple[jax.Array, dict]:
    """Run `tokens` [b, s] at `positions` [b, s] (PAD_POSITION at pads) through the model, writing
    their state at cache slots [index, index + s). Returns (float32 logits of the last token
    [b, vocab], sharded on `act_vocab`; the updated cache). A prefill has index 0 and an empty cache.

    A prefill under a layout whose `seq` axes split the sequence (context parallelism) runs attention
    with the strategy's context kernel and Mamba-2 through jaxpar/ops/mamba_cp.py. `order` is then
    the token layout (jaxpar.ops.attention.token_permutation: column j holds token order[j]); K/V
    are cached in that order with their positions (attention reads the cache in any order, the mask
    compares positions), while the last token and the conv window are found through it."""
    cfg = model.cfg
    layout = current_layout()
    cp = prefill and layout is not None and layout.size("seq") > 1
    impl = layout.strategy.options.attention if cp else None
    s = tokens.shape[1]
    where = np.argsort(order) if order is not None else np.arange(s)   # where[t]: the column of token t
    tail = where[s - (cfg.d_conv - 1):] if cp else None
    x = model.embed(tokens)
    valid = positions < PAD_POSITION
    cache_pos = (jax.lax.dynamic_update_slice_in_dim(cache["pos"], positions.astype(jnp.int32), index, axis=1)
                 if cfg.has_attention else cache["pos"])
    def block_step(kind, block, x, c):
        if kind == "M":
            return mamba_block(block, x, valid, c, tail)
        if cfg.mla:
            return mla_block(block, x, positions, c, cache_pos, index, prefill, impl)
        return attention_block(block, x, positions, c, cache_pos, index, prefill, impl)

    runs = []
    for r, units, run_cache in zip(cfg.runs, model.runs, cache["runs"]):
        graphdef, stacked = nnx.split(units)
        x, new = jax.lax.scan(_unit_step(graphdef, r.unit, block_step), x, (stacked, run_cache))
        runs.append(new)
    return last_logits(model, x, int(where[-1])), {"pos": cache_pos, "runs": runs}


def _unit_step(graphdef, kinds: str, block_step):
    """The scan body over one run's units and their caches: each of the unit's blocks (`kinds`) through
    block_step(kind, block, x, cache) -> (x, new cache)."""
    def step(x, unit_and_cache):
        unit_state, unit_cache = unit_and_cache
        new = []
        for kind, block, c in zip(kinds, nnx.merge(graphdef, unit_state).blocks, unit_cache):
            x, c = block_step(kind, block, x, c)
            new.append(c)
        return x, new
    return step


def last_logits(model: LM, x: jax.Array, column: int = -1) -> jax.Array:
    """float32 logits [b, vocab] of one column (default the last) of the residual stream x [b, s, d]."""
    h = constrain(model.final_norm(x[:, column]), ("batch", "act_embed"))
    w = model.embedding[...].T if model.cfg.tie_embeddings else model.head[...]
    return constrain((h @ w.astype(h.dtype)).astype(jnp.float32), ("batch", "act_vocab"))


def full_logits(model: LM, tokens: jax.Array) -> jax.Array:
    """float32 logits [b, s, vocab] of the training forward over tokens [b, s] at positions 0..s-1,
    no cache: the reference the decode path is tested against."""
    b, s = tokens.shape
    x = model.apply_stack(model.embed(tokens), jnp.broadcast_to(jnp.arange(s), (b, s)))
    h = model.final_norm(x)
    w = model.embedding[...].T if model.cfg.tie_embeddings else model.head[...]
    return (h @ w.astype(h.dtype)).astype(jnp.float32)
