"""Predicted collectives for DP, ZeRO-1, FSDP, TP, SP, CP and PP, hand-computed."""
import dataclasses
import pytest

from jaxpar.cost import comm, shape
from jaxpar.core.strategy import parse_inline
from jaxpar.models.config import ModelConfig

TINY = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
LAYER = 36864 + 128                 # one attention block's params
EMB = 2 * 256 * 64 + 64             # embedding + untied head + final norm
TOTAL = 2 * LAYER + EMB


TABLE = 256 * 64                    # the embedding table (its lookup under ZeRO-1/3 needs no gradient reduction)


def predict(spec, batch=8, seq=32, compiler="gpu", model=TINY, **opts):
    st = parse_inline(spec).with_options(**opts)
    recs = comm.collectives(model, st, shape.step_shape(model, st, batch, seq), compiler=compiler)
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
    assert recs["reduce-scatter", ("data",), "backward"].bytes == pytest.approx(4 * (TOTAL - TABLE))
    assert recs["all-gather", ("data",), "optimizer"].bytes == pytest.approx(4 * TOTAL)
    assert ("all-reduce", ("data",), "backward") not in recs
    # the embedding's moments are sharded on its model dim: token ids gathered, row gradients all-to-all'd
    assert recs["all-gather", ("data",), "forward"].bytes == 8 * 32 * 4
    assert recs["all-to-all", ("data",), "backward"].bytes == 2 * 32 * 64 * 4


def test_fsdp_gathers_each_layer_forward_and_backward():
    recs = predict("fsdp=4")                                     # ZeRO-3 by default, float32 compute
    fwd, bwd = recs["all-gather", ("fsdp",), "forward"], recs["all-gather", ("fsdp",), "backward"]
    rs = recs["reduce-scatter", ("fsdp",), "backward"]
    ids = 8 * 32 * 4                                             # the batch's token ids, int32
    # layers, head and final norm gathered forward; the table is not (ids gathered, rows all-to-all'd)
    assert fwd.bytes == pytest.approx(4 * (TOTAL - TABLE) + ids) and fwd.count == 2 * 9 + 2 + 1
    # the head and the norm weights (2 a layer, the final one) kept gathered from forward (d = 64)
    assert bwd.bytes == pytest.approx(4 * 2 * (LAYER - 2 * 64)) and bwd.count == 2 * 7
    assert rs.bytes == pytest.approx(4 * 2 * LAYER) and rs.count == 2 * 9      # in the layer loop
    # head and final norm: where the optimizer's sharding constraint asks for them
    late = recs["reduce-scatter", ("fsdp",), "optimizer"]
    assert late.bytes == pytest.approx(4 * (EMB - TABLE)) and late.count == 2
    assert recs["all-to-all", ("fsdp",), "forward"].bytes == recs["all-to-all", ("fsdp",), "backward"].bytes \
        == 2 * 32 * 64 * 4


def test_tensor_parallel_all_reduces():
    recs = predict("tensor=2", dtype="bfloat16")
    x = 8 * 32 * 64 * 2                                          # b * s * d * bf16
    fwd, bwd = recs["all-reduce", ("tensor",), "forward"], recs["all-reduce", ("tensor",), "backward"]
    # 2 per attention layer x 2 layers, + embedding output, + softmax max, sum-exp and label logit (b*s*4 each)
    assert fwd.count == 4 + 1 + 3 and fwd.bytes == 5 * x + 3 * 8 * 32 * 4
    assert bwd.count == 4 + 1 and bwd.bytes == 5 * x              # 2 per layer + head input grad
    full = predict("tensor=2", dtype="bfloat16", remat="full")
    # the recomputed forward repeats the attention all-reduce; the MLP's is dead there
    assert full["all-reduce", ("tensor",), "backward"].count == 4 + 2 + 1


def test_sequence_parallel_replaces_all_reduce():
    recs = predict("tensor=2", dtype="bfloat16", sequence_parallel=True)
    x = 8 * 32 * 64 * 2
    assert recs["all-gather", ("tensor",), "forward"].bytes == 4 * x + x        # layers + head input
    assert recs["reduce-scatter", ("tensor",), "forward"].bytes == 4 * x + x    # layers + embedding
    assert recs["all-reduce", ("tensor",), "backward"].bytes == (2 * 128 + 64) * 4  # norm-weight grads


def test_context_parallel_ring_and_allgather():
    kv = 2 * 8 * 16 * 2 * 16 * 4          # K and V: b * s/c * kv_heads * head_dim * float32
    ring = predict("context=2", attention="ring")
    # per layer and hop a permute of K and one of V, + the key positions once (b * s/c int32)
    assert ring["collective-permute", ("context",), "forward"].count == (2 - 1) * 2 * 2 + 1
    assert ring["collective-permute", ("context",), "forward"].bytes == 2 * kv + 8 * 16 * 4
    ag = predict("context=2", attention="allgather")
    assert ag["all-gather", ("context",), "forward"].bytes == 2 * kv * 2 + 8 * 32 * 4
    assert ag["reduce-scatter", ("context",), "backward"].bytes == 2 * kv * 2
    assert ag["all-reduce", ("context",), "backward"].bytes == pytest.approx(4 * TOTAL)


@pytest.mark.parametrize("schedule,v,iters", [("gpipe", 1, 4 + 2 - 1), ("circular", 2, 2 * 4 + 2 - 1)])
def test_pipeline_permutes_per_iteration(schedule, v, iters):
    model = dataclasses.replace(TINY, layers=2 * v)   # v chunks of one layer per stage
    recs = predict("pipeline=2", microbatches=4, pp_schedule=schedule, pp_repeats=v, model=model)
    p = recs["collective-permute", ("pipeline",), "forward"]
    assert p.count == iters and p.bytes == iters * (8 / 4) * 32 * 64 * 4
    assert recs["collective-permute", ("pipeline",), "backward"].count == iters
    # the output is spread over the stages for the head (one all-to-all each way); backward the input's
    # cotangent and the head's and final norm's partial gradients are summed over the stages
    out = 8 * 32 * 64 * 4
    a2a = recs["all-to-all", ("pipeline",), "forward"]
    assert ("all-reduce", ("pipeline",), "forward") not in recs
    assert recs["all-reduce", ("pipeline",), "backward"].bytes == out + 4 * (TINY.vocab * 64 + 64)
    # an even split keeps its weights at rest in stage order (jaxpar/pipeline/order.py): the circular
    # [S, v, k] view is a reshape, so no weight all-to-all under either schedule
    assert a2a.count == 1 and a2a.bytes == out
    assert recs["all-to-all", ("pipeline",), "backward"].bytes == a2a.bytes


def test_cpu_compiler_traits():
    """XLA:CPU: no reduce-scatter, no reassociation, combined all-reduces, gradients reduced in the loop."""
    dp = predict("data=4", compiler="cpu")["all-reduce", ("data",), "backward"]
    assert dp.bytes == pytest.approx(4 * TOTAL) and dp.count == 2 + 1   # one op per layer, one after
    tp = predict("tensor=2", compiler="cpu")
    x = 8 * 32 * 64 * 4
    bwd = tp["all-reduce", ("tensor",), "backward"]
    assert bwd.count == 2 * 2 + 1 and bwd.bytes == 2 * 5 * x + x    # q,k,v and gate,up: 2 ops of 5 buffers
    zero1 = predict("data=4", zero=1, compiler="cpu")
    assert not any(k[0] == "reduce-scatter" for k in zero1)
    assert sum(c.bytes for k, c in zero1.items() if k[0] == "all-reduce") == pytest.approx(4 * (TOTAL - TABLE))
    assert predict("data=2,context=2", compiler="cpu", attention="ring")["all-reduce", ("context",), "backward"].bytes \
        == pytest.approx(4 * TOTAL)                                 # not folded with the data reduction
