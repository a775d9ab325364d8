"""Checkpoints through `jaxpar train` in fresh processes: exact resume, surviving SIGKILL and SIGTERM,
damaged checkpoints, and the checkpoint directory's other states.

Reference: one uninterrupted 12-step run. Every interrupted run, resumed in a new process, must
reproduce the reference losses bitwise from the step it resumed at.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.training import faults
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS, EVERY = 12, 4
BASE = ["--model", "llama-tiny", "--mesh", "data=2,tensor=2", "--devices", "4", "--steps", str(STEPS),
        "--batch", "8", "--seq", "32", "--no-progress"]


def cli(args, env=None, wait=True):
    full_env = dict(os.environ, XLA_FLAGS=FAST_COMPILE) | (env or {})
    cmd = [sys.executable, "-m", "jaxpar.cli.main", "train", *BASE, *args]
    if not wait:
        return subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, pathlib.Path(path).read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    m = tmp_path_factory.mktemp("ref") / "m.jsonl"
    out = cli(["--metrics", str(m)])
    assert out.returncode == 0, out.stderr
    return losses(m)


def resume_and_compare(ckpt, tmp_path, reference, expect_from):
    m = tmp_path / "resumed.jsonl"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--resume", "--metrics", str(m)])
    assert out.returncode == 0, out.stderr
    assert f"restored step {expect_from}" in out.stdout
    got = losses(m)
    assert sorted(got) == list(range(expect_from + 1, STEPS + 1))  # steps count from 1
    for step, loss in got.items():
        assert loss == reference[step], (step, loss, reference[step])  # bitwise


def test_stop_and_resume_in_a_fresh_process_is_bitwise_identical(tmp_path, reference):
    ckpt = tmp_path / "ck"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--stop-after", "8"])
    assert out.returncode == 0, out.stderr
    resume_and_compare(ckpt, tmp_path, reference, expect_from=8)


def test_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ck"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY)], env={faults.KILL_DURING_SAVE: "8"})
    assert out.returncode == -signal.SIGKILL
    resume_and_compare(ckpt, tmp_path, reference, expect_from=4)


def test_killed_mid_training_loses_at_most_k_plus_one_steps(tmp_path, reference):
    """SIGKILL after step 10 of 12 (checkpoints every 4): the run holds itself there until killed
    (faults.HOLD_AFTER_STEP), so it can never finish first, however fast or loaded the machine is."""
    ckpt, m = tmp_path / "ck", tmp_path / "m.jsonl"
    held_at = 10
    proc = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--metrics", str(m)],
               env={faults.HOLD_AFTER_STEP: str(held_at)}, wait=False)
    hold = faults.HOLD_LINE.format(step=held_at)
    seen = []
    for line in proc.stderr:  # blocks until the process reaches the hold (or ends: then it failed)
        seen.append(line)
        if line.strip() == hold:
            break
    else:
        proc.wait()
        pytest.fail(f"the run never reached step {held_at} (exit {proc.returncode}): {''.join(seen)[-2000:]}")
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = len(m.read_text().splitlines())
    assert done == held_at
    last_complete = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert last_complete == 8  # the save of step 8 was complete: step 9 waited for it
    assert done - last_complete <= EVERY + 1  # K, plus the one step a save overlaps
    resume_and_compare(ckpt, tmp_path, reference, expect_from=last_complete)


# ---- SIGTERM in one process ----------------------------------------------------------------------

LONG = ["--steps", "100000"]  # a run that cannot end before the signal, however fast the machine


def run_until_signal(args, metrics, after_steps=2, signum=signal.SIGTERM):
    """Start a 100,000-step run, signal it once the metrics file shows `after_steps` steps, and wait.
    No race: the run cannot finish first; the poll's deadline only guards against a hang."""
    proc = cli([*LONG, "--metrics", str(metrics), *args], wait=False)
    deadline = time.monotonic() + 600
    while not metrics.exists() or len(metrics.read_text().splitlines()) < after_steps:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {after_steps} steps in 600 s"
        time.sleep(0.1)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_sigterm_saves_at_the_end_of_the_step_and_resumes_bitwise(tmp_path):
    ckpt, m = tmp_path / "ck", tmp_path / "m.jsonl"
    code, out, err = run_until_signal(["--ckpt-dir", str(ckpt)], m)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    saved = int(re.search(r"preempted: checkpoint of step (\d+) saved; rerun with --resume", out).group(1))
    assert saved == len(m.read_text().splitlines()) >= 2  # the step in flight finished, and was saved
    assert [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] == [saved]
    until = ["--stop-after", str(saved + 3)]
    ref = tmp_path / "ref.jsonl"
    out = cli([*LONG, *until, "--metrics", str(ref)])
    assert out.returncode == 0, out.stderr
    reference = losses(ref)
    assert losses(m) == {s: reference[s] for s in range(1, saved + 1)}
    resumed = tmp_path / "resumed.jsonl"
    out = cli([*LONG, *until, "--ckpt-dir", str(ckpt), "--resume", "--metrics", str(resumed)])
    assert out.returncode == 0, out.stderr
    assert f"restored step {saved}" in out.stdout
    assert losses(resumed) == {s: reference[s] for s in range(saved + 1, saved + 4)}  # bitwise


def test_sigterm_without_a_checkpoint_directory_stops_cleanly(tmp_path):
    m = tmp_path / "m.jsonl"
    code, out, err = run_until_signal([], m)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    done = len(m.read_text().splitlines())
    assert f"preempted after step {done}: nothing was saved (no --ckpt-dir)" in out
    assert "Traceback" not in err


def test_ctrl_c_saves_the_step_in_flight_as_sigterm_does(tmp_path):
    """A Ctrl-C (SIGINT) is a preemption notice: the step in flight finishes and is saved, one line says
    so on each stream, no traceback, exit 128 + SIGINT."""
    ckpt, m = tmp_path / "ck", tmp_path / "m.jsonl"
    code, out, err = run_until_signal(["--ckpt-dir", str(ckpt)], m, signum=signal.SIGINT)
    assert code == 128 + signal.SIGINT, err[-2000:]
    saved = int(re.search(r"preempted: checkpoint of step (\d+) saved; rerun with --resume", out).group(1))
    assert saved == len(m.read_text().splitlines()) >= 2
    assert [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] == [saved]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "jaxpar: Ctrl-C: stopping after the step in flight" in err


# ---- damaged checkpoints, explicit fallback, and the directory's other states -----------------------

def test_a_damaged_newest_checkpoint_is_refused_and_an_older_one_restores_on_request(tmp_path, reference):
    ckpt = tmp_path / "ck"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--stop-after", "8"])
    assert out.returncode == 0, out.stderr
    biggest = max((p for p in (ckpt / "8" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))

    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--resume"])
    assert out.returncode == 2
    error = out.stderr.strip().splitlines()[-1]
    assert re.match(rf"jaxpar: error: checkpoint step 8 in {re.escape(str(ckpt))} is (damaged|corrupt or "
                    r"incomplete): array \.\S+ ", error), error
    assert error.endswith("Older checkpoints there: step 4; to resume from one, add --resume-step 4 "
                          "(nothing falls back to an older checkpoint unasked).")
    assert "Traceback" not in out.stderr

    m = tmp_path / "resumed.jsonl"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--resume", "--resume-step", "4",
               "--metrics", str(m)])
    assert out.returncode == 0, out.stderr
    assert "restored step 4" in out.stdout and f"{ckpt}/set-aside/8" in out.stdout
    got = losses(m)
    assert got == {s: reference[s] for s in range(5, STEPS + 1)}  # bitwise
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 8, 12]
    assert (ckpt / "set-aside" / "8" / "state").is_dir()  # the damaged one is kept, out of the way


def test_a_finished_run_a_fresh_run_and_overwrite(tmp_path):
    ckpt = tmp_path / "ck"
    out = cli(["--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY)])
    assert out.returncode == 0, out.stderr

    out = cli(["--ckpt-dir", str(ckpt), "--resume"])  # already at --steps: nothing to do, and it says so
    assert out.returncode == 0, out.stderr
    assert f"nothing to do: checkpoint step {STEPS} >= --steps {STEPS}" in out.stdout
    assert "final loss" not in out.stdout

    out = cli(["--ckpt-dir", str(ckpt)])  # a fresh run would mix its checkpoints with the old ones
    assert out.returncode == 2
    assert out.stderr.strip() == (f"jaxpar: error: --ckpt-dir {ckpt} already holds checkpoints of steps 4, 8, 12; "
                                  "add --resume to continue from step 12, or --overwrite-ckpt to delete them and "
                                  "start afresh")

    out = cli(["--ckpt-dir", str(ckpt), "--overwrite-ckpt", "--stop-after", "2"])
    assert out.returncode == 0, out.stderr
    assert f"--overwrite-ckpt: deleted the checkpoints of steps 4, 8, 12 in {ckpt}" in out.stdout
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2]
