"""The planner ranks only valid strategies that fit, and what it ranks first beats hand-picked ones."""
from jaxpar.cost import estimate
from jaxpar.cost.hardware import load_hardware
from jaxpar.planner import plan
from jaxpar.strategy import parse_inline
from jaxpar.models.config import parse_model


def test_nothing_fits_when_adam_state_alone_exceeds_the_cluster():
    # 16 bytes per parameter (fp32 weights, grads, two moments) x 70.6e9 parameters = 1.13 TB > 8 x 80 GB
    model = parse_model("llama3-70b")
    results, considered, valid = plan(model, "h100-sxm", 8, seq=4096, global_batch=64)
    assert considered > 0 and valid > 0 and results == []


def test_best_plan_fits_and_beats_hand_picked_strategies():
    model, hw = parse_model("llama3-8b"), load_hardware("h100-sxm")
    results, _, _ = plan(model, hw, 64, seq=4096, global_batch=256, top=20)
    assert results
    speeds = [est.tokens_per_s for est, _ in results]
    assert speeds == sorted(speeds, reverse=True)
    for est, st in results:
        assert est.memory.total <= hw.hbm_bytes and st.num_devices == 64
    for spec, opts in [("fsdp=64", dict(remat="full", dtype="bfloat16", grad_accum=4)),
                       ("fsdp=8,tensor=8", dict(remat="full", dtype="bfloat16", sequence_parallel=True, grad_accum=4))]:
        hand = estimate(model, parse_inline(spec).with_options(**opts), hw, 256, 4096)
        if hand.fits:
            assert speeds[0] >= hand.tokens_per_s
