"""Metrics that never silently go wrong across a resume, and the bad-input classes that reached a raw
traceback or were accepted: each refused in one line `jaxpar: error: ...`, exit 2, before anything
compiles (the commands run in this process, as tests/test_fuzz.py's do; the noise a damaged checkpoint
leaves in a fresh process and the multi-process case are `slow`).

Metrics reference: the interrupted run's own records. A run stopped after step 5 with checkpoints every
2 steps, its newest checkpoint (5) then lost, resumes from step 4: the JSONL must hold steps 1-6 once
each, steps 1-4 as first written and step 5 recomputed bitwise equal to the first run's (the same state
and batch), and TensorBoard's own reader must see the same steps once each.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxpar.cli import main as cli
from jaxpar.core import validate
from jaxpar.core.strategy import catalogue, parse_inline
from jaxpar.errors import ConfigError
from jaxpar.planning.planner import candidate_options
from jaxpar.training.metrics import Sinks
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAIN = ["train", "--model", "llama-tiny", "--mesh", "dp8", "--batch", "8", "--seq", "16", "--no-progress"]
ESTIMATE = ["estimate", "--model", "llama3-8b", "--mesh", "h100-node-tp8", "--hardware", "h100-sxm"]
PLAN = ["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--devices", "64"]
GENERATE = ["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt", "1,2,3"]


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


def assert_one_line(code: int, err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("jaxpar: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


DCN = {"larger": ("[mesh]\ndata = 8\n[mesh.dcn]\ndata = 16\n", "[mesh.dcn] data=16 is larger than the mesh axis data=8"),
       "not-dividing": ("[mesh]\ndata = 8\n[mesh.dcn]\ndata = 3\n", "[mesh.dcn] data=3 does not divide the mesh axis"),
       "minus-one": ("[mesh]\ndata = 8\n[mesh.dcn]\ndata = -1\n", "[mesh.dcn]: mesh axis data=-1 must be a positive "
                                                                 "integer")}
NO_EFFECT = [("--pp-schedule", "1f1b", "pp_schedule=1f1b has no effect", "pipeline=1"),
             ("--pp-repeats", "2", "pp_repeats=2 has no effect", "pipeline=1"),
             ("--microbatches", "2", "microbatches=2 needs a pipeline axis > 1"),
             ("--pp-stages", "1,1", "pp_stages='1,1' splits layers over pipeline stages", "pipeline=1"),
             ("--attention", "ring", "attention=ring has no effect", "context=1"),
             ("--cp-layout", "zigzag", "cp_layout=zigzag has no effect", "context=1"),
             ("--overlap", "collective_matmul", "overlap=collective_matmul decomposes", "tensor=1")]


def cases(tmp: pathlib.Path):
    for name, (text, words) in DCN.items():
        path = tmp / f"dcn-{name}.toml"
        path.write_text(text)
        for argv in (TRAIN, ESTIMATE):
            yield f"{argv[0]}-dcn-{name}", with_flag(argv, "--mesh", str(path)), [words]
    for argv in (TRAIN, ESTIMATE):
        yield f"{argv[0]}-model-name", with_flag(argv, "--model", "llama-tiny:name=x"), ["name='x' cannot be set"]
    # numbers: ASCII digits only, one parser everywhere
    for where, argv, flag, value, words in [
            ("mesh-underscore", TRAIN, "--mesh", "data=0_8", "size '0_8' of data is not an integer"),
            ("mesh-arabic-indic", ESTIMATE, "--mesh", "data=\u0668", "size '\u0668' of data is not an integer"),
            ("model-override", TRAIN, "--model", "llama-tiny:layers=\u0662", "layers='\u0662' is not a valid int"),
            ("model-float", TRAIN, "--model", "llama-tiny:norm_eps=1_0e-5", "norm_eps='1_0e-5' is not a valid float"),
            ("flag-integer", TRAIN, "--steps", "1_0", "argument --steps: '1_0' is not an integer"),
            ("flag-real", TRAIN, "--lr", "\u0661.0", "argument --lr: '\u0661.0' is not a number"),
            ("flag-zero", ESTIMATE, "--zero", "\u0663", "argument --zero: '\u0663' is not an integer"),
            ("step-range", TRAIN, "--profile-steps", "1-\u0663", "is not a step range"),
            ("pp-stages", with_flag(ESTIMATE, "--mesh", "pipeline=2,data=4"), "--pp-stages", "1_6,16",
             "pp_stages='1_6,16' must list positive unit counts")]:
        yield f"number-{where}", with_flag(argv, flag, value), [words]
    for flag, value, *words in NO_EFFECT:
        yield f"train{flag}", with_flag(TRAIN, flag, value), words
        yield f"estimate{flag}", with_flag(with_flag(ESTIMATE, "--mesh", "dp8"), flag, value), words
    yield "generate--attention", with_flag(GENERATE, "--attention", "ring"), ["attention=ring has no effect"]
    # estimate's contradictions and absurd batches
    yield "estimate-two-free-axes", with_flag(with_flag(ESTIMATE, "--mesh", "data=-1,tensor=-1"), "--devices", "8"), \
        ["only one axis may be -1"]
    yield "estimate-devices", with_flag(with_flag(ESTIMATE, "--mesh", "dp8"), "--devices", "16"), \
        ["--devices 16 contradicts mesh dp8", "8 devices"]
    for argv in (ESTIMATE, PLAN):
        yield f"{argv[0]}-global-batch", with_flag(argv, "--global-batch", str(2**63)), \
            ["argument --global-batch: must be <= 16777216"]
    yield "estimate-global-batch-tokens", with_flag(ESTIMATE, "--global-batch-tokens", str(2**62)), \
        ["sequences per step: at most 16,777,216"]
    # a resumed run's metrics file that is not one
    (tmp / "notes.txt").write_text("step 1 went well\nstep 2 too\n")
    yield "resume-metrics-not-jsonl", [*TRAIN, "--ckpt-dir", str(tmp / "ck"), "--resume", "--metrics",
                                       str(tmp / "notes.txt")], ["notes.txt, line 1: not a JSON record"]


def test_each_class_is_one_line_before_compiling(tmp_path, capsys, monkeypatch):
    """Every case in turn (one test: the files are written once); a compile would fail the case."""
    from jaxpar.training.trainer import Trainer
    monkeypatch.setattr(Trainer, "compile", lambda self: pytest.fail("compiled"))
    failures, count = [], 0
    for name, argv, words in cases(tmp_path):
        count += 1
        try:
            assert_one_line(cli.main(argv), capsys.readouterr().err, *words)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{name} {argv}: {e}")
    assert failures == [], "\n".join(failures)
    assert count >= 38


def test_defaults_and_the_catalogue_and_the_planners_candidates_use_every_option_they_set():
    """The options check counts only options away from their defaults: no mesh file and no candidate
    of the planner's trips it."""
    for st in catalogue():
        validate.check_options_apply(st)
        validate.check_phases(st)
    for mesh in ("data=8", "pipeline=4,data=2", "context=2,tensor=4", "pipeline=2,context=2,tensor=2"):
        sizes = dict(parse_inline(mesh).mesh)
        for options in candidate_options(sizes, 64, units=8):
            validate.check_options_apply(parse_inline(mesh).with_options(**vars(options)))


# ---- metrics after a resume, and the checkpoints a run leaves ---------------------------------------

@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A 6-step run stopped after step 5 (checkpoints of steps 2, 4 and 5), with its metrics."""
    tmp = tmp_path_factory.mktemp("stopped")
    args = [*TRAIN, "--steps", "6", "--ckpt-dir", str(tmp / "ck"), "--ckpt-every", "2", "--metrics",
            str(tmp / "m.jsonl"), "--tensorboard", str(tmp / "tb"), "--stop-after", "5"]
    assert cli.main(args) == 0
    return tmp, args


def records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_logs_every_step_once(stopped, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    src, args = stopped
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    args = [a.replace(str(src), str(tmp_path)) for a in args]
    shutil.rmtree(tmp_path / "ck" / "5")  # as if killed before the save of step 5 completed
    first = records(tmp_path / "m.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.')  # a record cut short by the kill
    capsys.readouterr()
    assert cli.main([a for a in args if a not in ("--stop-after", "5")] + ["--resume"]) == 0
    assert "restored step 4" in capsys.readouterr().out
    got = records(tmp_path / "m.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # each once, from 1
    assert got[:4] == first[:4]  # the steps before the restore, kept as written
    assert got[4]["loss"] == first[4]["loss"]  # step 5 again, from the restored state: bitwise
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                                                         for r in got]
    # a fresh run into the same files refuses, before anything compiles; --overwrite-metrics replaces them
    fresh = [a for a in args if a not in ("--stop-after", "5")]
    fresh[fresh.index("--ckpt-dir") + 1] = str(tmp_path / "other-ck")
    assert_one_line(cli.main(fresh), capsys.readouterr().err,
                    f"--metrics {tmp_path / 'm.jsonl'} already holds the records of steps 1-6", "--overwrite-metrics")
    assert_one_line(cli.main(fresh[:fresh.index("--metrics")] + fresh[fresh.index("--metrics") + 2:]),
                    capsys.readouterr().err, "--tensorboard", "already holds 2 event file(s)")
    assert_one_line(cli.main(args + ["--resume", "--overwrite-metrics"]), capsys.readouterr().err,
                    "--resume and --overwrite-metrics contradict each other")


def test_a_full_disk_under_the_metrics_is_a_config_error():
    """/dev/full answers every write with ENOSPC: the record's write is a ConfigError naming the file and
    the step, and closing the file (whose buffer fails again) adds nothing. Through `jaxpar train`: slow."""
    sinks = Sinks("/dev/full")
    with pytest.raises(ConfigError, match="^--metrics /dev/full: cannot write the record of step 3: No space left "
                                          "on device$"):
        sinks.write({"step": 3, "loss": 1.0})
    sinks.close()


@pytest.mark.slow
def test_a_full_disk_under_the_metrics_is_one_line(capsys):
    assert_one_line(cli.main([*TRAIN, "--steps", "1", "--metrics", "/dev/full"]), capsys.readouterr().err,
                    "--metrics /dev/full: cannot write the record of step 1: No space left on device")


def damaged(stopped, tmp_path: pathlib.Path, how: str) -> list[str]:
    """The stopped run's checkpoints with step 5 damaged `how`; the command that resumes from them."""
    src, args = stopped
    shutil.copytree(src / "ck", tmp_path / "ck")
    step = tmp_path / "ck" / "5"
    if how == "meta-type":
        meta = json.loads((step / "meta" / "metadata").read_text())
        (step / "meta" / "metadata").write_text(json.dumps(meta | {"model": "llama-tiny"}))
    elif how == "checksums-type":
        meta = json.loads((step / "meta" / "metadata").read_text())
        key = next(iter(meta["checksums"]))
        (step / "meta" / "metadata").write_text(json.dumps(meta | {"checksums": {key: "0x0"}}))
    elif how == "truncated":
        data = [p for p in (step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        biggest = max(data, key=lambda p: p.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    else:  # the OCDBT manifests
        for manifest in (step / "state").rglob("manifest.ocdbt"):
            manifest.unlink()
    return [*TRAIN, "--steps", "6", "--ckpt-dir", str(tmp_path / "ck"), "--resume"]


DAMAGE = {"meta-type": ["its metadata 'model' is str 'llama-tiny', not a table"],
          "checksums-type": ["its metadata checksums of .", "is str '0x0', not a table"],
          "truncated": ["is corrupt or incomplete: array .", "truncated?"],
          "manifest": ["is corrupt or incomplete"]}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_it(stopped, tmp_path, capsys, how):
    argv = damaged(stopped, tmp_path, how)
    line = assert_one_line(cli.main(argv), capsys.readouterr().err, f"checkpoint step 5 in {tmp_path / 'ck'}",
                           *DAMAGE[how])
    assert "TensorStore(" not in line and "--resume-step 4" in line
    if how == "meta-type":  # generate reads the same item
        assert_one_line(cli.main([*with_flag(GENERATE, "--mesh", "tp8"), "--checkpoint", str(tmp_path / "ck")]),
                        capsys.readouterr().err, *DAMAGE[how])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "manifest"])
def test_a_damaged_checkpoint_in_a_fresh_process_prints_nothing_else(stopped, tmp_path, how):
    """orbax's abandoned reads (asyncio's 'Task exception was never retrieved', TensorStore's spec) and
    its callbacks into a closed event loop print nothing after the one line."""
    argv = damaged(stopped, tmp_path, how)
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *argv, "--devices", "8"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, env={**os.environ, "XLA_FLAGS": FAST_COMPILE})
    assert_one_line(out.returncode, out.stderr, *DAMAGE[how])


@pytest.mark.slow
def test_bad_input_in_a_launched_run_is_one_line_naming_the_first_error():
    """Every process refuses the option; the launcher prints the first refusal once, naming its process,
    and none of the coordination service's C++ frames from the processes it stops."""
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
                          "--devices-per-process", "2", "--", *TRAIN[:-1], "--mesh", "data=4", "--batch", "4",
                          "--steps", "1", "--pp-schedule", "1f1b"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, env={**os.environ, "XLA_FLAGS": FAST_COMPILE})
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("jaxpar: error: process "), out.stderr[-3000:]
    assert "pp_schedule=1f1b has no effect" in errors[0]
    assert "Check failure" not in out.stderr and "Source Location Trace" not in out.stderr


def test_tensorboard_holds_the_held_out_fields_under_eval(tmp_path):
    """An evaluation's eval_loss and eval_ppl reach TensorBoard as eval/<field> at their step, beside the
    train/<field> scalars (docs/running.md)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from jaxpar.training.metrics import Sinks
    sinks = Sinks(None, str(tmp_path))
    sinks.write({"step": 1, "loss": 3.0, "time": 1.0})
    sinks.write({"step": 2, "loss": 2.5, "eval_loss": 2.75, "eval_ppl": 15.6, "time": 2.0})
    sinks.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/eval_loss")] == [(2, 2.75)]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
