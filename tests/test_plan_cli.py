"""`jaxpar plan` and `jaxpar estimate` say what they answer: the plan repeats its question and writes it
beside each mesh file as a run file that `estimate --run` asks again; ties are called ties and listed by
memory headroom, then simplicity; a plan fits only below HBM less the runtime's headroom; the labels
agree with the numbers beside them. All analytic (nothing compiles)."""
import dataclasses
import json
import re
import types

import pytest

from jaxpar.cli import main as cli
from jaxpar.core.schedule import schedule_summary
from jaxpar.core.strategy import Strategy, parse_inline
from jaxpar.cost import MEGATRON_CORE, estimate, format_estimate, load_hardware
from jaxpar.cost.estimate import HBM_HEADROOM
from jaxpar.models.config import parse_model
from jaxpar.planning import planner

PLAN = ["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--devices", "8", "--seq", "4096"]


def tokens_per_s(text: str, row: str) -> str:
    """The tokens/s figure of the line starting with `row` (a plan's rank, or the estimate's `step`)."""
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith(row))
    return re.search(r"(\d[\d,]+)(?: tokens/s|\s+\d+\.\d%)", line).group(1)


def test_plan_repeats_its_question_and_its_run_file_reproduces_it(tmp_path, capsys):
    """`plan --write DIR` (batch given in tokens) then `estimate --run DIR/plan-01-*.run.toml` with no other
    flag: the same tokens/s as the plan's first row; the header names model, devices, hardware, software,
    seq and the batch in sequences and tokens; a flag that disagrees with the run file is refused."""
    assert cli.main([*PLAN, "--global-batch-tokens", str(64 * 4096), "--top", "3", "--write", str(tmp_path)]) == 0
    plan_out = capsys.readouterr().out
    assert plan_out.startswith("question: llama3-8b (8.0B parameters) on 8 x h100-sxm, software jaxpar; seq 4,096, "
                               "global batch 64 sequences = 262,144 tokens\n"), plan_out[:300]
    assert f"{1 - HBM_HEADROOM:.0%} of 79.6 GiB HBM = 73.3 GiB (--hbm-headroom 0.08" in plan_out
    run_file = next(tmp_path.glob("plan-01-*.run.toml"))
    assert cli.main(["estimate", "--run", str(run_file)]) == 0
    est_out = capsys.readouterr().out
    assert tokens_per_s(est_out, "step") == tokens_per_s(plan_out, "1 ")
    assert "global batch 64 sequences x seq 4,096 = 262,144 tokens" in est_out
    assert cli.main(["estimate", "--run", str(run_file), "--seq", "2048"]) == 2
    assert "--seq 2048 disagrees with the run file's seq = 4096" in capsys.readouterr().err
    assert cli.main(["estimate", "--run", str(run_file), "--global-batch", "64"]) == 0   # agreeing flags are fine


def test_a_run_file_with_a_missing_or_mistyped_field_is_one_clear_error(tmp_path, capsys):
    """A hand-edited run file: a missing, mistyped or unknown field is one line naming it (exit 2)."""
    run = tmp_path / "x.run.toml"
    for text, message in (('mesh = "fsdp8"\nmodel = "llama3-8b"\n', "missing field(s) hardware, software, devices"),
                          ('mesh = "m.toml"\nmodel = "llama3-8b"\nhardware = "h100-sxm"\nsoftware = "jaxpar"\n'
                           'devices = "8"\nseq = 4096\nglobal_batch = 64\n', "devices = '8' is not an integer"),
                          ('mesh = "m.toml"\nlayers = 3\n', "unknown field(s) layers")):
        run.write_text(text)
        assert cli.main(["estimate", "--run", str(run)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err


def test_global_batch_tokens_is_the_batch_in_sequences_times_seq(tmp_path, capsys):
    """--global-batch-tokens T gives the estimate of --global-batch T/seq; one error when seq does not divide T."""
    common = ["estimate", "--model", "llama3-8b", "--mesh", "fsdp=8", "--hardware", "h100-sxm", "--seq", "2048"]
    by_seq, by_tok = tmp_path / "seq.json", tmp_path / "tok.json"
    assert cli.main([*common, "--global-batch", "32", "--json", str(by_seq)]) == 0
    assert cli.main([*common, "--global-batch-tokens", str(32 * 2048), "--json", str(by_tok)]) == 0
    assert json.loads(by_seq.read_text()) == json.loads(by_tok.read_text())
    capsys.readouterr()
    assert cli.main([*common, "--global-batch-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--global-batch-tokens=100,000 is not divisible by --seq=2,048" in err and len(err.splitlines()) == 1
    assert cli.main([*PLAN, "--global-batch-tokens", "4097"]) == 2


def fake(step_s: float, gib: float, mesh: str):
    """A ranked pair with only what `rank` reads: step time, memory and usable HBM, mesh axes, and the
    (family, software) of the error band, jaxpar's (none: ties within TIE_BAND)."""
    est = types.SimpleNamespace(step_time_s=step_s, tokens_per_s=1 / step_s, memory=types.SimpleNamespace(total=gib),
                                usable_bytes=80.0, name=mesh, family="h100-sxm", software="jaxpar")
    return est, parse_inline(mesh)


def test_ties_are_marked_and_the_ranking_stays_fastest_first():
    """Synthetic plans against a hand-made order: A, C, B within 0.5% of A's step time; D 1% behind A, E within
    the band of D; F far behind: listed by step time, whatever their free memory; two plans of one step time
    by the most free memory, then fewer axes (G as fast as A, less free: after it; H as A, fewer axes: before it)."""
    a, b, c = fake(1.000, 40, "data=2,fsdp=2,tensor=2"), fake(1.004, 20, "data=2,fsdp=2,tensor=2"), fake(1.003, 20, "fsdp=4,tensor=2")
    d, e, f = fake(1.010, 10, "fsdp=8"), fake(1.012, 5, "data=8"), fake(1.2, 1, "data=8")
    ranked = planner.rank([f, e, d, c, b, a])
    assert [est.name for est, _ in ranked] == [x[0].name for x in (a, c, b, d, e, f)]
    assert planner.tie_spans(ranked) == [(0, 2)] * 3 + [(3, 4)] * 2 + [(5, 5)]
    assert planner.TIE_BAND == planner.tie_band(a[0]) == 0.005
    g, h = fake(1.000, 50, "data=2,fsdp=2,tensor=2"), fake(1.000, 40, "fsdp=8")
    assert planner.rank([g, a, h]) == [h, a, g]


def test_a_plan_marks_its_ties_and_says_ahead_only_outside_the_band(capsys):
    """A real search with tied plans: listed fastest first, each tie group marked `tie #i-#j`, explained
    below the table; `ms/step ahead` only where the next group is more than the band behind."""
    model = parse_model("llama3-8b")
    results, considered, valid = planner.plan(model, "h100-sxm", 8, 4096, 64, top=8)
    spans = planner.tie_spans(results)
    assert any(last > first for first, last in spans)
    times = [r[0].step_time_s for r in results]
    assert times == sorted(times)
    text = planner.format_plan(results, considered, valid).splitlines()
    assert "fastest first;" in text[0] and "headroom" not in text[0]
    rows = text[2:2 + len(results)]
    for i, ((first, last), row) in enumerate(zip(spans, rows)):
        if last > first:
            assert row.endswith(f"tie #{first + 1}-#{last + 1}")
            assert times[last] <= times[first] * (1 + planner.TIE_BAND)
        elif "ahead" in row:
            nxt = min(r[0].step_time_s for r in results[last + 1:])
            assert nxt > results[i][0].step_time_s * (1 + planner.TIE_BAND)
    assert any(line.startswith("tie: step times within 0.5%") for line in text)


def test_a_plan_at_97_percent_of_hbm_does_not_fit_under_the_headroom():
    """On a device whose HBM the best headroom-free plan fills to 97%, that plan fits with --hbm-headroom 0
    and not with the default: neither `estimate`'s verdict nor the planner's list shows it as fitting."""
    model, h100 = parse_model("llama3-8b"), load_hardware("h100-sxm")
    (best, st), = planner.plan(model, h100, 8, 4096, 64, top=1, headroom=0.0)[0]
    hw = dataclasses.replace(h100, hbm_bytes=best.memory.total / 0.97)
    assert estimate(model, st, hw, 64, 4096, headroom=0.0).fits
    tight = estimate(model, st, hw, 64, 4096, headroom=HBM_HEADROOM)
    assert not tight.fits and "does NOT fit" in format_estimate(tight)
    listed, _, _ = planner.plan(model, hw, 8, 4096, 64, top=10_000)
    assert listed and st not in [s for _, s in listed]
    assert all(e.memory.total <= (1 - HBM_HEADROOM) * hw.hbm_bytes for e, _ in listed)


@pytest.mark.parametrize("mesh, options, software, named", [
    ("fsdp=8", {}, None, ""),
    ("context=2,fsdp=4", {"attention": "ring"}, None, "QK^T"),
    ("pipeline=4,data=2", {"pp_schedule": "1f1b", "microbatches": 8}, None, "1F1B-chunks"),
    ("fsdp=8", {}, MEGATRON_CORE, "QK^T"),
])
def test_remat_label_names_what_the_recompute_flops_count(mesh, options, software, named):
    """remat=none sits beside a recompute count only with the count's source named (`remat=none+X`)."""
    model = parse_model("llama3-8b")
    st = parse_inline(mesh).with_options(remat="none", dtype="bfloat16", **options)
    est = estimate(model, st, "h100-sxm", 64, 4096, *([software] if software else []))
    label = planner.remat_label(st, est)
    assert (label != "remat=none") == (est.flops.recompute > 0) and named in label
    assert label in planner.describe(st, est) and (not named or f"({label})" in format_estimate(est, label))


def test_long_pipelines_print_their_split_as_runs():
    """80 stages of one unit read `1x80`, not eighty `1+`; short splits stay written out."""
    st = Strategy(name="pp80", mesh=(("pipeline", 80),)).with_options(microbatches=80)
    line = schedule_summary(st, 80)
    assert "units per chunk 1x80 = 80" in line and len(line) < 200
    assert "units per chunk 2+3+3+2 = 10" in schedule_summary(parse_inline("pipeline=4").with_options(microbatches=4), 10)
