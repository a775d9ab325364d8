"""Context parallelism: ring and all-gather attention equal dense attention (forward and gradients),
for both token layouts, and compile to the collectives they promise."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax starts

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.core.mesh import make_mesh
from jaxpar.ops.attention import dense_attention
from jaxpar.ops.attention import context_attention, token_permutation
from jaxpar.core.validate import check_context_parallel
from jaxpar.core.sharding import Layout, use_layout
from jaxpar.core.strategy import parse_inline

TOL = 1e-5
HEADS, HEAD_DIM, BATCH = 4, 8, 2


@functools.cache
def layout_for(spec: str) -> Layout:
    strategy = parse_inline(spec)
    strategy = strategy.resolved(strategy.num_devices)
    return Layout(make_mesh(strategy, jax.devices()[:strategy.num_devices]), strategy)


def random_inputs(seq: int, kv_heads: int, seed: int = 0):
    """q, k, v and an output cotangent w (numpy: no compiles spent on random numbers)."""
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (BATCH, seq, HEADS, HEAD_DIM), (BATCH, seq, kv_heads, HEAD_DIM)
    return tuple(rng.standard_normal(shape, np.float32) for shape in (q_shape, kv_shape, kv_shape, q_shape))


# ---- numerics: context-parallel == dense, forward and gradients --------------------------------

# Together these cover: ring and all-gather x {causal, non-causal} x GQA ratios {1, 2, 4} x
# context {2, 4, 8} x {contiguous, zigzag}, and batch on `data` with heads on `tensor` at once.
CASES = [
    # impl,       mesh,                       layout,       causal, hq/hkv
    ("ring",      "context=4",                "contiguous", True,  1),
    ("ring",      "context=8",                "zigzag",     True,  4),
    ("ring",      "context=8",                "contiguous", False, 2),
    ("ring",      "data=2,context=2,tensor=2", "zigzag",     True,  2),
    ("allgather", "context=2",                "zigzag",     False, 2),
    ("allgather", "context=4",                "contiguous", True,  4),
    ("allgather", "context=8",                "zigzag",     True,  1),
    ("allgather", "data=2,context=2,tensor=2", "contiguous", True,  2),
]


@pytest.mark.parametrize("impl,spec,layout,causal,groups", CASES,
                         ids=["-".join(map(str, c)).replace("=", "").replace(",", "_") for c in CASES])
def test_matches_dense(impl, spec, layout, causal, groups):
    lay = layout_for(spec)
    context = lay.mesh.shape["context"]
    seq = 4 * context  # two chunks of two tokens per device under zigzag
    q, k, v, w = random_inputs(seq, HEADS // groups)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (BATCH, seq))
    perm = token_permutation(seq, context, layout)
    inv = np.argsort(perm)

    def grads(attn, q, k, v, w):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(w)  # gradients of sum(out * w) wrt q, k, v

    @jax.jit
    def both(q, k, v, w):
        # Context parallel on the laid-out sequence (what the training step feeds the model) ...
        with use_layout(lay):
            pos = positions[:, perm]
            out, g = grads(lambda q, k, v: context_attention(q, k, v, pos, impl=impl, causal=causal),
                           q[:, perm], k[:, perm], v[:, perm], w[:, perm])
            out, g = out[:, inv], [x[:, inv] for x in g]  # ... back in natural order
        # ... against plain attention on the natural order.
        ref, g_ref = grads(lambda q, k, v: dense_attention(q, k, v, positions, positions, causal=causal),
                           q, k, v, w)
        return (out, *g), (ref, *g_ref)

    got, want = both(q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL, err_msg=name)


def test_without_context_axis_is_dense():
    """No layout, or a mesh whose context axis is 1: exactly dense attention."""
    q, k, v, _ = random_inputs(8, 2)
    pos = np.broadcast_to(np.arange(8, dtype=np.int32), (BATCH, 8))
    ref = dense_attention(q, k, v, pos, pos, causal=True)
    np.testing.assert_array_equal(context_attention(q, k, v, pos, impl="ring", causal=True), ref)
    with use_layout(layout_for("tensor=2")):
        np.testing.assert_array_equal(context_attention(q, k, v, pos, impl="allgather", causal=True), ref)


# ---- layouts -----------------------------------------------------------------------------------

def test_token_permutation():
    np.testing.assert_array_equal(token_permutation(8, 4, "contiguous"), np.arange(8))
    np.testing.assert_array_equal(token_permutation(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(token_permutation(8, 4, "zigzag"), [0, 7, 1, 6, 2, 5, 3, 4])
    assert sorted(token_permutation(96, 8, "zigzag")) == list(range(96))


def test_zigzag_balances_causal_work():
    """Unmasked (q, k) pairs per device: zigzag equal on every device, contiguous ~(2c-1)x apart."""
    seq, c = 64, 4

    def work(layout):
        local = token_permutation(seq, c, layout).reshape(c, -1)
        return (local + 1).sum(axis=1)  # query at position p sees p+1 keys

    assert len(set(work("zigzag"))) == 1
    assert work("contiguous").max() / work("contiguous").min() > 2 * c - 2


# ---- compiled communication --------------------------------------------------------------------

COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (collective-permute|all-gather|reduce-scatter|"
                        r"all-reduce|all-to-all)(?:-start)?\((.*?)\)(.*)$")


def collectives(hlo: str):
    """[(kind, phase, n_operands, times executed, line)] for each collective op in compiled HLO.

    Times executed multiplies the known trip counts of the while loops whose body holds the op
    (nested loops too). phase is backward when the op comes from a transpose (autodiff), else forward.
    """
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = head.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    parent = {}  # body computation -> (computation holding the while, trip count)
    for name, lines in comps.items():
        for line in lines:
            loop = re.search(r" while\(.*body=%(\S+?)[,\s].*known_trip_count\":\{\"n\":\"(\d+)\"", line)
            if loop:
                parent[loop.group(1)] = (name, int(loop.group(2)))

    def times(comp):
        return parent[comp][1] * times(parent[comp][0]) if comp in parent else 1

    out = []
    for name, lines in comps.items():
        for line in lines:
            m = COLLECTIVE.match(line)
            if m:
                phase = "backward" if "transpose(" in line else "forward"
                out.append((m.group(2), phase, m.group(3).count("%"), times(name), line))
    return out


def compiled_grad_hlo(impl: str, spec: str, seq: int, kv_heads: int) -> str:
    lay = layout_for(spec)

    def arg(shape, names, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=lay.activation(*names))

    def f(q, k, v, pos, cotangent):  # forward + backward, no loss reduction to add collectives
        with use_layout(lay):
            out, vjp = jax.vjp(lambda q, k, v: context_attention(q, k, v, pos, impl=impl, causal=True), q, k, v)
            return out, vjp(cotangent)

    args = (arg((1, seq, HEADS, HEAD_DIM), ("batch", "seq", "act_heads", None)),
            arg((1, seq, kv_heads, HEAD_DIM), ("batch", "seq", "act_kv_heads", None)),
            arg((1, seq, kv_heads, HEAD_DIM), ("batch", "seq", "act_kv_heads", None)),
            arg((1, seq), ("batch", "seq"), jnp.int32),
            arg((1, seq, HEADS, HEAD_DIM), ("batch", "seq", "act_heads", None)))
    return jax.jit(f).lower(*args).compile().as_text()


def test_ring_communicates_by_permutes_only():
    """Forward: K, V and positions each travel context-1 hops (XLA keeps them as three separate
    collective-permutes inside the scan's while loop, trip count context-1; none after the last
    block). Backward: dK, dV travel back the same number of hops. No all-gather anywhere."""
    context = 4
    ops = collectives(compiled_grad_hlo("ring", "context=4,tensor=2", seq=32, kv_heads=2))
    assert ops and {kind for kind, *_ in ops} == {"collective-permute"}, [o[-1] for o in ops]
    forward = sum(n * t for _, phase, n, t, _ in ops if phase == "forward")
    backward = sum(n * t for _, phase, n, t, _ in ops if phase == "backward")
    assert forward == 3 * (context - 1)   # k, v, positions
    assert backward == 2 * (context - 1)  # dk, dv
    # Only the K/V heads travel (GQA): every float permute moves one local K/V block, [1, 8, 1, 8].
    for *_, line in ops:
        if line.split("= ")[1].startswith("f32"):
            assert line.split("= ")[1].startswith("f32[1,8,1,8]"), line


def test_allgather_gathers_forward_and_reduce_scatters_backward():
    ops = collectives(compiled_grad_hlo("allgather", "context=4,tensor=2", seq=32, kv_heads=2))
    kinds = {(kind, phase) for kind, phase, *_ in ops}
    assert kinds == {("all-gather", "forward"), ("reduce-scatter", "backward")}, [o[-1] for o in ops]
    assert all("{'context'}" in line for *_, line in ops), "collectives must run over the context axis"
    assert sum(n for kind, _, n, _, _ in ops if kind == "all-gather") == 3      # k, v, positions
    assert sum(n for kind, _, n, _, _ in ops if kind == "reduce-scatter") == 2  # dk, dv


# ---- configuration errors ----------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    ((100, 4, "zigzag", "ring", 8, 4, 1), "zigzag needs seq divisible by 2 x context: seq=100, context=4"),
    ((30, 4, "contiguous", "allgather", 8, 4, 1), "context=4 does not divide seq=30"),
    ((64, 4, "contiguous", "dense", 8, 4, 1),
     "attention=dense cannot shard the sequence: context=4; use --attention ring or allgather"),
    ((64, 4, "zigzag", "ring", 6, 2, 4), "tensor=4 does not divide heads=6"),
    ((64, 4, "zigzag", "ring", 8, 2, 4), "tensor=4 does not divide kv_heads=2"),
    ((64, 4, "zigzag", "ring", 8, 3, 1), "kv_heads=3 does not divide heads=8"),
    ((64, 4, "diagonal", "ring", 8, 4, 1), "cp_layout='diagonal' is not one of contiguous | zigzag"),
    ((64, 4, "zigzag", "flash", 8, 4, 1), "attention='flash' is not one of dense | ring | allgather"),
])
def test_check_context_parallel_errors(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_context_parallel(*args)


def test_check_context_parallel_accepts():
    check_context_parallel(64, 4, "zigzag", "ring", 8, 4, 2)
    check_context_parallel(64, 1, "contiguous", "dense", 8, 4, 2)
    check_context_parallel(12, 3, "contiguous", "allgather", 8, 8, 1)
    with pytest.raises(ConfigError, match="zigzag needs seq divisible"):
        token_permutation(10, 4, "zigzag")
