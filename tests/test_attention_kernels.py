"""The strategy option `attention_kernel` (jaxpar/ops/attention.py, jaxpar/ops/blockwise_attention.py).

- blockwise equals dense_attention (float32, 1e-5) in the output and the gradients of q, k, v: GQA, causal
  and not, a zigzag-style order of positions, segment ids, lengths that are not a multiple of the block;
- `attention_kernel = cudnn` is refused on CPU with a one-line error, before anything compiles;
- catalogue strategies trained with the blockwise kernel equal the one-device run (tests/harness.py);
- splash (Pallas interpret mode on CPU) equals dense_attention (float32, 1e-5) in the output and the gradients:
  GQA, causal and not, segment ids, a length that is not a multiple of 128 (padded), and under a layout (its
  shard_map over batch and heads, K/V heads replicated across tensor ranks); it is refused under context
  parallelism and on a GPU; catalogue strategies trained with it equal the one-device run (slow);
- XLA's memory analysis of llama-tiny's compiled training step on one device: from seq 256 to 1024 the
  blockwise kernel's temporary memory grows about linearly, the dense kernel's about quadratically.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main as cli
from jaxpar.core import validate
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.mesh import make_mesh
from jaxpar.core.sharding import model_layout, use_layout
from jaxpar.core.strategy import resolve_kernel
from jaxpar.ops.attention import context_attention, dense_attention, token_permutation
from jaxpar.ops.blockwise_attention import MASKED, blockwise_attention
from jaxpar.ops.splash_attention import splash_attention
from jaxpar.training.trainer import TrainConfig, Trainer
from tests.harness import assert_matches_one_device
from tests.test_context_parallel import layout_for

B, S, HQ, HKV, D = 2, 36, 4, 2, 8   # S = 36: blocks of 8 and 16 leave a ragged last block


def segmented_dense(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, causal):
    """dense_attention with a segment mask: the reference for packed documents."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, hkv, hq // hkv, d), k) / jnp.sqrt(d)
    allowed = q_seg[:, :, None] == kv_seg[:, None, :]
    if causal:
        allowed &= q_pos[:, :, None] >= kv_pos[:, None, :]
    probs = jax.nn.softmax(jnp.where(allowed[:, None, None], scores, MASKED), axis=-1)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, sq, hq, d)


def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(keys[0], (B, S, HQ, D)), jax.random.normal(keys[1], (B, S, HKV, D)),
            jax.random.normal(keys[2], (B, S, HKV, D)), jax.random.normal(keys[3], (B, S, HQ, D)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("segments", [False, True], ids=["", "segments"])
def test_blockwise_equals_dense_forward_and_gradients(causal, order, segments):
    q, k, v, cotangent = inputs()
    pos = jnp.broadcast_to(jnp.asarray(token_permutation(S, 2, order), jnp.int32), (B, S))
    if segments:   # three documents packed per row, the rows cut differently
        seg = jnp.asarray(np.stack([np.arange(S) * 3 // S, np.arange(S) * 3 // (S + 9)]), jnp.int32)
        seg = jnp.take_along_axis(seg, pos, axis=1)   # each token keeps its document in any order
        reference = lambda q, k, v: segmented_dense(q, k, v, pos, pos, seg, seg, causal=causal)
    else:
        seg = None
        reference = lambda q, k, v: dense_attention(q, k, v, pos, pos, causal=causal)
    kernel = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, causal=causal, q_segments=seg, kv_segments=seg,
                                                 blocks=(8, 16))
    out, vjp = jax.vjp(kernel, q, k, v)
    ref_out, ref_vjp = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", vjp(cotangent), ref_vjp(cotangent)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_blockwise_default_blocks_and_cross_lengths():
    """One block (the defaults, longer than the sequence) and queries against a longer key sequence."""
    q, k, v, _ = inputs()
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    q_pos = kv_pos[:, S - 12:]
    got = blockwise_attention(q[:, S - 12:], k, v, q_pos, kv_pos, causal=True, blocks=(5, 7))
    np.testing.assert_allclose(got, dense_attention(q[:, S - 12:], k, v, q_pos, kv_pos, causal=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blockwise_attention(q, k, v, kv_pos, kv_pos),
                               dense_attention(q, k, v, kv_pos, kv_pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["allgather", "ring"])
def test_context_parallel_with_blockwise_kernel_equals_dense(impl):
    """Under context parallelism (zigzag, batch on data, heads on tensor) all-gather attention runs its local
    queries through the blockwise kernel (ring folds with its block update whatever the kernel)."""
    lay = layout_for("data=2,context=2,tensor=2")
    seq = 16
    q, k, v, cotangent = (x[:, :seq] for x in inputs())
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (B, seq))
    perm = token_permutation(seq, 2, "zigzag")
    inv = np.argsort(perm)

    @jax.jit
    def both(q, k, v, w):
        with use_layout(lay):
            split = lambda q, k, v: context_attention(q, k, v, positions[:, perm], impl=impl, kernel="blockwise")
            out, vjp = jax.vjp(split, q[:, perm], k[:, perm], v[:, perm])
            got = [x[:, inv] for x in (out, *vjp(w[:, perm]))]
        ref, ref_vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, positions, positions), q, k, v)
        return got, [ref, *ref_vjp(w)]

    got, want = both(q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def vjp_pair(kernel, reference, q, k, v, w):
    """(kernel's output and dq, dk, dv for cotangent w, the reference's), from one jitted function."""
    def both(q, k, v, w):
        (out, vjp), (ref, ref_vjp) = jax.vjp(kernel, q, k, v), jax.vjp(reference, q, k, v)
        return [out, *vjp(w)], [ref, *ref_vjp(w)]
    return jax.jit(both)(q, k, v, w)


@pytest.mark.parametrize("causal, segments", [(True, False), (False, True)], ids=["causal", "full-segments"])
def test_splash_equals_dense_forward_and_gradients(causal, segments):
    """GQA (4 query heads on 2 K/V heads), S = 36 tokens padded to splash's 128 (in a segment of their own)."""
    q, k, v, cotangent = inputs()
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    seg = jnp.asarray(np.stack([np.arange(S) * 3 // S, np.arange(S) * 3 // (S + 9)]), jnp.int32) if segments else None
    kernel = lambda q, k, v: splash_attention(q, k, v, pos, pos, causal=causal, q_segments=seg, kv_segments=seg)
    reference = ((lambda q, k, v: segmented_dense(q, k, v, pos, pos, seg, seg, causal=causal)) if segments
                 else (lambda q, k, v: dense_attention(q, k, v, pos, pos, causal=causal)))
    got, want = vjp_pair(kernel, reference, q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_splash_under_a_layout_with_replicated_kv_heads_equals_dense():
    """Under data=2 x tensor=4 with 2 K/V heads (replicated across tensor ranks, each rank's 2 query heads
    reading one), at S = 128 (no padding): the shard_map over batch and heads, its K/V head slice, and the
    transpose summing the replicated K/V's gradients over the ranks."""
    strategy = parse_strategy("data=2,tensor=4").resolved(8)
    lay = model_layout(make_mesh(strategy, jax.devices()[:8]), strategy, parse_model("llama-tiny:kv_heads=2,heads=8"))
    rng = np.random.default_rng(0)
    q, k, v, w = (rng.standard_normal((2, 128, h, 8), np.float32) for h in (8, 2, 2, 8))
    pos = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (2, 128))

    def kernel(q, k, v):
        with use_layout(lay):
            return splash_attention(q, k, v, pos, pos, causal=True)

    got, want = vjp_pair(kernel, lambda q, k, v: dense_attention(q, k, v, pos, pos, causal=True), q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_splash_refused_under_context_parallelism_and_on_gpu():
    model = parse_model("llama-tiny")
    st = parse_strategy("context=2").with_options(attention_kernel="splash", attention="allgather")
    with pytest.raises(ConfigError, match="attention_kernel=splash with context=2 is not supported"):
        validate.check(model, st.resolved(2), batch=2, seq=16)
    splash = parse_strategy("data=1").with_options(attention_kernel="splash")
    validate.check(model, splash.resolved(1), batch=2, seq=16)
    with pytest.raises(ConfigError, match="attention_kernel=splash is a TPU .Mosaic. kernel"):
        validate.check_backend(splash, "gpu")
    validate.check_backend(splash, "cpu")   # interpret mode: the test path


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp8", "tp4-sp"])
def test_splash_strategy_matches_one_device(mesh):
    """Interpret mode makes each about 11 s of compiling on 2 cores: the kernel-level cases above stay in make test."""
    assert_matches_one_device("llama-tiny", mesh, attention_kernel="splash")


def test_auto_is_blockwise_on_cpu():
    assert resolve_kernel("auto", jnp.bfloat16) == "blockwise"
    assert resolve_kernel("dense") == "dense"


def test_cudnn_is_refused_on_cpu_before_compiling(capsys):
    strategy = parse_strategy("data=1").with_options(attention_kernel="cudnn", dtype="bfloat16")
    with pytest.raises(ConfigError, match="attention_kernel=cudnn needs an NVIDIA GPU, but the devices are cpu"):
        validate.check_backend(strategy, jax.devices()[0].platform)
    code = cli.main(["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", "1", "--batch", "8", "--seq", "16",
                     "--no-progress", "--dtype", "bfloat16", "--attention-kernel", "cudnn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "attention_kernel=cudnn needs an NVIDIA GPU" in err[0], err


def test_cudnn_needs_bfloat16_and_no_context_parallelism():
    model = parse_model("llama-tiny")
    with pytest.raises(ConfigError, match="needs dtype=bfloat16"):
        validate.check(model, parse_strategy("data=1").with_options(attention_kernel="cudnn").resolved(1), batch=2, seq=16)
    st = parse_strategy("context=2").with_options(attention_kernel="cudnn", attention="ring", dtype="bfloat16")
    with pytest.raises(ConfigError, match="context=2 is not supported"):
        validate.check(model, st.resolved(2), batch=2, seq=16)


@pytest.mark.parametrize("mesh", ["fsdp8", "tp4-sp"])
def test_blockwise_strategy_matches_one_device(mesh):
    assert_matches_one_device("llama-tiny", mesh, attention_kernel="blockwise")


def temp_bytes(kernel: str, seq: int) -> int:
    tr = Trainer(parse_model("llama-tiny:max_seq=1024"), parse_strategy("data=1").with_options(attention_kernel=kernel),
                 TrainConfig(batch=1, seq=seq, steps=1), devices=jax.devices()[:1])
    return tr.lower_step().compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_dense_quadratically():
    """seq x4: dense's temporaries (the [heads, s, s] scores of every layer) grow ~x16, blockwise's (one
    block of scores, and activations linear in s) by less than the sequence."""
    dense = temp_bytes("dense", 1024) / temp_bytes("dense", 256)
    blockwise = temp_bytes("blockwise", 1024) / temp_bytes("blockwise", 256)
    assert dense > 10, dense
    assert blockwise < 4.8, blockwise   # x4 (the 256-token block grows to 512) and below
