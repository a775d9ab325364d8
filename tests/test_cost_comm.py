"""Predicted collectives for DP, ZeRO-1, FSDP, TP, SP, CP and PP, hand-computed."""
import pytest

from jaxpar.cost import comm, shape
from jaxpar.strategy import parse_inline
from models.config import ModelConfig

TINY = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
LAYER = 36864 + 128                 # one attention block's params
EMB = 2 * 256 * 64 + 64             # embedding + untied head + final norm
TOTAL = 2 * LAYER + EMB


def predict(spec, batch=8, seq=32, **opts):
    st = parse_inline(spec).with_options(**opts)
    recs = comm.collectives(TINY, st, shape.step_shape(TINY, st, batch, seq))
    return {(c.kind, c.axes, c.phase): c for c in recs}


def test_wire_factors():
    assert comm.wire_factor(comm.AR, 4) == 1.5
    assert comm.wire_factor(comm.AG, 4) == comm.wire_factor(comm.RS, 4) == comm.wire_factor(comm.A2A, 4) == 0.75
    assert comm.wire_factor(comm.PERMUTE, 4) == 1.0


def test_data_parallel_all_reduce():
    recs = predict("data=4")
    assert list(recs) == [("all-reduce", ("data",), "backward")]
    ar = recs["all-reduce", ("data",), "backward"]
    assert ar.bytes == pytest.approx(4 * TOTAL)                 # float32 grads, once per step
    assert ar.wire_bytes == pytest.approx(2 * 3 / 4 * 4 * TOTAL)
    assert ar.count == 9 + 3                                    # one per weight array


def test_zero1_reduce_scatter_and_all_gather():
    recs = predict("data=4", zero=1)
    assert recs["reduce-scatter", ("data",), "backward"].bytes == pytest.approx(4 * TOTAL)
    assert recs["all-gather", ("data",), "optimizer"].bytes == pytest.approx(4 * TOTAL)
    assert ("all-reduce", ("data",), "backward") not in recs


def test_fsdp_gathers_each_layer_forward_and_backward():
    recs = predict("fsdp=4")                                     # ZeRO-3 by default, float32 compute
    fwd, bwd = recs["all-gather", ("fsdp",), "forward"], recs["all-gather", ("fsdp",), "backward"]
    rs = recs["reduce-scatter", ("fsdp",), "backward"]
    assert fwd.bytes == bwd.bytes == pytest.approx(4 * TOTAL)    # every param gathered once each way
    assert rs.bytes == pytest.approx(4 * TOTAL)
    assert fwd.count == 2 * 9 + 3 and fwd.wire_bytes == pytest.approx(0.75 * 4 * TOTAL)
    assert len(recs) == 3


def test_tensor_parallel_all_reduces():
    recs = predict("tensor=2", dtype="bfloat16")
    x = 8 * 32 * 64 * 2                                          # b * s * d * bf16
    fwd, bwd = recs["all-reduce", ("tensor",), "forward"], recs["all-reduce", ("tensor",), "backward"]
    # 2 per attention layer x 2 layers, + embedding output, + softmax max and sum-exp (b*s*4 bytes each)
    assert fwd.count == 4 + 1 + 2 and fwd.bytes == 5 * x + 2 * 8 * 32 * 4
    assert bwd.count == 4 + 1 and bwd.bytes == 5 * x              # 2 per layer + head input grad
    full = predict("tensor=2", dtype="bfloat16", remat="full")
    assert full["all-reduce", ("tensor",), "backward"].count == 4 + 4 + 1


def test_sequence_parallel_replaces_all_reduce():
    recs = predict("tensor=2", dtype="bfloat16", sequence_parallel=True)
    x = 8 * 32 * 64 * 2
    assert recs["all-gather", ("tensor",), "forward"].bytes == 4 * x + x        # layers + head input
    assert recs["reduce-scatter", ("tensor",), "forward"].bytes == 4 * x + x    # layers + embedding
    assert recs["all-reduce", ("tensor",), "backward"].bytes == (2 * 128 + 64) * 4  # norm-weight grads


def test_context_parallel_ring_and_allgather():
    kv = 2 * 8 * 16 * 2 * 16 * 4          # K and V: b * s/c * kv_heads * head_dim * float32
    ring = predict("context=2", attention="ring")
    assert ring["collective-permute", ("context",), "forward"].count == (2 - 1) * 2
    assert ring["collective-permute", ("context",), "forward"].bytes == 2 * kv
    ag = predict("context=2", attention="allgather")
    assert ag["all-gather", ("context",), "forward"].bytes == 2 * kv * 2
    assert ag["reduce-scatter", ("context",), "backward"].bytes == 2 * kv * 2
    assert ag["all-reduce", ("context",), "backward"].bytes == pytest.approx(4 * TOTAL)


@pytest.mark.parametrize("schedule,v,iters", [("gpipe", 1, 4 + 2 - 1), ("circular", 2, 2 * 4 + 2 - 1)])
def test_pipeline_permutes_per_iteration(schedule, v, iters):
    recs = predict("pipeline=2", microbatches=4, pp_schedule=schedule, pp_repeats=v)
    p = recs["collective-permute", ("pipeline",), "forward"]
    assert p.count == iters and p.bytes == iters * (8 / 4) * 32 * 64 * 4
    assert recs["collective-permute", ("pipeline",), "backward"].count == iters
