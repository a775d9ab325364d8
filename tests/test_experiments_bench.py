"""The demo and every benchmark under experiments/ run end to end in their --quick mode and write what they
should: the checks read the markdown tables (and figure) back and compare the numbers that have an
independent reference: the demo's losses against the 1-device loss, the context balance against its closed
form, the pipeline's iterations and bubble against T = v*M + S - 1, the cost model's configuration count
against a count of factorisations, the Mamba bench's parameter counts against the model's own arrays.
(The design guide's studies: tests/test_experiments_study.py.)
"""
from __future__ import annotations

import itertools
import math
import pathlib
import re

import pytest

from tests.experiments_read import number, read_results, run_quick, table, tables


def check_demo(out: pathlib.Path, stdout: str) -> None:
    text = read_results(out, "demo")
    batch, seq = map(int, re.search(r"batch (\d+) x seq (\d+)", text).groups())
    rows = table(text, "strategy")
    assert rows[0]["strategy"] == "1 device" and len(rows) >= 3, rows
    ref = number(rows[0]["final loss"])
    assert abs(ref - math.log(256)) < 1.0, f"llama-tiny (vocab 256) loss {ref} is far from ln 256 after a few steps"
    for r in rows:
        loss = number(r["final loss"])
        assert abs(loss - ref) < 1e-4, f"{r['strategy']}: loss {loss} vs 1 device {ref}"
        assert number(r["abs(loss - 1-device)"]) < 1e-4, r
        ms = number(r["step time (ms)"])
        assert ms > 0, r
        # tokens/s is batch * seq over the step time (which the table rounds to 0.1 ms)
        assert number(r["tokens/s"]) == pytest.approx(batch * seq / (ms / 1e3), rel=0.06, abs=1), r
    assert "jaxpar launch" not in {r["strategy"] for r in rows}, "--quick should skip the 2-process row"


def check_bench_comm(out: pathlib.Path, stdout: str) -> None:
    text = read_results(out, "bench_comm")
    assert "llama-tiny" in text.splitlines()[0]
    (row,) = table(text, "devices")
    assert number(row["devices"]) == 16
    for column in ("wall s", "CPU s", "peak RSS GB", "collective bytes / device / step", "peak memory / device"):
        assert number(row[column]) > 0, (column, row)
    assert number(row["XLA compile s"]) <= number(row["wall s"]), row  # the compile runs inside the child


def check_bench_context_parallel(out: pathlib.Path, stdout: str) -> None:
    text = read_results(out, "bench_context_parallel")
    memory = {r["strategy"]: r for r in table(text, "strategy")}
    dense, ring, allgather = (memory[k] for k in ("dense, context=1", "ring, context=8", "allgather, context=8"))
    assert number(dense["vs dense"]) == 1.0
    assert 0 < number(ring["temp MiB / device"]) < number(allgather["temp MiB / device"]) \
        < number(dense["temp MiB / device"]), memory
    balance = {r["layout"]: r for r in table(text, "layout")}
    seq = int(re.search(r"causal work balance over context=8, seq=(\d+)", text).group(1))
    # Contiguous: device i holds tokens [iL, (i+1)L) and token t attends to t + 1 keys.
    local = seq // 8
    first = sum(t + 1 for t in range(local))
    last = sum(t + 1 for t in range(7 * local, 8 * local))
    assert number(balance["contiguous"]["unmasked max/min"]) == pytest.approx(last / first, abs=5e-4)
    assert number(balance["zigzag"]["unmasked max/min"]) == 1.0  # pairs chunk i with chunk 2C-1-i
    assert number(balance["zigzag"]["ring critical path (quarters)"]) \
        < number(balance["contiguous"]["ring critical path (quarters)"])
    assert balance["zigzag"]["ring total (quarters)"] == balance["contiguous"]["ring total (quarters)"]
    for r in balance.values():
        assert number(r["ring fwd+bwd s"]) > 0 and number(r["allgather fwd+bwd s"]) > 0, r


def check_bench_estimate(out: pathlib.Path, stdout: str) -> None:
    text = read_results(out, "bench_estimate", figure=False)
    pows = [2 ** i for i in range(10)]
    factorisations = sum(d * f * p * t == 512
                         for d, f, p, t in itertools.product(pows, pows, [1, 2, 4, 8], [1, 2, 4, 8]))
    assert f"{factorisations * 2 * 2} distinct configurations" in text  # x 2 option variants x 2 models
    rows = {r["measure"].split(" (")[0]: r for r in table(text, "measure")}
    assert set(rows) == {"single configuration, cold", "best block", "median block", "with to_json()"}, rows
    for r in rows.values():
        us = number(r["us per estimate"])
        assert us > 0 and number(r["configurations/s"]) == pytest.approx(1e6 / us, rel=1e-2, abs=1), r
    assert number(rows["best block"]["us per estimate"]) <= number(rows["median block"]["us per estimate"])
    walls = {r["process (best of 3)"]: number(r["wall s"]) for r in table(text, "process (best of 3)")}
    assert set(walls) == {"jaxpar estimate (llama3-8b, fsdp8, h100-sxm)"} and min(walls.values()) > 0


def check_bench_startup(out: pathlib.Path, stdout: str) -> None:
    """The closing line's phases add up to its wall (the rest is what they leave), which the process's own
    wall, measured outside it, bounds."""
    text = read_results(out, "bench_startup", figure=False)
    (row,) = table(text, "tree")
    phases = [number(row[k]) for k in ("imports", "compile", "initialisation", "steps", "the rest")]
    assert all(t >= 0 for t in phases) and min(phases[:3]) > 0, row
    assert sum(phases) == pytest.approx(number(row["printed wall"]), abs=0.3), row  # each rounded to 0.1 s
    assert number(row["printed wall"]) <= number(row["process wall"]) + 0.1, row
    assert number(row["imports + initialisation / compile"]) == pytest.approx(
        (phases[0] + phases[2]) / phases[1], abs=0.01), row
    assert number(table(text, "process (best of 3)")[0]["wall s"]) > 0


def check_bench_mamba(out: pathlib.Path, stdout: str) -> None:
    import jax  # noqa: PLC0415  (the suite's 8 simulated devices; nothing compiles here)

    from jaxpar.models.config import parse_model  # noqa: PLC0415
    from jaxpar.core.strategy import parse_strategy  # noqa: PLC0415
    from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: PLC0415

    text = read_results(out, "bench_mamba")
    params = table(text, "model", "parameters")
    assert [r["model"].split(":")[0] for r in params] == ["mamba2-tiny", "llama-tiny"], params
    for r in params:  # the analytic count against the model's own parameter arrays
        tr = Trainer(parse_model(r["model"]), parse_strategy("data=1"), TrainConfig(batch=8, seq=64),
                     devices=jax.devices()[:1])
        assert number(r["parameters"]) == sum(math.prod(a.shape) for a in jax.tree.leaves(tr.abstract_params)), r
    tokens = table(text, "model", "1 device", "dp8")
    assert len(tokens) == 2, tokens
    for r in tokens:
        assert number(r["1 device"]) > 0 and number(r["dp8"]) > 0, r
    growth = table(text, "seq")
    assert len(growth) >= 2, growth
    first = growth[0]
    assert number(first["x"]) == 1.0 and number(first["mamba s"]) > 0, first
    for r in growth:
        assert number(r["mamba s"]) > 0, r
        assert r["attention s"] == "skipped" or number(r["attention s"]) > 0, r


def check_bench_inference(out: pathlib.Path, stdout: str) -> None:
    """Greedy generation gives the same tokens under every layout; the model's decode tokens/s grows with
    the batch; llama3-70b's bf16 weights (70.6e9 x 2 bytes = 131 GiB) cannot sit on one 80 GB GPU (data=8)."""
    text = read_results(out, "bench_inference")
    assert "same tokens under every layout: yes" in text
    cpu = table(text, "layout", "time to first token ms")
    assert {r["layout"] for r in cpu} == {"data=8", "tensor=8"}
    rows = table(text, "model", "layout", "batch")
    for model, layout in {(r["model"], r["layout"]) for r in rows}:
        speeds = [number(r["decode tokens/s"]) for r in rows if (r["model"], r["layout"]) == (model, layout)]
        assert speeds == sorted(speeds), (model, layout, speeds)
    big = [r for r in rows if r["model"] == "llama3-70b" and r["layout"] == "data=8"]
    assert big and all(r["fits"] == "no" and number(r["memory GiB / device"]) > 131 for r in big)


def check_bench_moe(out: pathlib.Path, stdout: str) -> None:
    """The cost model's wire bytes equal the compiled step's; only expert parallelism has all-to-alls;
    it holds 1/8 of the experts (less state per device than replicating them)."""
    rows = {r["layout"]: r for r in table(read_results(out, "bench_moe"), "layout")}
    assert set(rows) == {"ep8", "dp8"}
    for r in rows.values():
        assert number(r["predicted wire B / token"]) == pytest.approx(number(r["wire B / token"]), rel=0.01)
    assert number(rows["ep8"]["expert all-to-all B / token"]) > 0 == number(rows["dp8"]["expert all-to-all B / token"])
    assert number(rows["ep8"]["params+optimizer MiB / device"]) < number(rows["dp8"]["params+optimizer MiB / device"])


def check_bench_floor(out: pathlib.Path, stdout: str) -> None:
    """The ratio is compiled / floor; the cost model (XLA:CPU) equals the compiled bytes; the floor is
    no more than the GPU prediction; dp8 is at its floor."""
    rows = {r["strategy"]: r for r in table(read_results(out, "bench_floor", figure=False), "strategy")}
    assert set(rows) == {"dp8", "tp8"}
    for r in rows.values():
        wire, floor = number(r["compiled wire B"]), number(r["floor B"])
        assert number(r["compiled / floor"]) == pytest.approx(wire / floor, abs=1e-3)
        assert number(r["CPU model B"]) == pytest.approx(wire, rel=0.01)
        assert floor <= number(r["GPU model B"]) * (1 + 1e-6)
    assert number(rows["dp8"]["compiled / floor"]) <= 1.05


def check_bench_fp8(out: pathlib.Path, stdout: str) -> None:
    """Every recipe gathers the same weights in the same bytes as bfloat16, --fp8-gather as many in fewer
    (the projections at half: float16 against XLA:CPU's float32); float8 adds all-reduces (its scales' amax
    over the fsdp shards); each recipe has its gap."""
    text = read_results(out, "bench_fp8")
    rows = {r["precision"]: r for r in table(text, "precision", "step s")}
    gathered = "float8 tensorwise --fp8-gather"
    assert set(rows) == {"bfloat16", "float8 tensorwise", "float8 rowwise", "float8 blockwise", gathered}
    base = rows["bfloat16"]
    for name, r in rows.items():
        same = (r["all-gathers"], r["gathered MiB"]) == (base["all-gathers"], base["gathered MiB"])
        assert same or name == gathered, name
        assert name == "bfloat16" or number(r["all-reduces"]) > number(base["all-reduces"]), name
    assert rows[gathered]["all-gathers"] == base["all-gathers"]
    assert 0.5 * number(base["gathered MiB"]) < number(rows[gathered]["gathered MiB"]) < number(base["gathered MiB"])
    gaps = {r["precision"]: number(r["largest gap of the 20-step means to bfloat16"])
            for r in table(text, "precision", "largest gap of the 20-step means to bfloat16")}
    assert set(gaps) == set(rows) - {"bfloat16", gathered} and all(0 < g < 0.02 for g in gaps.values()), gaps


def check_bench_overlap(out: pathlib.Path, stdout: str) -> None:
    """The option turns the layers' gathers and scatters over tensor into permutes; the cost model's wire
    bytes equal the compiled step's, with and without it."""
    rows = {r["overlap"]: r for r in table(read_results(out, "bench_overlap", figure=False), "layout")}
    assert set(rows) == {"none", "collective_matmul"}
    for r in rows.values():
        assert number(r["predicted wire B / token"]) == pytest.approx(number(r["wire B / token"]), rel=0.01)
    assert number(rows["none"]["permutes over tensor"]) == 0 < number(rows["collective_matmul"]["permutes over tensor"])
    assert number(rows["collective_matmul"]["AG/RS/AR over tensor"]) < number(rows["none"]["AG/RS/AR over tensor"])
    # the cost model's H100 figures: each option hides only its own class, the compute never moves
    pred = {r["options"]: r for r in table(read_results(out, "bench_overlap", figure=False), "options", "step s")}
    none, cm, pf = pred["none"], pred["collective_matmul"], pred["fsdp_prefetch"]
    assert len({r["compute s"] for r in pred.values()}) == 1 and len({r["data total s"] for r in pred.values()}) == 1
    assert number(cm["tensor exposed s"]) < number(none["tensor exposed s"]) and cm["data exposed s"] == none["data exposed s"]
    assert number(pf["data exposed s"]) < number(none["data exposed s"]) and pf["tensor exposed s"] == none["tensor exposed s"]
    assert all(number(pred["all three"]["step s"]) <= number(r["step s"]) for r in pred.values())
    assert number(none["step s"]) == pytest.approx(number(none["compute s"]) + number(none["tensor exposed s"])
                                                   + number(none["data exposed s"]), rel=0.01)


def check_bench_pipeline(out: pathlib.Path, stdout: str) -> None:
    text = read_results(out, "bench_pipeline")
    rows = table(text, "mesh")
    assert rows[0]["mesh"] == "data=8" and number(rows[0]["measured"]) == 1.0, rows[0]
    schedules = {r["schedule"] for r in rows[1:]}
    assert schedules == {"gpipe", "circular"}, rows   # --quick; the full run adds 1f1b and 1f1b v=2
    stages = 4
    for r in rows[1:]:
        v, m = (2 if r["schedule"] in ("circular", "1f1b v=2") else 1), int(r["M"])
        iterations = v * m + stages - 1            # stage forwards per step, 1F1B's too
        bubble = (iterations - v * m) / iterations
        recompute = 4 / 3 if r["schedule"].startswith("1f1b") else 1.0
        assert int(r["T"]) == iterations, r
        assert number(r["ideal bubble"]) == pytest.approx(bubble, abs=5e-4), r
        assert number(r["predicted time / no-pipeline"]) == pytest.approx(recompute / (1 - bubble), abs=5e-3), r
        assert number(r["measured"]) > 0 and number(r["temp MiB/device"]) > 0, r
    memory = table(text, "M", "GPipe bytes")
    assert memory and all(int(r["1F1B bytes"]) < int(r["GPipe bytes"]) for r in memory), memory


def check_bench_attention(out: pathlib.Path, stdout: str) -> None:
    """seq x2 past the blockwise kernel's 512-token blocks: dense's temporaries (every layer's scores) grow
    by more than x3, blockwise's by less than x2.5; the cost model's activation bytes within 10% of XLA's
    temp for each; every configuration trained."""
    text = read_results(out, "bench_attention")
    rows = table(text, "seq")
    first, last = rows[0], rows[-1]
    assert number(last["seq"]) == 2 * number(first["seq"]), rows
    grow = {k: number(last[f"{k} temp MiB"]) / number(first[f"{k} temp MiB"]) for k in ("dense", "blockwise")}
    assert grow["dense"] > 3 and grow["blockwise"] < 2.5, grow
    for r in rows:
        for k in ("dense", "blockwise"):
            assert number(r[f"{k} model MiB"]) == pytest.approx(number(r[f"{k} temp MiB"]), rel=0.10), r
    steps = table(text, "layout", "kernel")
    assert {(r["layout"], r["kernel"]) for r in steps} == {(a, k) for a in ("fsdp8", "fsdp4-tp2")
                                                            for k in ("dense", "blockwise")}
    assert all(number(r["step s"]) > 0 for r in steps), steps


def check_soak(out: pathlib.Path, stdout: str) -> None:
    """3 SIGKILLs of a 60-step run, each resumed: every resume restored, the final state bitwise the
    uninterrupted run's (the script compares the two last checkpoints' arrays), each step logged once, and
    no kill lost more than a checkpoint interval plus the step a save overlaps."""
    text = read_results(out, "soak", figure=False)
    rows = {r["measure"]: r["value"] for r in table(text, "measure")}
    assert number(rows["kills"]) == 3 == number(rows["resumes"]), rows
    assert sum(number(rows[f"kills during {k}"]) for k in ("step", "save", "compile")) == 3, rows
    assert number(rows["resumes that failed to restore"]) == 0, rows
    assert number(rows["arrays differing from the uninterrupted run"]) == 0, rows
    assert rows["metrics JSONL holds every step once"] == "yes", rows
    assert number(rows["steps lost per kill (max)"]) <= number(rows["bound on steps lost per kill"]), rows
    assert number(rows["checkpoints left, each restored"]) >= 1, rows


def check_bench_deepseek(out: pathlib.Path, stdout: str) -> None:
    """The cache per token and layer is the hand count (deepseek-tiny: (16 + 4) x 4 bytes; GQA of its 4 heads
    of 12: 2 x 4 x 12 x 4), and the absorbed decode step reads fewer bytes than the expanded one."""
    text = read_results(out, "bench_deepseek")
    decode = {(r["attention"], r["cache read"]): r for r in table(text, "attention", "cache read")}
    assert {k: number(r["cache B per token and layer"]) for k, r in decode.items()} == {
        ("latent attention", "absorbed"): 80, ("latent attention", "expanded"): 80, ("GQA", "K/V"): 384}
    absorbed, expanded = (number(decode[("latent attention", w)]["decode step bytes accessed"])
                          for w in ("absorbed", "expanded"))
    assert 0 < absorbed < expanded, decode
    train = {r["attention"]: r for r in table(text, "attention", "tokens/s")}
    assert set(train) == {"latent attention", "GQA"} and all(number(r["tokens/s"]) > 0 for r in train.values())


CHECKS = {
    "demo": check_demo,
    "bench_deepseek": check_bench_deepseek,
    "bench_attention": check_bench_attention,
    "bench_comm": check_bench_comm,
    "bench_context_parallel": check_bench_context_parallel,
    "bench_estimate": check_bench_estimate,
    "bench_floor": check_bench_floor,
    "bench_fp8": check_bench_fp8,
    "bench_inference": check_bench_inference,
    "bench_mamba": check_bench_mamba,
    "bench_moe": check_bench_moe,
    "bench_overlap": check_bench_overlap,
    "bench_pipeline": check_bench_pipeline,
    "bench_startup": check_bench_startup,
    "soak": check_soak,
}



# The quick modes whose sweeps compile the most (10 to 40 s each on 2 cores): `make test-slow` runs them
# (CI runs it after `make test`), `make bench` runs them in full.
SLOW = {"bench_attention", "bench_context_parallel", "bench_deepseek", "bench_fp8", "bench_mamba", "bench_moe", "bench_pipeline",
        "bench_startup", "soak"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CHECKS)])
def test_quick_mode(name, tmp_path):
    run_quick(name, tmp_path, CHECKS[name])
