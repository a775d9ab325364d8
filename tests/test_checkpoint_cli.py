"""Checkpoints through `jaxpar train` in fresh processes: exact resume, and surviving SIGKILL.

Reference: one uninterrupted 12-step run. Every interrupted run, resumed in a new process, must
reproduce the reference losses bitwise from the step it resumed at.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from jaxpar import faults
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS, EVERY = 12, 4
BASE = ["--model", "llama-tiny", "--mesh", "data=2,tensor=2", "--devices", "4", "--steps", str(STEPS),
        "--batch", "8", "--seq", "32", "--no-progress"]


def cli(args, env=None, wait=True):
    full_env = dict(os.environ, XLA_FLAGS=FAST_COMPILE) | (env or {})
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", *BASE, *args]
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
    assert sorted(got) == list(range(expect_from, STEPS))
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
