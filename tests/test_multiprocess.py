"""Multi-process runs: N processes joined by jax.distributed give the single-process results.

The launched runs are real: `jaxpar launch` starts 2 processes of 4 simulated CPU devices each, which
meet through a coordinator on a local port and run their collectives over gloo. Each is checked
against the same command run in this (single, 8-device) process. The data tests play several
processes on one by telling `process_block` which device belongs to which process.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxpar.cli import main as cli

from jaxpar.training import data, faults
from jaxpar.training.checkpoint import Checkpointer
from jaxpar.training.data import Synthetic, local_batch
from jaxpar.errors import ConfigError
from jaxpar.core.mesh import make_mesh
from jaxpar.core.strategy import AXES, parse_strategy
from jaxpar.training.trainer import TrainConfig, Trainer, gather, train
from jaxpar.models.config import parse_model
from tests.harness import leaves_with_paths

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

MODEL = "llama-tiny"
STEPS, BATCH, SEQ = 5, 16, 32
TRAIN = ["train", "--model", MODEL, "--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--no-progress"]
# A hybrid (two-host) mesh: fsdp split across the two hosts, data and tensor inside each.
HYBRID = """description = "2 hosts: fsdp across hosts (DCN), data x tensor inside"
[mesh]
data = 2
fsdp = 2
tensor = 2
[mesh.dcn]
fsdp = 2
"""


def jaxpar(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def cpu_env(devices: int) -> dict:
    from jaxpar.devices import with_device_count
    return {**os.environ, "XLA_FLAGS": with_device_count(os.environ.get("XLA_FLAGS", ""), devices)}


def single_process(mesh: str):
    """Losses and final state of the same run in this process, on 8 devices."""
    tc = TrainConfig(batch=BATCH, seq=SEQ, steps=STEPS)
    trainer = Trainer(parse_model(MODEL), parse_strategy(mesh), tc)
    losses = []
    state = train(trainer, Synthetic(trainer.model_cfg.vocab, 0), on_step=lambda _, m: losses.append(m["loss"]))
    return np.array(losses), state


# ---- the launched runs -------------------------------------------------------------------------

LINE_STARTS = ("model ", "strategy ", "batch ", "precision ", "optimizer ", "schedule ", "data ", "mfu ", "compiling ",
               "initialising ", "step ", "checkpoint ", "final loss ")  # process 0's lines, each whole

@pytest.mark.parametrize("mesh", ["dp2-tp4", pytest.param("fsdp8", marks=pytest.mark.slow),
                                  pytest.param("hybrid", marks=pytest.mark.slow)])
def test_two_processes_match_one(mesh, tmp_path):
    """2 processes x 4 devices: the loss trajectory of 1 process x 8 devices (<= 1e-5); for dp2-tp4 the
    checkpoint the 2 processes write together restores in this one process onto another mesh. fsdp8
    (parameters sharded across the processes) is `slow`: `make demo` trains fsdp8 on 2 processes too."""
    if mesh == "hybrid":
        mesh = str(tmp_path / "hybrid.toml")
        (tmp_path / "hybrid.toml").write_text(HYBRID)
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt")] if mesh == "dp2-tp4" else []
    out = jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--",
                 *TRAIN, "--mesh", mesh, "--metrics", str(tmp_path / "m.jsonl"), *ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("final loss") == 1  # logs from process 0 only
    assert "[Gloo]" not in out.stderr and all(line.startswith(LINE_STARTS) for line in out.stdout.splitlines())
    got = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    want, state = single_process(mesh)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    if ckpt:
        trainer = Trainer(parse_model(MODEL), parse_strategy("fsdp8"), TrainConfig(batch=BATCH, seq=SEQ, steps=STEPS))
        restored, step, _ = Checkpointer(str(tmp_path / "ckpt"), every=0).restore(trainer)
        assert step == STEPS
        ref = dict(leaves_with_paths(gather(state.params)))
        for path, x in leaves_with_paths(gather(restored.params)):
            np.testing.assert_allclose(x, ref[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_comm_under_two_processes(tmp_path, capsys):
    """`jaxpar comm` compiled by 2 processes over all 8 devices reports what 1 process reports."""
    args = ["comm", "--model", MODEL, "--mesh", "dp2-tp4", "--batch", str(BATCH), "--seq", str(SEQ)]
    out = jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--", *args,
                 "--json", str(tmp_path / "two.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("per device per step") == 1  # the table from process 0 only
    assert cli.main([*args, "--json", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    for report in (one, two):
        report.pop("compile_seconds")
    assert two == one


def start_long_launch(*extra: str, launch_flags=()) -> tuple[subprocess.Popen, list[int]]:
    """A launched 2-process run that would go on for ages, once both processes have joined it."""
    launcher = subprocess.Popen([sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
                                 "--devices-per-process", "4", *launch_flags, "--", *TRAIN, "--steps", "100000",
                                 "--mesh", "fsdp8", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in launcher.stdout:  # process 0 prints this once both joined and the mesh is built
        if line.startswith("model llama-tiny"):
            break
    else:
        rc, err = launcher.wait(), launcher.stderr.read()
        raise AssertionError(f"the launched run ended (exit {rc}) before its processes joined: {err[-2000:]}")
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    return launcher, [int(c) for c in children]


def assert_all_stopped(launcher: subprocess.Popen, children: list[int], within_s: float) -> str:
    """The launcher and its children are gone within `within_s`. The bound tells "stopped" from "hung"
    (the run is 100,000 steps long, hours here), so it is set far above the ~2 s a stop takes on an idle
    machine, to hold on a loaded one too; it is no speed target."""
    t0 = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - t0 < within_s, "a process hung"
    still = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, children))], capture_output=True, text=True)
    assert still.stdout.strip() == "", f"processes left running: {still.stdout}"
    return err


def kill_all(launcher: subprocess.Popen, children: list[int]) -> None:
    for pid in [launcher.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_launch_stops_the_others_when_one_process_dies():
    """SIGKILL one process mid-run: the launcher stops the other and exits non-zero, naming it."""
    launcher, children = start_long_launch()
    try:
        assert len(children) == 2, "launch is not running two processes"
        os.kill(children[1], signal.SIGKILL)
        err = assert_all_stopped(launcher, children, within_s=45)
        assert launcher.returncode != 0
        assert "jaxpar launch: " in err and "process 1 was killed by SIGKILL" in err and "stopping the other" in err
    finally:
        kill_all(launcher, children)


def test_an_unexpected_error_in_one_process_stops_the_run_at_once(tmp_path):
    """Process 1 raises after step 2 (faults.RAISE_AFTER_STEP): it prints its traceback and leaves with
    status 1 (it used to wait 30 s in the shutdown barrier and abort with 134), and the launcher stops
    process 0 and exits with that status."""
    env = {**os.environ, faults.RAISE_AFTER_STEP: "2", faults.FAULT_PROCESS: "1"}
    out = jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--", *TRAIN, "--steps", "100000",
                 "--mesh", "fsdp8", env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "jaxpar: error: process 1 failed: RuntimeError: test hook: an unexpected error after step 2" in out.stderr
    assert "process 1 exited with code 1; stopping the other 1 process(es)" in out.stderr


def wait_for_steps(launcher: subprocess.Popen, metrics, steps: int) -> None:
    """Until the metrics file shows `steps` steps. No race: the run is 100,000 steps long, so it cannot
    end first; the poll's only deadline is a guard against a hang, far above any machine's compile time."""
    deadline = time.monotonic() + 600
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert launcher.poll() is None, f"the run ended before step {steps}: {launcher.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {steps} steps in 600 s"
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_saves_a_checkpoint_and_stops_everything(tmp_path, signum):
    """SIGTERM or a Ctrl-C to the launcher reaches both processes (a Ctrl-C as SIGTERM, which JAX's
    preemption service catches); its sync point makes both save the same step's checkpoint and stop
    (exit 128 + the signal), without a traceback; the checkpoint restores in one process."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    launcher, children = start_long_launch("--ckpt-dir", str(ckpt), "--metrics", str(metrics),
                                           launch_flags=("--grace", "60"))
    try:
        assert len(children) == 2
        wait_for_steps(launcher, metrics, 2)
        launcher.send_signal(signum)
        err = assert_all_stopped(launcher, children, within_s=60)
        assert launcher.returncode == 128 + signum
        assert "Traceback" not in err, err[-2000:]
    finally:
        kill_all(launcher, children)
    trainer = Trainer(parse_model(MODEL), parse_strategy("dp8"), TrainConfig(batch=BATCH, seq=SEQ, steps=100000))
    _, step, _ = Checkpointer(str(ckpt), every=0).restore(trainer)
    assert step >= 2


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "process_id=2 (flags) is not in [0, num_processes=2)"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "missing --process-id"),
    (["--coordinator", "nohostport", "--num-processes", "2", "--process-id", "0"], "is not HOST:PORT"),
])
def test_bad_cluster_flags(flags, message, capsys):
    assert cli.main([*TRAIN, "--mesh", "dp8", *flags]) == 2
    assert message in capsys.readouterr().err


def test_launch_rejects_flags_it_sets(capsys):
    assert cli.main(["launch", "--processes", "2", "--", *TRAIN, "--mesh", "dp8", "--devices", "8"]) == 2
    assert "--devices is set by launch" in capsys.readouterr().err


def test_unreachable_coordinator_gives_up_in_bounded_time():
    """--init-timeout 3 gives up after 3 s of waiting. The wall-clock bound (60 s: the interpreter and
    JAX start-up on a loaded 2-core machine, plus the 3 s) only tells it from JAX's own 300 s default."""
    t0 = time.monotonic()
    out = jaxpar(*TRAIN, "--mesh", "fsdp8", "--coordinator", "127.0.0.1:9", "--num-processes", "2",
                 "--process-id", "1", "--init-timeout", "3", env=cpu_env(4))
    assert out.returncode == 2
    assert "process 1 waited 3 s for coordinator 127.0.0.1:9 to answer" in out.stderr
    assert time.monotonic() - t0 < 60


def two_processes(flags0: list[str], flags1: list[str], devices=(4, 4)) -> list[subprocess.CompletedProcess]:
    """Start processes 0 and 1 by hand (as SLURM would) and wait for both."""
    from jaxpar.cli.launch import free_port
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpar.cli.main", *TRAIN, "--mesh", "fsdp8", "--coordinator",
                               coordinator, "--process-id", str(i), "--init-timeout", "30", "--heartbeat-timeout",
                               "5", *flags], env=cpu_env(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, (flags, d) in enumerate(zip((flags0, flags1), devices))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def test_processes_with_different_device_counts():
    """Both refuse to go on (exit 2); whichever reads the device list first names the counts (the
    other may find it gone, and says it could not join)."""
    outs = two_processes(["--num-processes", "2"], ["--num-processes", "2"], devices=(4, 3))
    for out in outs:
        assert out.returncode == 2, out.stderr[-2000:]
        assert "jaxpar: error: process" in out.stderr
    assert any("processes have different device counts (process 0: 4, process 1: 3)" in o.stderr for o in outs)


def test_process_count_mismatch():
    """Process 1 believes in 3 processes, the coordinator in 2: process 1 says so and leaves; process 0
    is then stopped by the heartbeat check (5 s here) instead of waiting forever."""
    p0, p1 = two_processes(["--num-processes", "2"], ["--num-processes", "3"])
    assert p1.returncode == 2
    assert "num_processes=3 but 2 processes joined the run" in p1.stderr
    assert p0.returncode != 0
    # process 0 learns it from the heartbeat check, from a failed collective, or (if process 1 left
    # while process 0 was still reading the device list) from its own start-up
    assert any(m in p0.stderr for m in ("stopped sending heartbeats", "collective with the other processes failed",
                                        "could not join the run")), p0.stderr[-2000:]


# ---- data: every sample once -------------------------------------------------------------------

@pytest.mark.parametrize("mesh, processes", [("dp8", 2), ("fsdp8", 4), ("dp2-tp4", 2), ("tp8", 2),
                                              ("dp2-cp4-zigzag", 4), ("cp8-ring", 2), ("hybrid", 2)])
def test_each_process_feeds_exactly_its_devices_rows(mesh, processes, tmp_path):
    """Play `processes` processes of consecutive devices. Each process builds only its part of the
    batch; the shards placed from those parts, as make_array_from_process_local_data places them
    (the process's index spans in order), are the single-process batch. So every sample is in the
    global batch once, and no process reads a row none of its devices holds."""
    if mesh == "hybrid":  # rows 0-3 and 8-11 on host 0: spans need not be contiguous
        (tmp_path / "hybrid.toml").write_text(HYBRID)
        mesh = str(tmp_path / "hybrid.toml")
    trainer = Trainer(parse_model(MODEL), parse_strategy(mesh), TrainConfig(batch=BATCH, seq=SEQ))
    sharding, order = trainer.batch_sharding, trainer.order
    process_of = {d: d.id // (8 // processes) for d in jax.devices()}.__getitem__
    source = Synthetic(256, seed=0)
    full = local_batch(source, 3, range(BATCH), SEQ, order)["inputs"]
    assert len({tuple(r) for r in full}) == BATCH  # distinct samples
    parts = {p: data.process_indices(sharding, (BATCH, SEQ), p, process_of) for p in range(processes)}
    local = {p: local_batch(source, 3, rows, SEQ, order)["inputs"][:, cols] for p, (rows, cols) in parts.items()}
    holders: dict[int, set] = {}
    for device, idx in sharding.devices_indices_map((BATCH, SEQ)).items():
        p = process_of(device)
        rows, cols = (np.arange(n)[i] for n, i in zip((BATCH, SEQ), idx))
        shard = local[p][np.searchsorted(parts[p][0], rows)][:, np.searchsorted(parts[p][1], cols)]
        np.testing.assert_array_equal(shard, full[np.ix_(rows, cols)])
        for r in rows:
            holders.setdefault(int(r), set()).add(p)
    assert sorted(holders) == list(range(BATCH))
    for p, (rows, _) in parts.items():  # a process reads exactly the rows its devices hold
        assert set(rows.tolist()) == {r for r, ps in holders.items() if p in ps}


# ---- hosts in the mesh -------------------------------------------------------------------------

def test_dcn_axis_is_outermost_within_its_axis():
    """data=2 x fsdp=4 with [mesh.dcn] fsdp=2: hosts are devices {0..3} and {4..7}; fsdp position k is
    host k // 2, in-host fsdp k % 2; data runs inside each host."""
    strategy = dataclasses.replace(parse_strategy("data=2,fsdp=4"), dcn=(("fsdp", 2),))
    ids = np.vectorize(lambda d: d.id)(make_mesh(strategy).devices).reshape(2, 4)
    want = np.array([[host * 4 + d * 2 + f for host in range(2) for f in range(2)] for d in range(2)])
    np.testing.assert_array_equal(ids, want)
    # [mesh.dcn] data = 2 on the outermost axis: hosts hold data=0 and data=1, the plain device order.
    hsdp = dataclasses.replace(parse_strategy("dp2-fsdp2-tp2"), dcn=(("data", 2),))
    ids = np.vectorize(lambda d: d.id)(make_mesh(hsdp).devices).reshape(-1)
    np.testing.assert_array_equal(ids, np.arange(8))


def test_tensor_groups_must_stay_inside_a_host():
    from jaxpar.core.validate import check_hosts
    strategy = parse_strategy("tp8")
    hosts = np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(1, 1, 1, 1, 1, 8)  # two hosts of 4 devices
    with pytest.raises(ConfigError, match=r"tensor=8 groups span hosts \[0, 1\].*tensor <= 4.*\[mesh.dcn\] tensor = 2"):
        check_hosts(strategy, hosts, AXES)
    check_hosts(dataclasses.replace(strategy, dcn=(("tensor", 2),)), hosts, AXES)  # asked for: allowed
    check_hosts(parse_strategy("dp2-tp4"), hosts.reshape(1, 1, 1, 1, 1, 8).reshape(2, 1, 1, 1, 1, 4), AXES)
