"""Software.ep_overlap: the share of the expert all-to-alls a stack hides under compute (DeepSeek-V3's
DualPipe, Megatron-Core's --overlap-moe-expert-parallel-comm), checked against the step's own terms."""
from __future__ import annotations

import dataclasses

import pytest

from jaxpar.cost import MEGATRON_CORE, estimate, load_hardware, memory, time
from jaxpar.core.strategy import AXES, Options, Strategy
from jaxpar.models.config import parse_model

H100 = load_hardware("h100-sxm")


def test_step_time_hides_the_expert_share_before_data():
    comm = {"tensor": 0.1, "context": 0.0, "pipeline": 0.0, "expert": 0.3, "data": 0.4}
    t = time.step_time(time.Busy(0.5), comm, time.Hiding(tensor=1.0, data=1.0, expert=0.5), 0.0, H100)
    assert (t.tensor, t.expert) == (0.0, pytest.approx(0.15))        # half of the all-to-alls hidden
    assert t.data == pytest.approx(0.4 - (0.5 - 0.1 - 0.15))          # the data share takes what compute is left
    assert time.step_time(time.Busy(1.0), comm, time.Hiding(), 0.0, H100).expert == 0.3  # default: exposed


def test_estimate_with_overlap_loses_exactly_the_exposed_all_to_alls():
    sizes = {a: {"data": 8, "expert": 8}.get(a, 1) for a in AXES}
    st = Strategy(name="data8-expert8", mesh=tuple((a, sizes[a]) for a in AXES),
                  options=Options(zero=1, remat="full", dtype="bfloat16"))
    m = parse_model("mixtral-8x7b")
    plain = estimate(m, st, H100, 128, 4096, MEGATRON_CORE)
    hidden = estimate(m, st, H100, 128, 4096, dataclasses.replace(MEGATRON_CORE, ep_overlap=1.0))
    a2a = sum(c.bytes for c in plain.collectives if c.kind == "all-to-all")
    assert a2a > 0 and plain.time.expert > 0 and hidden.time.expert == 0.0
    # the compute is far larger than the all-to-alls and the data-parallel traffic together, so all of it hides
    assert plain.time.compute > plain.time.expert + plain.time.data_total
    assert plain.step_time_s - hidden.step_time_s == pytest.approx(plain.time.expert, rel=1e-9)


def test_one_f_one_b_holds_the_logits_of_one_micro_batch():
    """Under 1F1B the last stage holds one micro-batch's float32 logits: growing the vocabulary by V adds
    (sequences per micro-batch) x s x V x 4 / tensor bytes, the hand count, not the whole local batch's."""
    sizes = {a: {"data": 2, "pipeline": 4, "tensor": 2}.get(a, 1) for a in AXES}
    st = Strategy(name="dp2-pp4-tp2", mesh=tuple((a, sizes[a]) for a in AXES),
                  options=Options(remat="full", dtype="bfloat16", microbatches=8, pp_schedule="1f1b"))
    batch, seq, extra = 64, 1024, 32768
    small, big = parse_model("llama3-8b"), parse_model(f"llama3-8b:vocab={128256 + extra}")
    one_f = memory.Traits(pp_1f1b=True)
    grown = memory.activation_bytes(big, st, batch, seq, one_f) - memory.activation_bytes(small, st, batch, seq, one_f)
    assert grown == pytest.approx(batch / 2 / 8 * seq * extra * 4 / 2)
