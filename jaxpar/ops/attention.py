"""Attention kernels: the dense reference, the fused ones, and context parallelism (ring, all-gather).

Shapes: q [b, s, hq, d]; k, v [b, s, hkv, d] with hq a multiple of hkv (GQA); positions [b, s] are the
tokens' global positions, so causal masking is right for any token order (zigzag layouts). `attention`
dispatches on how the sequence is split over `context` (dense | ring | allgather) and on the kernel that
computes softmax(q k^T) v on a device: dense (the [hq, s, s] float32 scores kept for the backward: the
reference), blockwise (online softmax, recomputed backward: jaxpar/ops/blockwise_attention.py), cudnn
(cuDNN's fused flash kernel), splash (the Pallas splash kernel: jaxpar/ops/splash_attention.py), auto
(jaxpar.core.strategy.resolve_kernel). Context parallelism, in `jax.shard_map`: `ring_attention` (K/V blocks around the
context ring, folded into a running softmax: one block of scores per device; Liu et al. 2023) and
`allgather_attention` (K/V of the whole sequence gathered, queries local: Llama 3). Positions travel with
K/V, so the kernels are right for any token layout (`token_permutation`: contiguous or zigzag). The
constraints are jaxpar/core/validate.py's; docs/kernels.md has the kernels and layouts at length.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.core import validate
from jaxpar.core.sharding import current_layout, use_layout
from jaxpar.core.rules import spec_entry
from jaxpar.core.strategy import CHOICES, resolve_kernel
from jaxpar.ops.blockwise_attention import MASKED, blockwise_attention, block_mask, empty_stats, online_update
from jaxpar.ops.splash_attention import splash_attention
from jaxpar.xla_workarounds import loop_variant

LAYOUTS = CHOICES["cp_layout"]  # token layouts along a context-parallel sequence
RING_NAMES = ("ring_kv", "ring_stats")
"""checkpoint_names of ring attention's per-step K/V blocks and running statistics, the inputs each fold's
recomputation reads (`ring_attention`). A custom VJP's forward rule is rematerialised under the ambient
checkpoint policy (as for jaxpar/ops/blockwise_attention.py RESIDUAL_NAMES): under a policy that saves dot
outputs and not these, the folds' forward rules would be rerun from saved QK^T and PV products of every
step of every layer. The remat policies that save dots save these too (jaxpar/ops/layer_scan.py). Seen on llama-tiny
d_model=256 fsdp=2 x context=4, 2,048 tokens, remat dots (XLA:CPU's memory analysis): 289 MiB peak
without the names, 131 with them (remat none: 138)."""


# ---- dense attention and the dispatch -----------------------------------------------------------


def dense_attention(q, k, v, q_pos, kv_pos, *, causal: bool = True, q_segments=None, kv_segments=None):
    """softmax(q k^T / sqrt(d) + mask) v, with K/V heads shared by hq/hkv query heads each (with segment
    ids [b, s]: a query sees a key only in its own segment)."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    if causal:
        allowed = q_pos[:, None, None, :, None] >= kv_pos[:, None, None, None, :]
        scores = jnp.where(allowed, scores, MASKED)
    if q_segments is not None:
        scores = jnp.where(q_segments[:, None, None, :, None] == kv_segments[:, None, None, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(b, sq, hq, v.shape[-1])   # v's head dim may be narrower than q's (latent attention)


def cudnn_attention(q, k, v, q_pos, kv_pos, *, causal: bool = True):
    """cuDNN's fused flash attention (GQA as is). Its causal mask compares indices: right where q_pos and
    kv_pos are 0..s-1 in order, which jaxpar/core/validate.py ensures (no context parallelism)."""
    del q_pos, kv_pos
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


KERNELS = {"dense": dense_attention, "blockwise": blockwise_attention, "cudnn": cudnn_attention,
           "splash": splash_attention}


def attention(q, k, v, positions, segments=None, *, impl: str = "dense", kernel: str = "dense",
              causal: bool = True):
    """Dispatch on the strategy's `attention` and `attention_kernel` options.

    dense: the sequence is not split; XLA partitions the kernel on batch and heads (context must be 1).
    ring / allgather: context parallelism over the `seq` mesh axes (`context_attention` below).
    v's head dim may be below q's (latent attention): the dense kernel takes it as it is, the others pad it.
    segments [b, s]: packed documents kept apart (dense impl; the dense, blockwise and splash kernels:
    jaxpar/training/trainer.py `Trainer.use_document_mask` refuses the rest).
    """
    kernel = resolve_kernel(kernel, q.dtype)
    dv = v.shape[-1]
    if dv < q.shape[-1] and (kernel, impl) != ("dense", "dense"):
        # latent attention's values are narrower than its q/k heads: zero columns make them as wide for the
        # fused and context-parallel kernels, and are cut from the output (transformers' DeepSeek-V3 does the
        # same for flash attention)
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
        return attention(q, k, v, positions, segments, impl=impl, kernel=kernel, causal=causal)[..., :dv]
    if segments is not None:
        return KERNELS[kernel](q, k, v, positions, positions, causal=causal, q_segments=segments,
                               kv_segments=segments)
    if impl == "dense":
        return KERNELS[kernel](q, k, v, positions, positions, causal=causal)
    return context_attention(q, k, v, positions, impl=impl, kernel=kernel, causal=causal)


# ---- token layouts ------------------------------------------------------------------------------

def token_permutation(seq_len: int, context: int, layout: str) -> np.ndarray:
    """Order of tokens along the sequence dim so that contiguous sharding over `context` gives
    device i the tokens the layout assigns to it: `x_laid_out = x[:, perm]`.

    contiguous: the identity.
    zigzag:     2*context chunks; device i holds chunks i and 2*context-1-i, e.g. context=2, 8
                tokens -> [0 1 | 6 7 | 2 3 | 4 5]. Undo with `np.argsort(perm)`.
    """
    validate.check_token_layout(seq_len, context, layout)
    if layout == "contiguous":
        return np.arange(seq_len)
    chunk = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, chunk)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]])
                           for i in range(context)])


# ---- the entry point ---------------------------------------------------------------------------

def context_attention(q, k, v, positions, *, impl: str, kernel: str = "dense", causal: bool = True):
    """Attention over a sequence sharded on the layout's `seq` axes (the `context` mesh axis).

    Batch stays sharded on its data axes and heads on `tensor`, exactly as the model constrained
    q/k/v, so shard_map introduces no resharding. Without a layout, or with context=1, this is
    the device kernel `kernel` -- the same function, computed without splitting the sequence.
    All-gather attention computes its local queries against the gathered K/V with `kernel`; ring
    attention folds blocks with the blockwise kernel's update whatever `kernel` is.
    """
    local_kernel = KERNELS[kernel]
    layout = current_layout()
    if layout is None or layout.size("seq") == 1:
        return local_kernel(q, k, v, positions, positions, causal=causal)

    ring_axes, batch_axes = layout.axes("seq"), layout.axes("batch")
    head_axes, kv_head_axes = layout.axes("act_heads"), layout.axes("act_kv_heads")
    q_spec = P(spec_entry(batch_axes), spec_entry(ring_axes), spec_entry(head_axes), None)
    kv_spec = P(spec_entry(batch_axes), spec_entry(ring_axes), spec_entry(kv_head_axes), None)
    pos_spec = P(spec_entry(batch_axes), spec_entry(ring_axes))
    # The mesh axes q differs along (check_vma tracks them); constants joining q must be cast up.
    varying = tuple(dict.fromkeys(batch_axes + ring_axes + head_axes + kv_head_axes))
    def local(q, k, v, pos):
        if impl == "ring":
            return ring_attention(q, k, v, pos, axis=ring_axes, size=layout.size("seq"), causal=causal, varying=varying)
        return allgather_attention(q, k, v, pos, axis=ring_axes, causal=causal, kernel=local_kernel)

    # Inside a pipeline's vmap over stages (spmd_axis_name = pipeline) the batching adds `pipeline` to
    # what q varies over but not to the kernel's cast-up constants, and check_vma refuses the mix: off
    # there (the pipeline equivalence tests, tests/test_pipeline.py, check the gradients it would guard).
    return jax.shard_map(local, mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec, pos_spec),
                         out_specs=q_spec, check_vma=layout.size("stages") == 1)(q, k, v, positions)


# ---- all-gather context parallelism ------------------------------------------------------------

def allgather_attention(q, k, v, pos, *, axis, causal, kernel=dense_attention):
    """Per device: local queries against the all-gathered K/V (and their positions), with `kernel`.

    Forward: one all-gather each of K, V, positions over `axis`. Backward (by autodiff): the
    transpose of an all-gather is a reduce-scatter, so dK/dV are summed over the ring and each
    device keeps its own slice.
    """
    k_all, v_all, pos_all = jax.lax.all_gather((k, v, pos), axis, axis=1, tiled=True)
    return kernel(q, k_all, v_all, pos, pos_all, causal=causal)


# ---- ring attention ----------------------------------------------------------------------------
#
# Online softmax (jaxpar/ops/blockwise_attention.py): each arriving K/V block is folded into running
# statistics (m, l, acc) with `online_update`, the blockwise kernel's block step.


def ring_attention(q, k, v, pos, *, axis, size, causal, varying=()):
    """Per device: fold the local K/V block, then size-1 blocks received from the ring neighbour.

    Step 0 uses the device's own block; each of the size-1 scan steps first receives the K/V
    (and positions) its left neighbour held, then folds them in -- so nothing is sent after the
    last block, and only the hkv K/V heads travel, never the hq query heads (GQA).

    Each fold is rematerialised (a custom VJP that reruns it): the backward pass keeps only the per-step
    carries (running m, l, acc and the K/V block, O(s_local x d)), never a block of scores.

    Under a causal mask the local sequence is split into two halves and each (q half, kv half)
    sub-block is computed only if some query in it may see some key (`lax.cond`). With the
    zigzag layout every off-diagonal step then costs half a block on every device; with the
    contiguous layout whole blocks are skipped on early devices while late ones do full work.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qg = (q.reshape(b, s, hkv, hq // hkv, d) / math.sqrt(d))        # [b, s, hkv, g, d]
    halves = 2 if causal and s % 2 == 0 and s >= 2 else 1
    piece = s // halves
    qs = [(qg[:, i * piece:(i + 1) * piece], pos[:, i * piece:(i + 1) * piece]) for i in range(halves)]

    # Running statistics per q piece: m, l [b, hkv, g, piece]; acc [b, hkv, g, piece, d] (float32).
    # They start device-invariant (constants) and become varying like q (over `varying`, the
    # manual axes q is sharded on), so cast them up front: a scan carry keeps one type (check_vma).
    stats_shape = (b, hkv, hq // hkv, piece)

    def init():
        return jax.lax.pcast(empty_stats(stats_shape, d), varying, to="varying")

    def fold(stats, kv, qs):
        """Fold one K/V block into every q piece's statistics."""
        k, v, kv_pos = kv
        ks = [(k[:, j * piece:(j + 1) * piece], v[:, j * piece:(j + 1) * piece],
               kv_pos[:, j * piece:(j + 1) * piece]) for j in range(halves)]
        out = []
        for (qi, qpos), st in zip(qs, stats):
            for kj, vj, kpos in ks:
                # the positions are the same in every layer: tied to this layer's K so that no mask or
                # score block leaves the layer loop (xla_workarounds.loop_variant)
                kj, qpos, kpos = loop_variant(kj, qpos, kpos)
                if causal:
                    visible = jnp.any(qpos[:, :, None] >= kpos[:, None, :])
                    st = jax.lax.cond(visible, _causal_update, lambda st, *_: st, st, qi, kj, vj, qpos, kpos)
                else:
                    st = online_update(st, qi, kj, vj, None)
            out.append(st)
        return out

    fold_block = recomputed(fold)
    stats = checkpoint_name(fold_block([init() for _ in range(halves)], (k, v, pos), qs), RING_NAMES[1])

    perm = [(i, (i + 1) % size) for i in range(size)]  # send to the right, receive from the left

    def step(carry, _):
        stats, kv = carry
        kv = checkpoint_name(jax.lax.ppermute(kv, axis, perm), RING_NAMES[0])
        return (checkpoint_name(fold_block(stats, kv, qs), RING_NAMES[1]), kv), None

    (stats, _), _ = jax.lax.scan(step, (stats, (k, v, pos)), length=size - 1)

    outs = []
    for m, l, acc in stats:
        # Rows with no visible key anywhere (impossible when each query is also a key) give 0.
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]                   # [b, hkv, g, piece, d]
        outs.append(jnp.moveaxis(o, 3, 1))                              # [b, piece, hkv, g, d]
    return jnp.concatenate(outs, axis=1).reshape(b, s, hq, d).astype(q.dtype)


def recomputed(fn):
    """`fn`, recomputed in the backward pass from its inputs, which are all it keeps (as jax.checkpoint with
    nothing saveable), as a custom VJP: an enclosing checkpoint's policy (a pipeline iteration's,
    jaxpar/pipeline/gpipe.py, which saves all but the weights) does not reach into it, where it would
    overrule a nested checkpoint's and keep every block's scores. Ring attention's folds and remat
    "selective"'s attention core (models/transformer.py) use it. The backward pass is traced after the
    forward's layout context has closed, so it reruns `fn` under the layout it was called in."""
    layout = current_layout()

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), args

    def backward(args, g):
        with use_layout(layout):
            return jax.vjp(fn, *args)[1](g)

    wrapped.defvjp(forward, backward)
    return wrapped


def _causal_update(stats, qg, k, v, q_pos, kv_pos):
    """`online_update` under the causal mask of these positions."""
    return online_update(stats, qg, k, v, block_mask(q_pos, kv_pos, causal=True))


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """softmax(q k^T / sqrt(d)) v with its causal mask, as the strategy runs it, chosen once: how the sequence
    is split (`impl`: dense | ring | allgather), the kernel on a device, and whether the core is recomputed
    in the backward pass from q, k, v alone (`recompute`: remat "selective", Korthikanti et al. 2022: its
    [b, heads, s, s] scores and probabilities never kept)."""
    impl: str = "dense"
    kernel: str = "dense"
    recompute: bool = False

    def __call__(self, q, k, v, positions, segments=None):
        core = functools.partial(attention, impl=self.impl, kernel=self.kernel, causal=True)
        if self.recompute:
            core = recomputed(core)
        return core(q, k, v, positions, segments)
