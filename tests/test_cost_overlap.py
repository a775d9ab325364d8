"""jaxpar.cost.overlap: the time model hides what jaxpar's overlap options issue beside compute, no more.

References: the same estimate without the option (compute, collectives and bytes must not move: the
options change the schedule, not the partitioning), and the seconds of the hidden collectives summed
from the prediction by hand (kind, axes and phase read off each record)."""
from __future__ import annotations

import dataclasses

import pytest

from jaxpar.cost import flops as cost_flops
from jaxpar.cost import time as cost_time
from jaxpar.cost.estimate import estimate
from jaxpar.cost.hardware import load_hardware
from jaxpar.cost.software import MEGATRON_CORE
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import parse_strategy

M, HW = parse_model("llama3-8b"), load_hardware("h100-sxm")


def _run(mesh: str, batch: int = 256, **options):
    st = parse_strategy(mesh).with_options(**{"remat": "full", **options})
    st = st.resolved(st.num_devices)
    return st, estimate(M, st, HW, batch, 4096)


def _seconds(st, records) -> dict[str, float]:
    return cost_time.comm_seconds(tuple(records), st, HW)


def test_no_option_hides_nothing():
    st, e = _run("fsdp=4,tensor=2", sequence_parallel=True)
    assert e.time.data == e.time.data_total > 0
    assert e.time.tensor == pytest.approx(_seconds(st, e.predicted)["tensor"])


def test_fsdp_prefetch_hides_the_weight_gathers_only():
    st0, base = _run("fsdp=8")
    st, e = _run("fsdp=8", fsdp_prefetch=True)
    assert e.predicted == base.predicted and e.time.compute == base.time.compute
    gathers = [c for c in e.predicted if c[0] == "all-gather" and c[2] in ("forward", "backward")]
    assert gathers and e.time.data_total == pytest.approx(base.time.data_total)
    assert e.time.data == pytest.approx(base.time.data - _seconds(st, gathers)["data"])
    assert e.time.data >= _seconds(st, [c for c in e.predicted if c[0] == "reduce-scatter"])["data"] > 0


def test_tpu_overlap_hides_the_gradient_sums_over_context_too():
    """tpu_overlap overlaps the data-parallel gradient all-reduces with the backward pass: over data x context
    as over data alone (the context ranks hold other tokens of the same sequences, so their gradients are
    summed with the data ranks'); the context ring's permutes stay for the attention term."""
    hw = load_hardware("tpu-v5p")
    st = parse_strategy("data=2,context=4").with_options(remat="full", attention="ring", xla_preset="tpu_overlap")
    st = st.resolved(8)
    e = estimate(M, st, hw, 16, 4096)
    sums = [c for c in e.predicted if c[0] == "all-reduce" and "context" in c[1] and c[2] == "backward"]
    assert sums and e.time.data_total > 0
    assert e.time.data == pytest.approx(e.time.data_total - cost_time.comm_seconds(tuple(sums), st, hw)["data"])


def test_collective_matmul_hides_the_tensor_rings_up_to_the_compute():
    st, e = _run("data=4,tensor=2", sequence_parallel=True, overlap="collective_matmul")
    _, base = _run("data=4,tensor=2", sequence_parallel=True)
    hidden = _seconds(st, [c for c in e.predicted if "tensor" in c[1] and c[0] != "all-reduce"])["tensor"]
    assert hidden > 0 and e.time.tensor == pytest.approx(_seconds(st, e.predicted)["tensor"] - hidden)
    assert e.time.total < base.time.total
    # never more than the projection GEMMs there are: on links 100x slower every ring outlasts the matmul
    # beside it, so the forward, rerun and input-gradient GEMMs (3/4 of them under remat full) hide that
    # much, and the attention cores and the elementwise work hide none of the rest
    slow = dataclasses.replace(HW, intra_bw=HW.intra_bw / 100)
    slow_est = estimate(M, st, slow, 256, 4096)
    total = cost_time.comm_seconds(slow_est.predicted, st, slow)["tensor"]
    assert total > slow_est.time.compute
    assert total - 3 / 4 * slow_est.busy[0] <= slow_est.time.tensor < total - 0.5 * slow_est.busy[0]
    assert slow_est.time.tensor > total - slow_est.time.compute


def test_windowed_einsum_needs_sequence_parallelism():
    """Without SP tensor parallelism's collectives are all-reduces: XLA's windowed einsum takes none."""
    _, plain = _run("data=4,tensor=2")
    _, e = _run("data=4,tensor=2", xla_preset="gpu_windowed_einsum")
    assert e.time.tensor == pytest.approx(plain.time.tensor) and plain.time.tensor > 0
    _, sp = _run("data=4,tensor=2", sequence_parallel=True, xla_preset="gpu_windowed_einsum")
    assert sp.time.tensor < 0.01 * plain.time.tensor


def test_megatron_keeps_its_own_fractions_and_wrong_presets_are_refused():
    st = parse_strategy("fsdp=8").with_options(remat="full")
    e = estimate(M, st.with_options(fsdp_prefetch=True).resolved(8), HW, 256, 4096, software=MEGATRON_CORE)
    f = estimate(M, st.resolved(8), HW, 256, 4096, software=MEGATRON_CORE)
    assert e.time == f.time
    with pytest.raises(ConfigError, match="tpu_overlap is for TPU"):
        _run("fsdp=8", xla_preset="tpu_overlap")


def test_each_tensor_collective_hides_under_its_own_gemm_only():
    """time.decomposed_hideable by hand: two projection GEMMs of 3 and 1 FLOP units, one collective of equal
    seconds beside each; without a rerun, 2 of the 3 GEMM passes (forward, input gradient) run beside one."""
    ops = [(1, 3.0), (1, 1.0)]
    # 6 s of GEMMs: 4 s beside the collectives, 3 s for the first op, 1 s for the second
    assert cost_time.decomposed_hideable(2.0, 6.0, ops, rerun=False) == pytest.approx(1.0 + 1.0)
    assert cost_time.decomposed_hideable(4.0, 6.0, ops, rerun=False) == pytest.approx(2.0 + 1.0)
    assert cost_time.decomposed_hideable(8.0, 6.0, ops, rerun=False) == pytest.approx(3.0 + 1.0)
    # a full rerun adds a forward pass with its collectives: 3 of 4 GEMM passes, 4.5 s and 1.5 s of 8 s
    assert cost_time.decomposed_hideable(8.0, 8.0, ops, rerun=True) == pytest.approx(4.0 + 1.5)


def test_a_narrow_gemm_under_wide_tp_hides_less_than_its_collective():
    """Llama 3 8B under TP8: the QKV (6,144 wide) and output projection GEMMs are smaller than the MLP's, so
    their collectives stay partly exposed; the projection list is the model's, counted by hand."""
    m = M
    d, f = 4096, 14336
    assert cost_flops.projection_ops(m) == ((32, 2.0 * d * 6144), (32, 2.0 * d * d), (32, 2.0 * d * f * 2),
                                            (32, 2.0 * f * d))
    ops = cost_flops.projection_ops(m)
    flops = sum(n * g for n, g in ops)
    one = flops / 128 * 2 / 3            # tensor seconds that make each collective as long as the mean GEMM
    hidden = cost_time.decomposed_hideable(one * 128, flops, ops, rerun=False)
    assert hidden == pytest.approx(32 * 2 / 3 * (2 * d * 6144 + 2 * d * d) + 64 * one)
    assert hidden < one * 128
