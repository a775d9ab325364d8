"""Pipeline timetables (jaxpar/core/timetable.py) against the arithmetic their papers state
(jaxpar/core/schedule.py: stated_idle, stated_activations), and `jaxpar schedule`. Every timetable is first
checked by an independent replay: each pass once, no two passes of a stage at once, none before its input."""
from __future__ import annotations

import json

import pytest

from jaxpar.cli.main import main
from jaxpar.core import timetable, validate
from jaxpar.core.schedule import stated_activations, stated_idle
from jaxpar.core.strategy import parse_inline
from jaxpar.core.timetable import Times
from jaxpar.cost import SOFTWARE, estimate, load_hardware
from jaxpar.errors import ConfigError
from jaxpar.models.config import from_preset
from jaxpar.planning import planner

EQUAL, UNEQUAL = Times(), Times(1.0, 1.2, 0.7)
GRID = [(S, M) for S in (2, 4, 8) for M in (S, 2 * S, 4 * S)]


def replay(t: timetable.Timetable, times: Times) -> None:
    """Assert `t` is a valid timetable, from its slots alone: every (pass, micro-batch, chunk) the schedule
    needs exactly once with its duration (a chunk's backward whole, BW, or split, B and W), on the stage
    that holds the chunk, a stage running one pass at a time, and each pass starting after what it reads:
    the previous chunk's F, the next chunk's backward (the last chunk's own F: the loss), its B for a W."""
    seen = {(s.op.kind, s.op.mb, s.op.chunk): s for s in t.slots}
    assert len(seen) == len(t.slots)
    for mb in range(t.microbatches):
        for c in range(t.chunks):
            passes = {k for k in ("F", "B", "W", "BW") if (k, mb, c) in seen}
            assert passes in ({"F", "BW"}, {"F", "B", "W"}), (mb, c, passes)
    per_stage = t.chunks // t.stages
    place = list(range(t.stages)) + list(reversed(range(t.stages))) if per_stage == 2 else list(range(t.stages))
    full = {"F": times.f, "B": times.b, "W": times.w, "BW": times.b + times.w}

    def backward(mb, c):
        return seen.get(("B", mb, c)) or seen["BW", mb, c]
    for (kind, mb, c), s in seen.items():
        assert s.stage == place[c]
        assert s.end - s.start == pytest.approx(full[kind] / per_stage)
        if kind == "F" and c > 0:
            assert s.start >= seen["F", mb, c - 1].end - 1e-9
        if kind in ("B", "BW"):
            after = seen["F", mb, c] if c == t.chunks - 1 else backward(mb, c + 1)
            assert s.start >= after.end - 1e-9
        if kind == "W":
            assert s.start >= seen["B", mb, c].end - 1e-9
    for stage in range(t.stages):
        mine = sorted((s.start, s.end) for s in t.slots if s.stage == stage)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("kind", timetable.KINDS)
def test_each_timetable_idles_as_its_paper_states_and_holds_what_it_claims(kind):
    """At T_F = T_B = T_W, for S in {2, 4, 8} and M in {S, 2S, 4S} (DualPipe-V: M >= 2S, as dualpipev.py
    asserts): a valid timetable whose idle time per stage (the step ending in a synchronization) is the
    stated formula's, and whose most activations held on any stage is the stated claim."""
    for S, M in GRID:
        if kind == "dualpipe-v" and M < 2 * S:
            continue
        t = timetable.simulate(kind, S, M, EQUAL)
        replay(t, EQUAL)
        assert t.idle == pytest.approx(stated_idle(kind, S, EQUAL)[0]), (S, M)
        assert max(t.peak_in_flight(s) for s in range(S)) == stated_activations(kind, S, M)[0], (S, M)


def test_the_general_formulas_hold_at_unequal_times():
    """GPipe's, 1F1B's and ZB-H1's bubbles are stated for any T_F, T_B, T_W (ZB-H1 where T_W <= T_F, T_B):
    equal at 1, 1.2, 0.7; DualPipe-V's timetable stays within its README's (PP/2-1)(F&B+B-3W)."""
    for S, M in GRID:
        for kind in ("gpipe", "1f1b", "zb-h1"):
            t = timetable.simulate(kind, S, M, UNEQUAL)
            replay(t, UNEQUAL)
            assert t.idle == pytest.approx(stated_idle(kind, S, UNEQUAL)[0]), (kind, S, M)
        if M >= 2 * S:
            t = timetable.simulate("dualpipe-v", S, M, UNEQUAL)
            replay(t, UNEQUAL)
            assert t.idle <= stated_idle("dualpipe-v", S, UNEQUAL)[0] + 1e-9


def test_zero_bubble_needs_the_split_backward_and_post_validation():
    """ZB-H1 idles a third of 1F1B at equal times (Qi et al.'s "one third"); ZB-H2 idles nothing between a
    stage's first and last pass once M >= 2S-1 (the post-validated zero), all of its idle being the
    synchronized start (S-1) T_F; 1F1B's idle is the same with or without the synchronization."""
    for S, M in GRID:
        one = timetable.simulate("1f1b", S, M)
        assert timetable.simulate("zb-h1", S, M).idle * 3 == pytest.approx(one.idle)
        assert one.idle_between == pytest.approx(one.idle)
        if M >= 2 * S - 1:
            h2 = timetable.simulate("zb-h2", S, M)
            assert h2.idle_between == pytest.approx(0.0) and h2.idle == pytest.approx(S - 1)


def test_a_hand_laid_1f1b_and_zb_h1():
    """S = 2, M = 3 laid out by hand: 1F1B's first stage warms up with one forward and waits for each
    backward's input (idle 3 = (S-1)(T_F+T_B+T_W)); ZB-H1's last stage defers one W, its first none (idle
    1 = (S-1)(T_F+T_B-T_W))."""
    assert timetable.text(timetable.simulate("1f1b", 2, 3)).splitlines() == [
        "stage 0  F0 F1 .. .. X0 X0 F2 X1 X1 .. X2 X2",
        "stage 1  .. F0 X0 X0 F1 X1 X1 F2 X2 X2 .. ..",
    ]
    assert timetable.text(timetable.simulate("zb-h1", 2, 3)).splitlines() == [
        "stage 0  F0 F1 .. B0 W0 F2 B1 W1 B2 W2",
        "stage 1  .. F0 B0 F1 B1 W0 F2 B2 W1 W2",
    ]


def test_dualpipe_v_runs_every_deferred_weight_gradient_in_its_order():
    """Each rank's DualPipe-V order (dualpipev.py's eight steps) holds every F, B and W of its two chunks
    once, each W after its own B, and its backwards defer exactly as many Ws as its W steps run."""
    S, M = 4, 10
    for rank in range(S):
        order = timetable.dualpipe_v(rank, S, M)
        keys = [(p.kind, p.mb, p.chunk) for p in order]
        assert len(keys) == len(set(keys))
        for p in order:
            if p.kind == "W":
                assert keys.index(("B", p.mb, p.chunk)) < keys.index(("W", p.mb, p.chunk))
        done = {(k, c) for k, _, c in keys}
        assert done <= {(k, c) for k in ("F", "B", "W", "BW") for c in (rank, 2 * S - 1 - rank)}
        assert sum(p.kind == "W" for p in order) == sum(p.kind == "B" for p in order)


def test_schedule_prints_the_timetable_bubble_and_json(tmp_path, capsys):
    """`jaxpar schedule` prints the timetable, the bubble beside the stated formula, and writes `bubble`
    in its JSON; bad input is one line before any work."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "zbv.json", tmp_path / "zbv.png"
    assert main(["schedule", "--pp-schedule", "zb-v", "--stages", "4", "--microbatches", "8",
                 "--json", str(out), "--figure", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    info = json.loads(out.read_text())
    assert "stage 3" in text and f"bubble {info['bubble']:.1%}" in text and "Controllable Memory" in text
    assert info["bubble"] == pytest.approx(1.5 / 25.5) and info["peak_activations"] == [8] * 4
    assert main(["schedule", "--pp-schedule", "dualpipe-v", "--stages", "4", "--microbatches", "6"]) == 2
    assert "microbatches >= 2 x stages" in capsys.readouterr().err
    assert main(["schedule", "--pp-schedule", "1f1b", "--stages", "1", "--microbatches", "4"]) == 2
    assert "stages >= 2" in capsys.readouterr().err
    assert main(["schedule", "--pp-schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--times", "1,0,1"]) == 2
    assert "must be >" in capsys.readouterr().err
    assert main(["schedule", "--pp-schedule", "1f1b", "--stages", "2", "--microbatches", "4096"]) == 2
    assert "512 micro-batches (got stages=2, microbatches=4096)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="has no timetable"):
        timetable.check("zb-h3", 4, 8)


def test_the_estimate_prices_a_stacks_zero_bubble_schedule_as_its_timetable():
    """torchtitan runs ZB-V and DualPipe-V (torch.distributed.pipelining): the estimate's bubble over its
    compute is the timetable's idle over its work at T_F = T_B = T_W (a sanity check: the ranking follows
    from the formulas), ZB-V holds 1F1B's activations and DualPipe-V S + 1/2 stages' of them (2S+1 half
    chunks); jaxpar's program refuses them in one line, as DualPipe-V refuses M < 2S."""
    model, S, M = from_preset("llama3-70b"), 8, 16

    def priced(kind, m=M, batch=256):
        st = parse_inline("fsdp=8,pipeline=8").with_options(pp_schedule=kind, microbatches=m, dtype="bfloat16")
        return estimate(model, st.resolved(64), "h100-sxm", batch, 4096, SOFTWARE["torchtitan"])
    one = priced("1f1b")
    per_microbatch = one.memory.activations - priced("1f1b", S - 1, 8 * (S - 1) * 2).memory.activations   # S vs S-1 held
    for kind in ("zb-v", "dualpipe-v"):
        est, t = priced(kind), timetable.simulate(kind, S, M)
        assert est.time.bubble / est.time.compute == pytest.approx(t.idle / t.work)
        extra = {"zb-v": 0.0, "dualpipe-v": 0.5}[kind]
        assert est.memory.activations - one.memory.activations == pytest.approx(extra * per_microbatch, abs=2**20)
    with pytest.raises(ConfigError, match="jaxpar's program runs gpipe, circular and 1f1b"):
        st = parse_inline("data=4,pipeline=2").with_options(pp_schedule="zb-v", microbatches=4)
        validate.check(from_preset("llama-tiny"), st.resolved(8), batch=16, seq=16)


def test_the_planner_searches_the_schedules_a_stack_runs():
    """`plan --software torchtitan` prices its three pipeline schedules; on one mesh and micro-batch count the
    smaller bubble ranks first: ZB-V ((S-1)/2), then DualPipe-V (S-1), then 1F1B (3(S-1), in T_F units)."""
    plans, _, _ = planner.plan(from_preset("llama3-70b"), load_hardware("h100-sxm"), 64, 4096, 256, top=10**9,
                               software=SOFTWARE["torchtitan"], dtype="bfloat16")
    piped = [(est, st) for est, st in plans if st.size("pipeline") > 1]
    assert {st.options.pp_schedule for _, st in piped} == {"1f1b", "zb-v", "dualpipe-v"}
    by = {}
    for est, st in piped:
        key = (st.name, st.options.microbatches, st.options.remat, st.options.grad_accum, st.zero)
        by.setdefault(key, {})[st.options.pp_schedule] = est.tokens_per_s
    full = [v for v in by.values() if len(v) == 3]
    assert full and all(v["zb-v"] > v["dualpipe-v"] > v["1f1b"] for v in full)
