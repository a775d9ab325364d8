"""Splash attention: the Pallas TPU flash-attention kernel JAX ships, as an `attention_kernel`.

`jax.experimental.pallas.ops.tpu.splash_attention` ("sparse flash attention") is the fused kernel TPU
training stacks run (MaxText): an online-softmax forward pass and a custom VJP whose backward pass
recomputes each block's probabilities from the saved logsumexp, with the mask compiled into a table of
blocks to visit, so fully masked blocks are skipped and memory is linear in the sequence. On a TPU it is
compiled by Mosaic; on any other backend it runs in Pallas interpret mode (`interpret=True`: the same
kernel body evaluated by XLA on the host backend), which is how the CPU tests check it. On a GPU
interpret mode would run the kernel's grid as a sequential loop of tiny ops, so jaxpar/core/validate.py
refuses it there.

Shapes as in jaxpar/ops/attention.py: q [b, s, hq, d]; k, v [b, s, hkv, d] with hq a multiple of hkv. The
multi-head kernel maps query head h to K/V head h // (hq / hkv) itself (GQA without repeating K/V); the
batch is a vmap; scale 1/sqrt(d) is applied to q, as splash takes q already scaled.

What it supports, and what it does not:
  - causal or full masks, and segment ids (q_segments / kv_segments [b, s], documents packed in one
    sequence: a query sees a key only in its own segment), as `blockwise_attention` takes them.
  - Positions are NOT read. Splash's masks are index masks fixed when the kernel is built (numpy, at trace
    time), while positions are traced values, so the kernel is right where q_pos = kv_pos = 0..s-1 in
    index order: the training forward without context parallelism. Splash also takes a dense mask as a
    jax.Array, which could be built from positions, but it is [heads, s, s] booleans: the quadratic memory
    this kernel exists to avoid. So context parallelism (local queries against gathered K/V, zigzag
    layouts) is refused with splash in jaxpar/core/validate.py, as with cuDNN.
  - Self-attention only (sq == sk).
  - Any length: splash needs the key length to be a multiple of its key block, itself a multiple of 128
    (the TPU lane width), so a sequence that is not a multiple of 128 is padded to one, the padding in a
    segment of its own (id -1) that no real token is in; its rows are sliced off.

Under a layout (jaxpar/core/sharding.py) the kernel runs inside `jax.shard_map` over the batch and head
axes: Mosaic kernels cannot be partitioned by XLA, so each device calls it on its own batch rows and
heads. Where K/V heads are replicated across tensor ranks (tensor > kv_heads), each rank's query heads
all belong to one K/V head, which the rank slices out.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from jaxpar.core.sharding import current_layout
from jaxpar.core.rules import spec_entry

LANES = 128                 # splash's key blocks are multiples of the TPU lane width
BLOCKS = (512, 256, 128)    # the largest dividing the (padded) sequence is used for every block
PAD_SEGMENT = -1            # the segment id of padding tokens


def splash_attention(q, k, v, q_pos, kv_pos, *, causal: bool = True, q_segments=None, kv_segments=None):
    """softmax(q k^T / sqrt(d) + mask) v with splash; equals jaxpar.ops.attention.dense_attention where the
    positions are 0..s-1 in order (with segment ids: attention within each segment)."""
    del q_pos, kv_pos   # index masks: positions are 0..s-1 (module docstring)
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("splash_attention: give both q_segments and kv_segments, or neither")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"splash_attention: self-attention only, got {q.shape[1]} queries and {k.shape[1]} keys")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"splash_attention: kv heads {k.shape[2]} do not divide query heads {q.shape[2]}")
    layout = current_layout()
    if layout is None:
        return _local(q, k, v, q_segments, kv_segments, causal=causal, kv_head_axes=None)
    batch, heads, kv_heads = (spec_entry(layout.axes(n)) for n in ("batch", "act_heads", "act_kv_heads"))
    # K/V heads replicated while query heads are split (tensor > kv_heads): each rank slices its one.
    slice_axes = layout.axes("act_heads") if heads is not None and kv_heads is None else None
    local = functools.partial(_local, causal=causal, kv_head_axes=slice_axes)
    q_spec, kv_spec, seg_spec = P(batch, None, heads, None), P(batch, None, kv_heads, None), P(batch, None)
    segments = () if q_segments is None else (q_segments, kv_segments)
    # check_vma off: splash's pallas_call declares no varying mesh axes for its outputs, which check_vma
    # needs (jax/_src/pallas/core.py). Without it the transpose sums the cotangents of inputs over the mesh
    # axes their spec leaves out: the tensor ranks' shares of replicated K/V heads, as autodiff would.
    return jax.shard_map(lambda q, k, v, *seg: local(q, k, v, *(seg or (None, None))), mesh=layout.mesh,
                         in_specs=(q_spec, kv_spec, kv_spec) + (seg_spec,) * len(segments), out_specs=q_spec,
                         check_vma=False)(q, k, v, *segments)


def _local(q, k, v, q_seg, kv_seg, *, causal: bool, kv_head_axes):
    """Splash on this device's arrays: pad to a multiple of 128, scale q, vmap the kernel over the batch."""
    b, s, hq, d = q.shape
    if kv_head_axes:   # the one K/V head this rank's hq query heads read (consecutive, fewer than a group)
        group = (hq * jax.lax.axis_size(kv_head_axes)) // k.shape[2]
        first = jax.lax.axis_index(kv_head_axes) * hq // group
        k, v = (jax.lax.dynamic_slice_in_dim(t, first, 1, axis=2) for t in (k, v))
    padded = -(-s // LANES) * LANES
    if padded != s or q_seg is not None:
        q_seg = jnp.zeros((b, s), jnp.int32) if q_seg is None else q_seg.astype(jnp.int32)
        kv_seg = jnp.zeros((b, s), jnp.int32) if kv_seg is None else kv_seg.astype(jnp.int32)
        q_seg, kv_seg = (jnp.pad(x, ((0, 0), (0, padded - s)), constant_values=PAD_SEGMENT) for x in (q_seg, kv_seg))
    q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
    # splash's layout is head-major: [heads, s, d]
    q, k, v = (jnp.pad(t, ((0, 0), (0, padded - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for t in (q, k, v))
    kernel = _kernel(hq, padded, causal, jax.default_backend() != "tpu")
    if q_seg is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(qs, ks)))(
            q, k, v, q_seg, kv_seg)
    return out.transpose(0, 2, 1, 3)[:, :s]


def _kernel(heads: int, seq: int, causal: bool, interpret: bool):
    """The splash kernel for `heads` query heads over `seq` tokens (a multiple of 128). Its mask is turned
    into block tables in numpy, which splash caches per mask and block shape (process_mask's lru_cache); the
    tables become arrays of the trace that builds the kernel, so it is built per call, not kept. Every block
    size is the largest of BLOCKS dividing seq."""
    block = next(b for b in BLOCKS if seq % b == 0)
    mask = splash.CausalMask((seq, seq)) if causal else splash.FullMask((seq, seq))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)
