"""Link tiers, alpha-beta times and the step-time composition."""
import dataclasses

import pytest

from jaxpar.cost import comm, estimate, load_hardware, time
from jaxpar.core.strategy import parse_inline
from jaxpar.models.config import ModelConfig, from_preset

A100 = load_hardware("a100-80gb")


def test_axis_span_follows_canonical_order():
    assert time.axis_span(("tensor",), parse_inline("data=4,tensor=8"), 8) == (8, 1)
    assert time.axis_span(("data",), parse_inline("data=4,tensor=8"), 8) == (1, 4)
    assert time.axis_span(("data",), parse_inline("data=32"), 8) == (8, 4)
    assert time.axis_span(("data",), parse_inline("data=8,tensor=2"), 8) == (4, 2)
    assert time.axis_span(("pipeline",), parse_inline("pipeline=4,tensor=2"), 8) == (4, 1)


def test_all_reduce_time_by_hand():
    st = parse_inline("tensor=8")
    bw = A100.intra_bw * A100.link_efficiency
    assert time.collective_seconds(comm.AR, ("tensor",), 1, 1e9, st, A100) == pytest.approx(2 * (7 / 8 * 1e9 / bw + 7 * A100.alpha_intra))


def test_cross_node_all_reduce_is_hierarchical():
    st = parse_inline("data=32")
    eff = A100.link_efficiency
    beta = 7 / 8 * 8e9 / (A100.intra_bw * eff) + 3 / 4 * 1e9 / (A100.inter_bw * eff)
    alpha = 7 * A100.alpha_intra + 2 * A100.alpha_inter   # 4 nodes: a ring of 8 in each, log2(4) tree steps
    assert time.collective_seconds(comm.AR, ("data",), 1, 8e9, st, A100) == pytest.approx(2 * (beta + alpha))
    big = parse_inline("data=16384")   # 2048 nodes: 11 tree steps across them, not 2047 ring steps
    latency = time.collective_seconds(comm.AR, ("data",), 1, 0.0, big, A100)
    assert latency == pytest.approx(2 * (7 * A100.alpha_intra + 11 * A100.alpha_inter))


def test_single_device_step_is_compute_plus_optimizer():
    m = ModelConfig(layers=2, d_model=256, heads=4, kv_heads=4, head_dim=64, mlp_dim=1024, vocab=1000)
    est = estimate(m, parse_inline("data=1"), A100, 8, 128)
    assert est.collectives == []
    assert est.step_time_s == pytest.approx(est.time.compute + est.time.optimizer)
    assert est.mfu == pytest.approx(est.flops.model / est.step_time_s / A100.peak_flops)


def test_bubble_and_overlap():
    t = time.step_time(1.0, 0.0, 0.2, {"tensor": 0.1, "context": 0.0, "pipeline": 0.05, "data": 0.4},
                       0.0, A100, overlap=(0.0, 0.0, 0.5))
    assert t.bubble == pytest.approx(0.25)          # compute / (1 - 0.2) - compute
    assert t.data == pytest.approx(0.2) and t.data_total == 0.4
    assert t.total == pytest.approx(1.0 + 0.25 + 0.1 + 0.05 + 0.2)


def test_a_group_spanning_torus_dimensions_gathers_over_each():
    """Scaling book, "Sharded matrices": an AllGather over several ICI axes has their bandwidth together. A
    v5p slice of 512 chips is 8 x 8 x 8: 8 chips span one dimension, 16 or 64 two, 65 three; a GPU has no
    torus. On that slice an all-gather over tensor=16 moves a byte in half the time per member-share of one
    over tensor=8 (two dimensions against one)."""
    v5p, h100 = load_hardware("tpu-v5p"), load_hardware("h100-sxm")
    assert [v5p.torus_axes(k, 512) for k in (1, 8, 16, 64, 65)] == [1, 1, 2, 2, 3]
    assert h100.torus_axes(8, 8) == 1
    t8, t16 = parse_inline("fsdp=64,tensor=8"), parse_inline("fsdp=32,tensor=16")
    beta8 = time.collective_seconds("all-gather", ("tensor",), 0, 1.0, t8, v5p)
    beta16 = time.collective_seconds("all-gather", ("tensor",), 0, 1.0, t16, v5p)
    assert beta16 / (15 / 16) == pytest.approx(0.5 * beta8 / (7 / 8))


def test_a_projection_gemm_waits_on_hbm_below_the_ridge_by_hand():
    """The roofline of one GEMM (time.gemm_excess), by hand on an H100 in bf16 at the calibrated rate:
    M=128 tokens x K=N=8,192 does 2MKN = 1.718e10 FLOPs and moves 2(MK + KN + MN) = 138.4 MB, so it takes
    138.4 MB / 3.35 TB/s, beyond its FLOPs at 0.48 x 989 TFLOP/s; 4,096 tokens are compute-bound (nothing
    added). Llama 3 8B under tensor=8 with 64 tokens per micro-batch: each of its four projection GEMMs per
    layer (QKV 4096 x 768, output 512 x 4096, gate-up 4096 x 3584, down 1792 x 4096 per device) adds its own
    excess, three passes each, 32 layers: the estimate's matmul seconds grow by that sum."""
    hw = load_hardware("h100-sxm")
    rate = hw.peak_flops * hw.matmul_efficiency
    one = (("mlp", 8192, 8192, "n", 0),)
    hand = 2 * (128 * 8192 + 8192 * 8192 + 128 * 8192) / hw.hbm_bw - 2 * 128 * 8192 * 8192 / rate
    assert hand > 0
    (kind, seconds), = time.gemm_excess(one, 128, 1, 1, 1, rate, hw.hbm_bw, 2, 2)
    assert kind == "mlp" and seconds == pytest.approx(hand)
    assert time.gemm_excess(one, 4096, 1, 1, 1, rate, hw.hbm_bw, 2, 2) == ()
    m, tokens = from_preset("llama3-8b"), 64
    shapes = ((4096, 768), (512, 4096), (4096, 3584), (1792, 4096))
    waits = [2 * (tokens * k + k * n + tokens * n) / hw.hbm_bw - 2 * tokens * k * n / rate for k, n in shapes]
    assert min(waits) > 0   # each one below the ridge
    st = parse_inline("tensor=8").with_options(dtype="bfloat16")
    est = estimate(m, st, hw, 1, tokens)
    flops_only = estimate(m, st, dataclasses.replace(hw, hbm_bw=1e30), 1, tokens)
    assert est.busy[0] - flops_only.busy[0] == pytest.approx(3 * 32 * sum(waits), rel=1e-6)
