"""Link tiers, alpha-beta times and the step-time composition."""
import dataclasses
import math

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


def test_cross_node_gathers_and_scatters_are_rings_through_every_rank():
    """NCCL's tuning model (src/graph/tuning.cc): an all-gather or reduce-scatter over n ranks on m nodes is a
    ring of n - 1 steps, m - 1 of them across nodes; an all-reduce takes its tree (above). data=32 on 8-GPU
    nodes: 28 NVLink steps and 3 network steps; data=16384: 14,336 and 2,047."""
    for devices, nodes in ((32, 4), (16384, 2048)):
        st = parse_inline(f"data={devices}")
        for kind in (comm.AG, comm.RS):
            latency = time.collective_seconds(kind, ("data",), 1, 0.0, st, A100)
            assert latency == pytest.approx((devices - nodes) * A100.alpha_intra + (nodes - 1) * A100.alpha_inter)
    inside = time.collective_seconds(comm.AG, ("tensor",), 1, 0.0, parse_inline("tensor=8"), A100)
    assert inside == pytest.approx(7 * A100.alpha_intra)


def test_a_torus_runs_its_rings_per_dimension():
    """A v5e slice of 256 chips is a 16 x 16 torus: a ring over 16 chips takes 15 steps, over 32 chips (two
    dimensions, 16 x 2) 15 + 1, over the whole slice 15 + 15, not 255; a GPU node's switch, members - 1."""
    v5e, h100 = load_hardware("tpu-v5e"), load_hardware("h100-sxm")
    assert [v5e.ring_steps(k, 256) for k in (1, 2, 16, 32, 256)] == [0, 1, 15, 16, 30]
    assert [h100.ring_steps(k, 8) for k in (1, 2, 8)] == [0, 1, 7]
    st = parse_inline("fsdp=256")
    assert time.collective_seconds(comm.AG, ("fsdp",), 1, 0.0, st, v5e) == pytest.approx(30 * v5e.alpha_intra)


def test_flat_parameters_issue_one_gather_and_one_scatter_per_block_and_pass():
    """PyTorch's FSDP gathers a block's weights as one flat buffer (Software.flat_params): per layer one
    all-gather forward, one backward (full remat reruns the forward: two then) and one reduce-scatter; XLA's
    program (jaxpar) one per weight array (a Llama layer: 7 matrices and 2 norms). Bytes are the same."""
    from jaxpar.cost.software import SOFTWARE
    m = from_preset("llama3-8b")
    st = parse_inline("fsdp=64")
    counts = {}
    for name in ("jaxpar", "torchtitan"):
        est = estimate(m, st, "h100-sxm", 64, 4096, SOFTWARE[name])
        counts[name] = {(k, ph): (c, b) for k, axes, ph, c, b in est.predicted if axes == ("fsdp",)}
    flat, arrays = counts["torchtitan"], counts["jaxpar"]
    assert flat[(comm.AG, "forward")][0] == m.layers + 3   # + the head, the final norm, the embedding lookup's token ids
    assert flat[(comm.AG, "backward")][0] == m.layers
    assert flat[(comm.RS, "backward")][0] == m.layers
    assert arrays[(comm.RS, "backward")][0] == 9 * m.layers
    assert flat[(comm.RS, "backward")][1] == pytest.approx(arrays[(comm.RS, "backward")][1])


def test_megatron_buckets_its_step_reductions():
    """Megatron-Core's DDP and distributed optimizer reduce the gradients and gather the weights in buckets of
    max(40M, 1M x ranks) parameters (Software.grad_buckets): Llama 3 8B over 64 data ranks, ZeRO-1, issues
    ceil(8.0B / 64M) reduce-scatters of float32 gradients and as many bf16 gathers; XLA's program one per
    stacked weight array."""
    from jaxpar.cost.software import SOFTWARE
    m = from_preset("llama3-8b")
    st = parse_inline("data=64").with_options(zero=1)
    ops = {}
    for name in ("jaxpar", "megatron-core"):
        est = estimate(m, st, "h100-sxm", 64, 4096, SOFTWARE[name])
        ops[name] = {(k, ph): (c, b) for k, axes, ph, c, b in est.predicted if axes == ("data",)}
    count, nbytes = ops["megatron-core"][(comm.RS, "backward")]
    assert count == math.ceil(nbytes / 4 / 64e6) > 100
    gathers, gathered = ops["megatron-core"][(comm.AG, "optimizer")]
    assert gathers == math.ceil(gathered / 2 / 64e6)
    assert ops["jaxpar"][(comm.RS, "backward")][0] < 20


def test_single_device_step_is_compute_plus_optimizer():
    m = ModelConfig(layers=2, d_model=256, heads=4, kv_heads=4, head_dim=64, mlp_dim=1024, vocab=1000)
    est = estimate(m, parse_inline("data=1"), A100, 8, 128)
    assert est.collectives == []
    assert est.step_time_s == pytest.approx(est.time.compute + est.time.optimizer)
    assert est.mfu == pytest.approx(est.flops.model / est.step_time_s / A100.peak_flops)


def test_bubble_and_overlap():
    t = time.step_time(time.Busy(1.0, bubble=0.2), {"tensor": 0.1, "context": 0.0, "pipeline": 0.05, "data": 0.4},
                       time.Hiding(data=0.5), 0.0, A100)
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
    (kind, seconds), = time.gemm_excess(one, time.GemmRun(128, 1, 1, 1, rate, hw.hbm_bw, 2, 2))
    assert kind == "mlp" and seconds == pytest.approx(hand)
    assert time.gemm_excess(one, time.GemmRun(4096, 1, 1, 1, rate, hw.hbm_bw, 2, 2)) == ()
    m, tokens = from_preset("llama3-8b"), 64
    shapes = ((4096, 768), (512, 4096), (4096, 3584), (1792, 4096))
    waits = [2 * (tokens * k + k * n + tokens * n) / hw.hbm_bw - 2 * tokens * k * n / rate for k, n in shapes]
    assert min(waits) > 0   # each one below the ridge
    st = parse_inline("tensor=8").with_options(dtype="bfloat16")
    est = estimate(m, st, hw, 1, tokens)
    flops_only = estimate(m, st, dataclasses.replace(hw, hbm_bw=1e30), 1, tokens)
    assert est.busy[0] - flops_only.busy[0] == pytest.approx(3 * 32 * sum(waits), rel=1e-6)
