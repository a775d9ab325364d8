"""Other stacks' presets in the cost model (jaxpar/cost/software.py): their defaults, what each runs, float8,
overlap by link tier, context parallelism, the tie band (their published runs: tests/test_stacks_published.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from jaxpar.cli import main as cli
from jaxpar.core import validate
from jaxpar.core.strategy import parse_inline, parse_strategy
from jaxpar.cost import SOFTWARE, estimate, flops, load_hardware
from jaxpar.cost import time as cost_time
from jaxpar.cost.band import band_for
from jaxpar.collectives import AG, AR, PERMUTE, RS
from jaxpar.cost.defaults import stack_defaults
from jaxpar.cost.overlap import fractions
from jaxpar.errors import ConfigError
from jaxpar.models.config import from_preset
from jaxpar.planning import planner


def test_every_stack_preset_states_its_sources_and_nemo_is_megatron_core():
    for name, sw in SOFTWARE.items():
        assert sw.jaxpar_program == (name == "jaxpar")
        assert name == "jaxpar" or name == "megatron-lm" or sw.sources, name
    assert SOFTWARE["nemo"] is SOFTWARE["megatron-core"] is SOFTWARE["megatron-bridge"]


def test_stack_defaults_are_the_stacks_recipes_and_flags_win():
    """Llama 3 405B's layout (TP8 PP16 DP64) under megatron-core: the distributed optimizer, sequence
    parallelism and 1F1B, as Megatron runs it; a flag the user gave is left alone; jaxpar sets none."""
    st = parse_inline("data=64,pipeline=16,tensor=8")
    changes, lines = stack_defaults(st, SOFTWARE["megatron-core"], set())
    assert changes == {"zero": 1, "sequence_parallel": True, "pp_schedule": "1f1b"} and len(lines) == 3
    assert "zero" not in stack_defaults(st, SOFTWARE["megatron-core"], {"zero"})[0]
    assert stack_defaults(st, SOFTWARE["jaxpar"], set())[0] == {}
    assert stack_defaults(parse_inline("fsdp=8"), SOFTWARE["torchtitan"], set())[0] == {}


def test_estimate_prints_the_stack_defaults_and_a_program_rule_does_not_refuse_another_stack(capsys):
    """jaxpar's 1F1B head needs the sequence piece divisible by the stages (seq 1000 / 16 is not): the rule
    refuses jaxpar's program, not megatron-core's estimate."""
    args = ["estimate", "--model", "llama3-405b", "--mesh", "data=64,pipeline=16,tensor=8", "--hardware", "h100-sxm",
            "--seq", "1000", "--global-batch", "2048"]
    assert cli.main([*args, "--software", "megatron-core"]) == 0
    out = capsys.readouterr().out
    for line in ("default: zero = 1", "default: sequence parallel", "default: pp_schedule = 1f1b"):
        assert line in out
    assert cli.main([*args, "--pp-schedule", "1f1b", "--sequence-parallel"]) == 2
    assert "must be divisible by pipeline=16" in capsys.readouterr().err


def test_estimate_prices_a_stacks_context_parallelism_as_it_runs_and_says_so(capsys, tmp_path):
    """torchtitan on context=8 (fsdp=1): its attention defaults to the stack's ring (jaxpar's program refuses
    dense attention over context and names the choice), and its FSDP spans the context ranks, so the header
    prints the ZeRO-3 it prices, not the mesh's zero = 0: the weights, gradients and optimizer state per
    device equal those of fsdp=8 (independent: the same state over the same 8 devices by the fsdp axis)."""
    args = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--seq", "8192", "--global-batch", "8"]
    assert cli.main([*args, "--mesh", "context=8", "--software", "torchtitan", "--json", str(tmp_path / "cp.json")]) == 0
    out = capsys.readouterr().out
    assert "options zero = 3," in out and 'attention = "ring"' in out
    assert "default: attention = ring (torchtitan's context parallelism" in out
    assert "default: zero = 3 over fsdp x context = 8 devices" in out
    assert cli.main([*args, "--mesh", "fsdp=8", "--software", "torchtitan", "--json", str(tmp_path / "fsdp.json")]) == 0
    capsys.readouterr()
    cp, fsdp = (json.loads((tmp_path / f).read_text())["memory"] for f in ("cp.json", "fsdp.json"))
    assert all(cp[k] == fsdp[k] > 0 for k in ("params", "grads", "optimizer"))
    assert cli.main([*args, "--mesh", "context=8", "--software", "torchtitan", "--zero", "0"]) == 2
    assert "its FSDP spans the context ranks (ZeRO-3 over fsdp x context), not zero=0 over context=8" in capsys.readouterr().err
    assert cli.main([*args, "--mesh", "context=8"]) == 2
    assert "attention=dense cannot shard the sequence: context=8" in capsys.readouterr().err


def test_a_plan_over_context_names_the_stage_the_stack_runs_and_its_file_keeps_it_unset(tmp_path):
    """A torchtitan plan on context=2 x tensor=8 is priced as ZeRO-3 over the context ranks: its line says
    zero=3, and its mesh file leaves zero unset (a comment says why), so reading the file back prices the
    same step and memory (`zero = 0` written out would price ZeRO-0's collectives)."""
    m, hw, sw = from_preset("llama3.1-8b"), load_hardware("h100-sxm"), SOFTWARE["torchtitan"]
    st = parse_inline("context=2,tensor=8").with_options(attention="ring", dtype="bfloat16", sequence_parallel=True)
    est = estimate(m, st, hw, 16, 65536, sw)
    assert "zero=3)" in planner.describe(st, est)
    path = tmp_path / "plan.toml"
    path.write_text(planner.to_toml(st, est))
    assert "\nzero = " not in path.read_text() and "# zero = 3 over fsdp x context" in path.read_text()
    back = parse_strategy(str(path))
    assert back.options.zero is None
    again = estimate(m, back, hw, 16, 65536, sw)
    assert (again.step_time_s, again.memory.total) == (est.step_time_s, est.memory.total)


def test_float8_runs_the_linears_at_the_float8_peak_and_pays_their_casts():
    """A torchtitan float8 step against the same step in bf16: the compute seconds differ by the linear
    layers' FLOPs at the bf16 vs float8 peak (hand count: the attention core and the head stay bf16), less
    the casts of their operands at HBM bandwidth (4 bytes per element: torchao's float8 roofline)."""
    m = from_preset("llama3-8b")
    st = parse_inline("fsdp=8").with_options(remat="none").resolved(8)
    hw = load_hardware("h100-sxm")
    bf16, fp8 = (estimate(m, st.with_options(dtype=d), hw, 16, 4096, SOFTWARE["torchtitan"]) for d in ("bfloat16", "float8"))
    f = bf16.flops
    cores = flops.attention_core_flops(m, 16, 4096, causal=True).matmul * m.layers * 3.5 / 8  # fwd, bwd, QK^T again
    assert f.recompute / 8 == pytest.approx(cores / 7, rel=1e-9)   # the fused kernel's QK^T: all it recomputes
    linear = (f.layers + f.recompute) / 8 - cores
    saved = linear * (1 / hw.peak_flops - 1 / hw.fp8_flops) / hw.matmul_efficiency
    # Llama 3 8B per token and layer: inputs d (Q, K, V) + 32*128 (O) + d (gate, up) + 14336 (down);
    # output gradients 32*128 + 2*8*128 (Q, K, V) + d (O) + 2*14336 (gate, up) + d (down); 2 x 4096 tokens
    inputs, outputs = 4096 + 4096 + 4096 + 14336, 4096 + 2048 + 4096 + 2 * 14336 + 4096
    casts = 4 * 2 * 4096 * 32 * (inputs + outputs) / hw.hbm_bw
    assert bf16.time.compute - fp8.time.compute == pytest.approx(saved - casts, rel=1e-6)
    full = st.with_options(remat="full")
    bf16_full, fp8_full = (estimate(m, full.with_options(dtype=d), hw, 16, 4096, SOFTWARE["torchtitan"])
                           for d in ("bfloat16", "float8"))
    cores_full = cores * 4.5 / 3.5   # the recomputed forward runs the core once more
    saved_full = (bf16_full.flops.layers + bf16_full.flops.recompute) / 8 - cores_full
    casts_full = 4 * 2 * 4096 * 32 * (2 * inputs + outputs) / hw.hbm_bw   # full recompute casts the inputs again
    assert bf16_full.time.compute - fp8_full.time.compute == pytest.approx(
        saved_full * (1 / hw.peak_flops - 1 / hw.fp8_flops) / hw.matmul_efficiency - casts_full, rel=1e-6)
    fsdp = {(c[0], c[2]): c[4] for c in fp8.predicted if c[1] == ("fsdp",)}
    assert fsdp[(AG, "forward")] < {(c[0], c[2]): c[4] for c in bf16.predicted if c[1] == ("fsdp",)}[(AG, "forward")]


def test_megatron_and_torchtitan_hold_the_embedding_and_the_head_on_their_end_stages():
    """Under a pipeline, Megatron-Core and torchtitan build the input embedding on the first stage and the
    untied head on the last, so the fullest stage holds one of the two vocabulary matrices; jaxpar and
    MaxText keep the whole block on every stage. Hand count, Llama 3 8B under tensor=2: the bf16 weights
    differ by V*d/2 (one matrix, vocab-sharded) + d/2 (half the final norm) elements at 2 bytes; nothing
    differs without a pipeline, nor for a tied model (its word embedding is on both end stages)."""
    hw = load_hardware("h100-sxm")
    core = SOFTWARE["megatron-core"]
    everywhere = dataclasses.replace(core, pp_end_stages=False)
    assert SOFTWARE["torchtitan"].pp_end_stages and not SOFTWARE["maxtext"].pp_end_stages

    def params(m, mesh, software):
        st = parse_inline(mesh).with_options(remat="full").resolved(8)
        return estimate(m, st, hw, 16, 4096, software).memory.params

    m = from_preset("llama3-8b")
    saved = params(m, "pipeline=4,tensor=2", everywhere) - params(m, "pipeline=4,tensor=2", core)
    assert saved == pytest.approx((128256 * 4096 / 2 + 4096 / 2) * 2, rel=1e-9)
    assert params(m, "data=4,tensor=2", everywhere) == params(m, "data=4,tensor=2", core)
    tied = from_preset("gpt3-175b")
    assert params(tied, "pipeline=4,tensor=2", everywhere) == params(tied, "pipeline=4,tensor=2", core)


def test_bfloat16_gradients_halve_the_gradient_bytes_and_are_refused_for_jaxpar(capsys):
    """grad_dtype=bfloat16 (NeMo's grad_sync_dtype bf16): against the same Megatron-Core step with float32
    gradients, the gradient memory halves and so does every data-parallel gradient reduction (the
    distributed optimizer's reduce-scatter over `data`); nothing else moves. jaxpar's program keeps
    float32 gradients, so its estimate, its plan and its run refuse the option with one line."""
    m, hw, core = from_preset("llama3-8b"), load_hardware("h100-sxm"), SOFTWARE["megatron-core"]
    st = parse_inline("data=4,tensor=2").with_options(remat="full", zero=1, sequence_parallel=True).resolved(8)
    f32, b16 = (estimate(m, st.with_options(grad_dtype=g), hw, 16, 4096, core) for g in ("float32", "bfloat16"))
    assert b16.memory.grads == f32.memory.grads / 2 > 0
    assert (b16.memory.params, b16.memory.optimizer, b16.memory.activations) == (
        f32.memory.params, f32.memory.optimizer, f32.memory.activations)
    data = {c[:3]: c[4] for c in f32.predicted if c[1] == ("data",)}
    assert data[(RS, ("data",), "backward")] > 0
    assert {c[:3]: c[4] for c in b16.predicted if c[1] == ("data",)} == {
        k: v / 2 if k[0] == RS else v for k, v in data.items()}
    assert [c for c in f32.predicted if c[1] != ("data",)] == [c for c in b16.predicted if c[1] != ("data",)]
    with pytest.raises(ConfigError, match="grad_dtype=bfloat16 .* jaxpar's program accumulates float32"):
        validate.check(m, st.with_options(grad_dtype="bfloat16"), batch=16, seq=4096)
    with pytest.raises(ConfigError, match="grad_dtype=bfloat16"):
        planner.plan(m, hw, 8, 4096, 64, 1, grad_dtype="bfloat16")
    assert cli.main(["estimate", "--model", "llama3-8b", "--mesh", "data=8", "--hardware", "h100-sxm", "--seq",
                     "4096", "--global-batch", "64", "--grad-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grad_dtype=bfloat16" in err[0], err


def test_megatron_plans_no_fsdp_inside_pipeline_stages():
    """Megatron-FSDP does not compose with pipeline parallelism (Software.fsdp_pipeline): `plan --software
    megatron-core` lists no layout with both fsdp > 1 and pipeline > 1, where torchtitan's search (FSDP2
    inside its pipeline stages, as its 405B runs) does."""
    m = from_preset("llama3-70b")
    both = {}
    for name in ("megatron-core", "torchtitan"):
        plans, _, _ = planner.plan(m, "h100-sxm", 32, 4096, 64, 10**6, SOFTWARE[name], headroom=0.0)
        both[name] = [st.name for _, st in plans if st.size("fsdp") > 1 and st.size("pipeline") > 1]
        assert plans
    assert both["megatron-core"] == [] and both["torchtitan"]


def test_estimate_refuses_a_layout_the_stack_does_not_run_and_plan_offers_none(capsys):
    """A stack's estimate is refused, in one line naming the constraint and the values, for a layout that stack
    has no mode for (Software.axes, zeros, pp_schedules): llm-foundry has no tensor parallelism, torchtitan no
    stage that shards the optimizer state alone (its data axis is DDP or FSDP2), Megatron-Core no GPipe; the
    planner's candidates for torchtitan on data=8 hold no zero=1, Megatron-Core's (its distributed optimizer)
    do."""
    args = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--seq", "4096", "--global-batch", "64"]
    for extra, why in ((["--mesh", "fsdp=4,tensor=2", "--software", "llm-foundry"],
                        "llm-foundry does not run fsdp=4,tensor=2 [fsdp=4 x tensor=2]: it parallelises over data, fsdp only, not tensor=2"),
                       (["--mesh", "data=8", "--software", "torchtitan", "--zero", "1"],
                        "torchtitan does not run data=8 [data=8]: it runs ZeRO stages 0, 3, not zero=1"),
                       (["--mesh", "data=2,pipeline=4", "--software", "megatron-core", "--pp-schedule", "gpipe"],
                        "its pipeline schedules with one chunk per stage are 1f1b, not pp_schedule=gpipe")):
        assert cli.main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert cli.main([*args, "--mesh", "data=8", "--software", "megatron-core", "--zero", "1"]) == 0
    capsys.readouterr()
    sizes = {"data": 8, "fsdp": 1, "pipeline": 1, "context": 1, "expert": 1, "tensor": 1}
    zeros = {name: {o.zero for o in planner.candidate_options(sizes, 64, 32, software=SOFTWARE[name])}
             for name in ("torchtitan", "megatron-core")}
    assert zeros == {"torchtitan": {None}, "megatron-core": {None, 1}}


def test_the_planner_interleaves_as_the_recipes_split_uneven_layers():
    """Interleaved 1F1B candidates: one unit per chunk where the stages divide the layers, else the most
    chunks per stage whose split pads at most the two end chunks by one unit: Llama 3 405B's 126 layers
    on 8 stages in 8 chunks per stage (Megatron-Bridge's recipe: PP8 VP8, 64 chunks of 2 with the ends of
    1), on 16 stages in 4; none where no v > 1 splits so."""
    assert planner.interleaved_repeats(80, 4) == 20
    assert planner.interleaved_repeats(126, 8) == 8 and planner.interleaved_repeats(126, 16) == 4
    assert planner.interleaved_repeats(3, 2) == 0
    sizes = {"data": 2, "fsdp": 1, "pipeline": 8, "context": 2, "expert": 1, "tensor": 4}
    assert {(o.pp_schedule, o.pp_repeats) for o in planner.candidate_options(sizes, 64, 126, "float8",
                                                                            SOFTWARE["megatron-core"])} == {
        ("1f1b", 1), ("1f1b", 8)}


def test_float8_is_refused_where_it_cannot_run():
    m = from_preset("llama3-8b")
    st = parse_inline("fsdp=8").with_options(dtype="float8").resolved(8)
    with pytest.raises(ConfigError, match="hardware a100-80gb states no float8 peak"):
        estimate(m, st, "a100-80gb", 16, 4096, SOFTWARE["torchtitan"])
    with pytest.raises(ConfigError, match="overlap=collective_matmul splits them into ring pieces"):
        validate.check(m, parse_inline("fsdp=4,tensor=2").with_options(dtype="float8", sequence_parallel=True,
                       overlap="collective_matmul").resolved(8), batch=16, seq=4096)
    validate.check(m, st, batch=16, seq=4096)   # jaxpar's program trains in float8 (jaxpar/ops/fp8.py)


def test_tensor_overlap_stops_at_the_node():
    """torchtitan's async TP hides tensor collectives under GEMMs inside a node only: a tensor group of 8 on
    8-GPU nodes is hidden as far as each collective's own GEMM lasts (the narrow QKV and output projections
    leave a little exposed: time.decomposed_hideable), the same group on 4-GPU nodes (crossing InfiniBand)
    not at all."""
    m = from_preset("llama3-8b")
    st = parse_inline("fsdp=2,tensor=8").with_options(dtype="bfloat16", sequence_parallel=True,
                                                       overlap="collective_matmul").resolved(16)
    hw = load_hardware("h100-sxm")
    tt = SOFTWARE["torchtitan"]
    inside = estimate(m, st, hw, 16, 4096, tt)
    assert fractions(tt, st, inside.predicted, hw)[0] == 1.0
    small = dataclasses.replace(hw, devices_per_node=4)
    across = estimate(m, st, small, 16, 4096, tt)
    assert fractions(tt, st, across.predicted, small)[0] == 0.0
    assert across.time.tensor > 10 * inside.time.tensor > 0.0
    assert any(c[0] in (AG, RS) and "tensor" in c[1] for c in across.predicted)
    assert fractions(tt, st.with_options(overlap="none"), inside.predicted, hw)[0] == 0.0


def context_records(sw, remat="full"):
    """The context-only collectives of a small llama (16 query heads, 8 KV heads, head_dim 8, 2 layers,
    bf16) on fsdp2 x context2 x tensor2 at batch 4 x seq 256 under `sw`, as {(kind, phase): (ops, bytes)}."""
    m = from_preset("llama-tiny")
    st = parse_inline("fsdp=2,context=2,tensor=2").with_options(remat=remat, attention="ring", cp_layout="zigzag",
                                                                 dtype="bfloat16")
    est = estimate(m, st, load_hardware("h100-sxm"), 4, 256, sw)
    return m, est, {(k, ph): (n, b) for k, axes, ph, n, b in est.predicted if axes == ("context",) and k != AR}


def test_torchtitan_context_parallel_is_pytorchs_allgather_rotater():
    """Hand count of PyTorch's all-gather rotater (torchtitan's default rotate method) per step: per layer
    one all-gather of K and V, repeated to the query heads of the tensor shard, forward, again in the
    full-recompute forward and again backward; dK and dV in float32 around the ring by `context` hops;
    no positions, no reduce-scatter."""
    m, _, got = context_records(SOFTWARE["torchtitan"])
    c, b_loc, s_loc, heads = 2, 4 // 2, 256 // 2, m.heads // 2     # fsdp 2, context 2, tensor 2
    kv_elems = 2 * b_loc * s_loc * heads * m.head_dim              # K and V, one buffer a shard
    gathered = kv_elems * 2 * c                                    # bf16, every rank's
    assert got == {(AG, "forward"): (m.layers, m.layers * gathered),
                   (AG, "backward"): (2 * m.layers, 2 * m.layers * gathered),
                   (PERMUTE, "backward"): (c * m.layers, c * m.layers * kv_elems * 4)}


def test_the_default_cp_traits_price_the_ring_as_before():
    """megatron-core keeps the default traits: its ring is the hand count of jaxpar's ring kernel (context-1
    hops of K and V over the KV heads of the tensor shard, forward, recompute and backward, and the int32
    positions forward and in the recompute), and its context time hides under the whole attention core;
    torchtitan's hides under the diagonal block's share only."""
    m, est, got = context_records(SOFTWARE["megatron-core"])
    c, b_loc, s_loc, kv_heads = 2, 2, 128, m.kv_heads // 2
    half = b_loc * s_loc * kv_heads * m.head_dim * 2               # K or V, bf16
    hops, pos = (c - 1) * m.layers * 2, b_loc * s_loc * 4
    assert got == {(PERMUTE, "forward"): (hops + (c - 1), hops * half + (c - 1) * pos),
                   (PERMUTE, "backward"): (2 * hops + (c - 1) * m.layers, 2 * hops * half + (c - 1) * m.layers * pos)}
    _, tt, _ = context_records(SOFTWARE["torchtitan"])
    core = dataclasses.replace(SOFTWARE["torchtitan"], cp_hide="core")
    _, whole, _ = context_records(core)
    assert tt.predicted == whole.predicted and tt.time.context > whole.time.context


def test_an_fsdp_that_spans_the_context_ranks_gathers_over_them():
    """torchtitan's FSDP spans its dp_shard x cp mesh and MaxText's `embed` rule its context axis: on 8 GPUs
    of Llama 3 8B, fsdp1 x context8 shards the weights 8 ways (memory) and so gathers and scatters them over
    the 8 ranks per layer exactly as fsdp8 does (the data-parallel records, field by field, with the group
    named fsdp x context), none of it hidden under the attention core; jaxpar's own program, whose rules do
    not shard weights over context, all-reduces the gradients over context instead (a data-parallel sum)."""
    m, hw = from_preset("llama3-8b"), load_hardware("h100-sxm")
    base = dict(dtype="bfloat16", remat="full", attention="ring")
    for name in ("torchtitan", "maxtext"):
        sw = SOFTWARE[name]
        cp = estimate(m, parse_inline("context=8").with_options(**base).resolved(8), hw, 8, 8192, sw)
        dp = estimate(m, parse_inline("fsdp=8").with_options(**base).resolved(8), hw, 8, 8192, sw)
        spanned = {(k, ph): (n, b) for k, axes, ph, n, b in cp.predicted if axes == ("fsdp", "context")}
        assert spanned == {(k, ph): (n, b) for k, axes, ph, n, b in dp.predicted if axes == ("fsdp",)}
        assert cp.memory.params == pytest.approx(dp.memory.params)
        assert cp.time.data_total == pytest.approx(dp.time.data_total)
    own = estimate(m, parse_inline("context=8").with_options(**base).resolved(8), hw, 8, 8192, SOFTWARE["jaxpar"])
    sums = [c for c in own.predicted if c[0] == AR and c[1] == ("context",)]
    assert sums and own.time.data_total > 0.0


def test_one_second_of_compute_hides_one_second_of_collectives():
    """The context exchanges hidden under the attention core leave that much less compute to hide the others
    under (hand numbers: 1 s of compute, 0.4 s of context under a 0.5 s core, 0.8 s of data-parallel
    collectives fully overlappable: 0.2 s of them show)."""
    hw = load_hardware("h100-sxm")
    comm = {"tensor": 0.0, "context": 0.4, "pipeline": 0.0, "expert": 0.0, "data": 0.8}
    t = cost_time.step_time(cost_time.Busy(1.0, attention_core=0.5), comm, cost_time.Hiding(data=1.0), 0.0, hw)
    assert (t.context, t.data) == (0.0, pytest.approx(0.2))
    alone = cost_time.step_time(cost_time.Busy(1.0, attention_core=0.5), comm | {"context": 0.0},
                                cost_time.Hiding(data=1.0), 0.0, hw)
    assert alone.data == 0.0


def test_plans_within_the_error_band_tie_and_plan_prints_the_band(capsys):
    """Another stack's plans tie within the paired band where published runs of it calibrate that hardware
    (jaxpar/cost/bands.toml [paired]: the error of the ratio of two published layouts' speeds, not the
    absolute error), jaxpar's within TIE_BAND (no published run of jaxpar's program); `plan` prints the
    stack's band, the paired band and the MFU convention."""
    from jaxpar.cost.band import paired_band
    from jaxpar.planning.planner import TIE_BAND, tie_band
    mc = estimate(from_preset("llama3-8b"), parse_inline("fsdp=8").with_options(dtype="bfloat16").resolved(8),
                  "h100-sxm", 16, 4096, SOFTWARE["megatron-core"])
    b = band_for("h100-sxm", "megatron-core")
    paired = paired_band()
    assert b is not None and paired.high is not None and tie_band(mc) == max(TIE_BAND, paired.high) > b.guide()
    assert tie_band(mc._replace(software="jaxpar")) == TIE_BAND
    assert cli.main(["plan", "--model", "llama3-8b", "--devices", "16", "--hardware", "h100-sxm", "--software",
                     "megatron-core", "--seq", "4096", "--global-batch", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"error band: ±{b.median:.0%} median" in out and "MFU = model FLOPs" in out
    assert f"out of sample ±{b.oos_median:.1%} median" in out and f"ties: the {paired.describe()}" in out
    assert "tie #1-" in out and f"within {paired.high:.1%}" in out


def test_plan_prices_float8_and_refuses_it_without_a_float8_peak(capsys):
    """plan --dtype float8 ranks layouts in float8 (faster than the same search in bf16 on an H100), for
    another stack and for jaxpar's own program (its scaled projections, jaxpar/ops/fp8.py), and refuses it
    on a profile without a float8 peak."""
    from jaxpar.planning import planner
    m, mc = from_preset("llama3-8b"), SOFTWARE["megatron-core"]
    best = {d: planner.plan(m, "h100-sxm", 8, 4096, 64, 1, mc, dtype=d)[0][0][0] for d in ("bfloat16", "float8")}
    assert best["float8"].step_time_s < best["bfloat16"].step_time_s
    args = ["plan", "--model", "llama3-8b", "--devices", "8", "--seq", "4096", "--global-batch", "64", "--top", "2",
            "--dtype", "float8"]
    own = {d: planner.plan(m, "h100-sxm", 8, 4096, 64, 1, SOFTWARE["jaxpar"], dtype=d)[0][0][0]
           for d in ("bfloat16", "float8")}
    assert own["float8"].step_time_s < own["bfloat16"].step_time_s
    assert cli.main([*args, "--hardware", "a100-80gb", "--software", "torchtitan"]) == 2
    assert "states no float8 peak" in capsys.readouterr().err
