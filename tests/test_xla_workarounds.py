"""Each compiler workaround of jaxpar/xla_workarounds.py, compiled with and without it.

For each: a training step on the smallest layout that shows it, compiled twice (the second time inside
`xla_workarounds.disabled(name)`), the collectives of both tallied from the optimised HLO, and the
difference the module docstring describes asserted; then both executables run one step from the same
state on the same batch, and the loss is the same (a workaround moves data, never changes a number).
A fresh Trainer per compile: a jitted function keeps the trace it made first, whatever the switch says.
"""
import collections
import contextlib
import functools

import jax
import numpy as np
import pytest

from jaxpar import xla_workarounds
from jaxpar.analysis import comm
from jaxpar.analysis.tally import collective_ops
from jaxpar.core.strategy import parse_strategy
from jaxpar.cost.compiler import COMPILERS
from jaxpar.models.config import parse_model
from jaxpar.training.data import Synthetic
from jaxpar.training.trainer import TrainConfig, Trainer, TrainState

TC = TrainConfig(batch=4, seq=16, steps=1)
F32 = 4

# fsdp x tensor with sequence parallelism and full remat: every use of `gathered` (norm scales, o-proj,
# head) and the plain `lookup` (the table's width on fsdp, its rows on tensor).
FSDP_TP = ("llama-tiny", "fsdp=2,tensor=2", (("sequence_parallel", True), ("remat", "full")))
# fsdp x expert: the batch split fsdp-major, the table's width on fsdp: `lookup`'s split form. A dense
# model: the expert axis is one more batch axis.
FSDP_EP = ("llama-tiny", "fsdp=2,expert=2", ())
# ZeRO-1 over data x tensor, the vocab on tensor: the table whole over data, its gradient's width sharded over
# it (`lookup`'s custom VJP; plan's llama3-8b pick on 8 H100 is this layout).
ZERO1_TP = ("llama-tiny", "data=2,tensor=2", (("zero", 1), ("sequence_parallel", True)))
# a batch-sharded router: `top_k`.
MOE_DP = ("moe-tiny", "data=2", ())

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


@functools.cache
def step(case: tuple, off: str | None):
    """(trainer, the compiled step, its collectives as a Counter of (kind, axes, phase, bytes) per
    execution) for `case`, with the workaround `off` disabled (None: all in force)."""
    model, mesh, options = case
    strategy = parse_strategy(mesh).with_options(**dict(options))
    with xla_workarounds.disabled(off) if off else contextlib.nullcontext():
        tr = Trainer(parse_model(model), strategy, TC, devices=jax.devices()[:strategy.num_devices])
        compiled = tr.lower_step().compile(comm.ANALYSIS_COMPILER_OPTIONS)
    shape = tuple(tr.mesh.shape.values())
    ops = collective_ops(compiled.as_text(), tr.mesh.axis_names, np.arange(tr.mesh.size).reshape(shape))
    return tr, compiled, collections.Counter((o.kind, o.axes, o.phase, o.bytes) for o in ops for _ in range(o.times))


def with_and_without(case: tuple, name: str):
    """(collectives only with the workaround, collectives only without it), each a Counter."""
    on, off = step(case, None)[2], step(case, name)[2]
    return on - off, off - on


def assert_same_loss(case: tuple, name: str) -> None:
    tr, on, _ = step(case, None)
    off = step(case, name)[1]
    state = host_state(tr)
    batch = tr.batch(Synthetic(parse_model(case[0]).vocab, seed=0), 0)
    losses = [float(compiled(jax.device_put(state, tr.state_shardings), batch)[1]["loss"]) for compiled in (on, off)]
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def assert_same_gradients(case: tuple, name: str) -> None:
    """The loss and every parameter's gradient of one batch, traced with and without the workaround, equal
    (float32; a gradient's sums may run in another order): for a workaround that states a backward."""
    tr = step(case, None)[0]
    state = host_state(tr)
    params = jax.device_put(state.params, tr.state_shardings.params)
    batch = tr.batch(Synthetic(parse_model(case[0]).vocab, seed=0), 0)
    out = []
    for off in (None, name):
        with xla_workarounds.disabled(off) if off else contextlib.nullcontext():
            loss, _, grads = jax.jit(tr._loss_and_grads)(params, batch)
        out.append((float(loss), jax.tree.map(np.asarray, grads)))
    (loss_on, on), (loss_off, off) = out
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-6)
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(on))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()), on, off)


def host_state(tr: Trainer):
    """A train state on the host: random parameters (std 0.05), zero optimizer state (no init compiled)."""
    rng = np.random.default_rng(0)
    abstract = tr.abstract_state()
    params = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(s.dtype), abstract.params)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), (abstract.opt_state, abstract.step))
    return TrainState(params, *zeros)


def test_gathered_gathers_each_weight_once():
    cfg = parse_model(FSDP_TP[0])
    norm = F32 * cfg.d_model                                       # a norm scale, whole
    wo = F32 * cfg.heads * cfg.head_dim * cfg.d_model // 2        # o-proj, its heads on tensor
    head = F32 * cfg.d_model * cfg.vocab // 2                      # the head, its vocab on tensor
    only_on, only_off = with_and_without(FSDP_TP, "gathered")
    assert not only_on
    # left to the partitioner: each norm scale (two per layer and the final one) and o-proj gathered again
    # for the input gradient, the head once more for its second dot
    assert only_off == {("all-gather", ("fsdp",), "backward", norm): 2 * cfg.layers + 1,
                        ("all-gather", ("fsdp",), "backward", wo): cfg.layers,
                        ("all-gather", ("fsdp",), "forward", head): 1}
    assert_same_loss(FSDP_TP, "gathered")


def test_lookup_over_fsdp_x_tensor_moves_rows_by_one_all_to_all():
    on, off = step(FSDP_TP, None)[2], step(FSDP_TP, "lookup")[2]
    assert {k for k in on if k[0] == "collective-permute"} == set()
    assert any(k[:3] == ("all-to-all", ("fsdp",), "forward") for k in on)
    assert any(k[:3] == ("all-to-all", ("fsdp",), "backward") for k in on)
    # without it: the rows replicated over fsdp x tensor and moved by collective-permutes
    assert any(k[:2] == ("collective-permute", ("fsdp", "tensor")) for k in off)
    assert_same_loss(FSDP_TP, "lookup")


def test_lookup_split_over_fsdp_x_expert_moves_rows_by_one_all_to_all():
    on, off = step(FSDP_EP, None)[2], step(FSDP_EP, "lookup")[2]
    assert {k for k in on if k[0] == "collective-permute"} == set()
    assert any(k[:3] == ("all-to-all", ("fsdp",), "forward") for k in on)
    assert any(k[:3] == ("all-to-all", ("fsdp",), "backward") for k in on)
    assert any(k[:2] == ("collective-permute", ("fsdp", "expert")) for k in off)
    assert_same_loss(FSDP_EP, "lookup")


def test_lookup_under_zero1_scatters_the_gradient_in_its_shard_layout():
    on, off = step(ZERO1_TP, None)[2], step(ZERO1_TP, "lookup")[2]
    # without it: the rows' gradient gathered over data in the backward (the partitioner's rematerialisation
    # towards the gradient's shard) and rows and ids moved by collective-permutes over data x tensor
    assert any(k[:3] == ("all-gather", ("data",), "backward") for k in off)
    assert any(k[:2] == ("collective-permute", ("data", "tensor")) for k in off)
    # with it: the rows' gradient to the width layout by one all-to-all over data, nothing gathered back
    assert not any(k[:3] == ("all-gather", ("data",), "backward") or k[0] == "collective-permute" for k in on)
    assert any(k[:3] == ("all-to-all", ("data",), "backward") for k in on - off)
    assert_same_gradients(ZERO1_TP, "lookup")


def test_top_k_keeps_the_router_scores_batch_sharded():
    cfg = parse_model(MOE_DP[0])
    only_on, only_off = with_and_without(MOE_DP, "top_k")
    assert not only_on
    # without it: each layer's scores [batch, seq, experts] gathered over the batch's axis
    scores = F32 * TC.batch * TC.seq * cfg.experts
    assert only_off == {("all-gather", ("data",), "forward", scores): cfg.layers}
    assert_same_loss(MOE_DP, "top_k")


def test_loop_variant_keeps_no_score_block_per_layer_in_ring_attention():
    """Ring attention over context=4 inside the scan over layers: without the barrier JAX hoists what the
    positions alone decide out of the layer loop, and XLA:CPU keeps, for every layer and ring step, each
    (query half, key half) pair's float32 scores and boolean mask. Hand count of the scores alone:
    layers x (context - 1) steps x 4 pairs x [b, kv heads, group, s/8, s/8] float32."""
    cfg = parse_model("llama-tiny:max_seq=512")
    strategy = parse_strategy("context=4").with_options(attention="ring")
    tc = TrainConfig(batch=2, seq=512, steps=1)
    temps, losses = [], []
    for off in (None, "loop_variant"):
        with xla_workarounds.disabled(off) if off else contextlib.nullcontext():
            tr = Trainer(cfg, strategy, tc, devices=jax.devices()[:4])
            compiled = tr.lower_step().compile(comm.ANALYSIS_COMPILER_OPTIONS)
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        batch = tr.batch(Synthetic(cfg.vocab, seed=0), 0)
        losses.append(float(compiled(jax.device_put(host_state(tr), tr.state_shardings), batch)[1]["loss"]))
    piece = tc.seq // 4 // 2
    scores = cfg.layers * 3 * 4 * tc.batch * cfg.kv_heads * (cfg.heads // cfg.kv_heads) * piece * piece * F32
    print(f"\nring attention temp: {temps[0]:,} B with the barrier, {temps[1]:,} without; scores by hand {scores:,}")
    assert temps[1] - temps[0] >= scores, (temps, scores)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_the_initializer_compiled_quickly_writes_the_same_bits():
    """compile_initializer's XLA:CPU options against XLA's default level (2, expensive passes on) for the
    same lowered initialiser; level 0, which the suite's XLA_FLAGS choose for speed, changes the truncated
    normals' bits (9 of llama-tiny's 39 arrays), and is caught here."""
    tr = Trainer(parse_model("llama-tiny"), parse_strategy("fsdp=2,tensor=2"), TC, devices=jax.devices()[:4])
    lowered = tr.lower_init()
    default = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
    quick = jax.tree.leaves(lowered.compile(compiler_options=xla_workarounds.INITIALIZER_CPU_OPTIONS)())
    plain = jax.tree.leaves(lowered.compile(compiler_options=default)())
    assert len(quick) == len(plain) > 30
    for a, b in zip(quick, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    level0 = jax.tree.leaves(lowered.compile(compiler_options={**default, "xla_backend_optimization_level": 0})())
    assert any(not np.array_equal(a, b) for a, b in zip(level0, plain))  # the check can fail


def test_disabled_names_only_known_workarounds():
    with pytest.raises(ValueError, match="unknown"):
        with xla_workarounds.disabled("gatherd"):
            pass
    with xla_workarounds.disabled("lookup"):
        assert not xla_workarounds.active("lookup") and xla_workarounds.active("gathered")
    assert xla_workarounds.active("lookup")


def test_the_cost_models_compilers_know_which_backends_run_ragged_all_to_all():
    """The cost model's Compiler records hold this module's rule as data (so that it imports no JAX)."""
    assert {name: c.ragged_all_to_all for name, c in COMPILERS.items()} == {
        name: xla_workarounds.ragged_all_to_all_runs(name) for name in COMPILERS} == {"gpu": True, "tpu": True, "cpu": False}
