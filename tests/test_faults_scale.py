"""Faults of the environment during training, each ending in one clear line with nothing lost: the disk
filling up during a checkpoint save, the checkpoint directory deleted or turned read-only mid-run, a
process of a 2-process run killed, and a second run started on a directory in use.

The file-system faults are real: a tmpfs of a few MiB mounted in a private mount namespace (`unshare
-m`, as root), so the ENOSPC and EROFS come from the kernel through orbax's own writes. Where the
namespace cannot be made the tests skip, but fail under CI=true. The reference of "intact" is each
checkpoint's CRC-32s, computed from the arrays when they were saved and checked on restore.
"""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from jaxpar.cli.launch import free_port
from jaxpar.core.strategy import parse_strategy
from jaxpar.devices import with_device_count
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.training import checkpoint, faults, lock
from jaxpar.training.checkpoint import Checkpointer
from jaxpar.training.trainer import TrainConfig, Trainer
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL, STEPS, EVERY = "llama-tiny:layers=1", 8, 2
TRAIN = ["train", "--model", MODEL, "--mesh", "data=1", "--devices", "1", "--steps", str(STEPS), "--batch", "2",
         "--seq", "16", "--ckpt-every", str(EVERY), "--ckpt-keep", "100", "--no-progress"]
CHECKPOINT_KIB = 940  # one checkpoint of TRAIN's model with its optimizer state, as written (du)


def env(**extra) -> dict:
    return {**os.environ, "XLA_FLAGS": FAST_COMPILE, **extra}


def in_namespace(script: str, **extra) -> subprocess.CompletedProcess:
    """`script` run by sh in a private mount namespace (its mounts vanish with it)."""
    return subprocess.run(["unshare", "-m", "sh", "-ec", script], cwd=ROOT, env=env(**extra), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory):
    where = tmp_path_factory.mktemp("probe")
    try:
        out = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                             capture_output=True, text=True, timeout=30)
        ok, why = out.returncode == 0, out.stderr.strip()
    except OSError as e:
        ok, why = False, str(e)
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs in a private mount namespace (unshare -m, needs root): {why}")
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {why}")


def cli(*args: str) -> str:
    return " ".join([sys.executable, "-m", "jaxpar.cli.main", *TRAIN, *args])


def error_line(stderr: str) -> str:
    """The run's one error line; nothing else of it on stderr (no traceback, no orbax log)."""
    assert "Traceback" not in stderr and "ERROR:absl" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("jaxpar: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def restore_all(directory: pathlib.Path) -> list[int]:
    """Restore every checkpoint in `directory` (each checked against its CRC-32s); their steps."""
    trainer = Trainer(parse_model(MODEL), parse_strategy("data=1"), TrainConfig(batch=2, seq=16, steps=STEPS),
                      devices=jax.devices()[:1])
    ckpt = Checkpointer(str(directory), every=0)
    try:
        for step in ckpt.steps():
            _, restored, message = ckpt.restore(trainer, step)
            assert restored == step and "not verified" not in message, message
        return ckpt.steps()
    finally:
        ckpt.close()


@pytest.mark.slow
def test_a_full_disk_fails_the_save_and_keeps_the_older_checkpoints(tmp_path, can_mount):
    """A tmpfs with room for two and a half checkpoints: the third save runs out of space inside
    orbax's writes; the run stops with one line naming that save, the step reached and the newest
    complete checkpoint, and every older checkpoint restores."""
    mnt, copy = tmp_path / "mnt", tmp_path / "copy"
    mnt.mkdir()
    out = in_namespace(f"mount -t tmpfs -o size={CHECKPOINT_KIB * 5 // 2}k tmpfs {mnt}\n"
                       f"rc=0; {cli('--ckpt-dir', str(mnt / 'ck'))} || rc=$?\n"
                       f"cp -a {mnt / 'ck'} {copy}; exit $rc")
    assert out.returncode == 2, out.stderr[-3000:]
    line = error_line(out.stderr)
    m = re.fullmatch(r"jaxpar: error: checkpoint of step (\d+) could not be written to (\S+): No space left on "
                     r"device; training stopped after step (\d+); the newest complete checkpoint there is step "
                     r"(\d+) \(--resume continues from it\)", line)
    assert m, line
    failed, reached, newest = int(m[1]), int(m[3]), int(m[4])
    assert failed >= 2 * EVERY and reached == failed + 1 and newest == failed - EVERY, line
    assert restore_all(copy) == list(range(EVERY, failed, EVERY))


def test_a_directory_turned_read_only_mid_run_stops_it(tmp_path, can_mount):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = in_namespace(f"mount -t tmpfs -o size=16m tmpfs {mnt}\n{cli('--ckpt-dir', str(mnt / 'ck'))}",
                       **{faults.SHELL_AFTER_STEP: f"3:mount -o remount,ro {mnt}"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_line(out.stderr) == (
        f"jaxpar: error: --ckpt-dir {mnt / 'ck'} cannot be written any more (Read-only file system): checkpoint "
        "of step 4 not written; training stopped after step 4; the newest complete checkpoint there is step 2 "
        "(--resume continues from it)")


@pytest.mark.slow
def test_a_directory_deleted_mid_run_stops_it(tmp_path):
    ck = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *TRAIN, "--ckpt-dir", str(ck)], cwd=ROOT,
                         env=env(**{faults.SHELL_AFTER_STEP: f"3:rm -rf {ck}"}), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_line(out.stderr) == (
        f"jaxpar: error: --ckpt-dir {ck} is gone: checkpoint of step 4 not written; training stopped after step 4; "
        "no complete checkpoint is left there (this run's last, step 2, is gone)")


# ---- the directory lock --------------------------------------------------------------------------

def made_dir(tmp_path) -> pathlib.Path:
    """A checkpoint directory as a finished run leaves it (marker, no lock)."""
    Checkpointer(str(tmp_path / "ck"), every=1).close()
    assert not (tmp_path / "ck" / lock.LOCK).exists()
    return tmp_path / "ck"


def write_lock(directory: pathlib.Path, pid: int, host: str | None = None, ticks="live") -> dict:
    holder = {"host": host or lock.this_host(), "pid": pid, "started": "2026-01-01 00:00:00 UTC",
              "start_ticks": lock.process_start_ticks(pid) if ticks == "live" else ticks}
    (directory / lock.LOCK).write_text(json.dumps(holder))
    return holder


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    ck = made_dir(tmp_path)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(ck, holder.pid)
        with pytest.raises(ConfigError, match=rf"--ckpt-dir {ck} is in use by another run \(pid {holder.pid} on host "
                                              rf"{re.escape(lock.this_host())}, started 2026-01-01 00:00:00 "
                                              r"UTC, still running"):
            Checkpointer(str(ck), every=1)
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((ck / lock.LOCK).read_text())["pid"] == holder.pid  # left as it was


def test_a_dead_holders_lock_is_broken_and_taken(tmp_path):
    ck = made_dir(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = write_lock(ck, gone.pid, ticks=1)
    ckpt = Checkpointer(str(ck), every=1)
    assert ckpt.lock.broken == dead
    assert json.loads((ck / lock.LOCK).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in ck.iterdir()) == [checkpoint.MARKER, lock.LOCK]
    ckpt.close()
    assert not (ck / lock.LOCK).exists()


def test_a_directory_another_process_is_setting_up_counts_as_fresh(tmp_path):
    """What process 0 writes before the marker (its lock, the marker's temporary file) is what the other
    processes of a run may find when they check the directory: a run starts there, and a directory with
    anything else in it is refused."""
    ck = tmp_path / "ck"
    ck.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(ck, gone.pid, ticks=1)
    (ck / f".{checkpoint.MARKER}.tmp").write_text("{")
    Checkpointer(str(ck), every=1).close()
    assert json.loads((ck / checkpoint.MARKER).read_text())["format"] == checkpoint.FORMAT["format"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and was not written by jaxpar"):
        Checkpointer(str(other), every=1)


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    """The lock names a live pid whose process started later than the holder did: not the holder."""
    ck = made_dir(tmp_path)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(ck, holder.pid, ticks=lock.process_start_ticks(holder.pid) - 1)
        Checkpointer(str(ck), every=1).close()
    finally:
        holder.kill()
        holder.wait()


def test_another_hosts_lock_is_never_broken(tmp_path):
    ck = made_dir(tmp_path)
    write_lock(ck, 12345, host="elsewhere.example", ticks=None)
    with pytest.raises(ConfigError, match=r"in use by another run \(pid 12345 on host elsewhere.example.*a lock of "
                                          r"another host is not broken automatically: if that run has ended, delete "
                                          r"the lock file"):
        Checkpointer(str(ck), every=1)


def test_a_lock_taken_over_stops_the_holder_before_its_next_save(tmp_path):
    ck = made_dir(tmp_path)
    ckpt = Checkpointer(str(ck), every=1)
    try:
        write_lock(ck, 12345, host="elsewhere.example", ticks=None)
        with pytest.raises(ConfigError, match=r"now names pid 12345 on host elsewhere.example.*stopped after step 0"):
            ckpt.lock.check(0)
    finally:
        ckpt.close()


# ---- a process of a 2-process run killed ---------------------------------------------------------

PEER = ["train", "--model", "llama-tiny", "--mesh", "fsdp8", "--steps", "8", "--batch", "16", "--seq", "32",
        "--ckpt-every", "2", "--ckpt-keep", "100", "--no-progress"]


def losses(path: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["step", "save"])
def test_a_killed_process_stops_the_other_in_time_and_the_resume_is_bitwise(tmp_path, where):
    """Processes 0 and 1 started by hand (as SLURM would; no launcher to stop the survivor), heartbeat
    timeout 10 s (5 s is tight for a loaded 2-core machine). Process 1 is SIGKILLed while process 0 waits
    in step 6's collectives (`step`), or kills itself while its save of step 4 is in flight (`save`). Process 0 leaves within the timeout with one
    line naming process 1 (exit 3); `jaxpar launch` resumes from the newest complete checkpoint, and its
    step 5 is bitwise the killed run's."""
    ck, first, resumed = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "resumed.jsonl"
    coordinator = f"127.0.0.1:{free_port()}"
    hook = {faults.HOLD_AFTER_STEP: "5"} if where == "step" else {faults.KILL_DURING_SAVE: "4"}
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpar.cli.main", *PEER, "--ckpt-dir", str(ck), "--metrics",
                               str(first), "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
                               "--heartbeat-timeout", "10"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(**hook, **{faults.FAULT_PROCESS: "1",
                                                            "XLA_FLAGS": with_device_count(FAST_COMPILE, 4)}))
             for i in range(2)]
    try:
        seen = []  # process 1's stderr up to its hold: what it said if it ended some other way
        if where == "step":
            for line in procs[1].stderr:
                seen.append(line)
                if line.strip() == faults.HOLD_LINE.format(step=5):
                    break
            procs[1].kill()
        procs[1].wait(timeout=300)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=300)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -signal.SIGKILL, "".join(seen)[-3000:] or procs[1].stderr.read()[-3000:]
    assert procs[0].returncode == 3, err[-3000:]
    assert "jaxpar: error: process 0: process 1 stopped sending heartbeats for 10 s" in err, err[-3000:]
    assert waited < 10 + 25, waited  # the timeout, plus slack for a loaded machine; no hang
    newest = max(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert newest == 4 if where == "step" else newest in (2, 4)
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
                          "--devices-per-process", "4", "--", *PEER, "--ckpt-dir", str(ck), "--resume", "--metrics",
                          str(resumed)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"restored step {newest}" in out.stdout
    before, after = losses(first), losses(resumed)
    assert sorted(after) == list(range(newest + 1, 9))
    shared = sorted(set(before) & set(after))
    assert shared, (before, after)
    for step in shared:
        assert after[step] == before[step], (step, after[step], before[step])  # bitwise
