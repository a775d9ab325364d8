"""Multi-process runs: one JAX process per host (or per GPU), joined by `jax.distributed`.

JAX's multi-controller model: every process runs the same program on its own devices; the
coordinator (process 0) lets them find each other, exchange device lists and watch each other's
heartbeats. After `initialize`, `jax.devices()` lists the devices of *all* processes and a jitted
step over a mesh of them runs its collectives across processes (NCCL on GPUs, ICI/DCN on TPUs,
gloo on CPU).

Where the three facts (coordinator address, process count, this process's id) come from, first
match wins:
  1. flags: `--coordinator HOST:PORT --num-processes N --process-id I`;
  2. `jaxpar launch`, which sets JAXPAR_COORDINATOR / JAXPAR_NUM_PROCESSES / JAXPAR_PROCESS_ID;
  3. a cluster JAX recognises by itself: a SLURM job step with several tasks, an Open MPI job
     (`mpirun -n N`), a multi-host Cloud TPU slice; `jax.distributed.initialize()` reads them.
Otherwise the run is a single process and nothing is initialised.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import re
import socket
import sys
import threading
import time
from typing import NoReturn

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # global_state.client: what `watch_peers` asks
from jax.experimental import multihost_utils

from jaxpar.errors import ConfigError

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a multi-process run. None fields are left to JAX's cluster detection."""
    source: str                       # "flags", "jaxpar launch", "SLURM", "Open MPI", "Cloud TPU"
    coordinator: str | None = None    # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def check(self) -> None:
        if self.coordinator is not None and not re.fullmatch(r"[^:\s]+:\d{1,5}", self.coordinator):
            raise ConfigError(f"coordinator {self.coordinator!r} ({self.source}) is not HOST:PORT")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"num_processes={self.num_processes} ({self.source}) must be >= 1")
        if self.process_id is not None and self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"process_id={self.process_id} ({self.source}) is not in [0, "
                              f"num_processes={self.num_processes})")


def _detected_cluster(env) -> str | None:
    """The name of a cluster environment jax.distributed.initialize() can read, if this is one."""
    if int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")) or 1) > 1 and "SLURM_PROCID" in env:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "Cloud TPU"
    return None


def cluster_from(coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, env=None) -> Cluster | None:
    """The Cluster this process belongs to, or None for a single-process run."""
    env = os.environ if env is None else env
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(f"a multi-process run needs --coordinator, --num-processes and --process-id; "
                              f"missing {', '.join(missing)}")
        cluster = Cluster("flags", coordinator, num_processes, process_id)
    elif ENV_COORDINATOR in env:
        try:
            cluster = Cluster("jaxpar launch", env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]),
                              int(env[ENV_PROCESS_ID]))
        except (KeyError, ValueError):
            raise ConfigError(f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are "
                              "missing or not integers") from None
    elif (name := _detected_cluster(env)) is not None:
        cluster = Cluster(name)
    else:
        return None
    cluster.check()
    if cluster.num_processes == 1:
        return None
    return cluster


def initialize(cluster: Cluster, timeout_s: int = 300, heartbeat_s: int = 30) -> None:
    """Join the run: `jax.distributed.initialize`, then check that what joined is what was asked.

    Bounded wait: if the coordinator cannot be reached, or not every process joins, within
    `timeout_s`, this process prints a clear error and exits with status 2 (JAX's own timeout ends
    the process from C++ with an abort, so a watchdog thread acts first). A process that stops
    sending heartbeats for `heartbeat_s` is declared dead, and JAX's coordination service then
    tells the others, which leave (`watch_peers`) instead of hanging in a collective.
    """
    where = f"coordinator {cluster.coordinator}" if cluster.coordinator else f"the {cluster.source} coordinator"
    who = "process" if cluster.process_id is None else f"process {cluster.process_id}"
    n = "" if cluster.num_processes is None else f" of {cluster.num_processes} processes"

    def give_up() -> None:
        waited = ("the other processes to join" if cluster.process_id == 0 else f"{where} to answer")
        print(f"jaxpar: error: {who} waited {timeout_s} s for {waited} (a run{n} through {where}); is every "
              "process started, with the same --num-processes, and the address reachable from this host?",
              file=sys.stderr, flush=True)
        os._exit(2)

    global _joining
    _joining = True
    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.config.update("jax_enable_recoverability", True)  # a dead process is reported: `watch_peers`
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                                   initialization_timeout=timeout_s + 30, heartbeat_timeout_seconds=heartbeat_s,
                                   shutdown_timeout_seconds=heartbeat_s)
        check_processes(cluster.num_processes, heartbeat_s)
        watch_peers(jax.process_index(), heartbeat_s, timeout_s)
    except Exception as e:  # noqa: BLE001 - XLA raises bare runtime errors
        if isinstance(e, ConfigError):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{who} could not join the run{n} through {where}: {first}") from None
    finally:
        watchdog.cancel()


def watch_peers(process: int | None, heartbeat_s: int, exit_timeout_s: int) -> None:
    """Start a daemon thread that leaves this process, with one line naming the dead process (exit 3,
    as `leave_on` for a failed collective), once the coordination service counts a process no longer
    alive (no heartbeat for `heartbeat_s`), or stops answering itself (process 0, which hosts it, died).
    The thread acts, not the main thread, which may be blocked in a collective that never completes.
    JAX's own reaction to a dead process is an abort from C++ with pages of stack frames, so `initialize`
    turns on recoverability (jax_enable_recoverability: the service reports a dead process instead of
    failing every other one) and this thread is what stops the run. With recoverability JAX's shutdown
    does not wait for every process, so the processes meet at a barrier on their way out (at exit,
    at most `exit_timeout_s`) before the watch stands down: none leaves while another still needs it."""
    client = jax_distributed.global_state.client
    everyone = list(range(jax.process_count()))
    period = max(heartbeat_s / 10, 0.2)

    def watch() -> None:
        while True:
            time.sleep(period)
            try:
                live = client.get_live_nodes(everyone)
            except Exception as e:  # noqa: BLE001 - the service is gone with process 0
                if _leaving:
                    return
                first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                leave(f"jaxpar: error: process {process}: the coordinator (process 0) stopped answering "
                      f"({first}): it was killed or its host died; stopping this process too", 3)
            dead = [p for p in everyone if p not in live]
            if dead and not _leaving:
                who = ", ".join(f"process {p}" for p in dead)
                leave(f"jaxpar: error: process {process}: {who} stopped sending heartbeats for {heartbeat_s} s "
                      "(killed, or its host died); stopping this process too", 3)

    def finish() -> None:
        global _leaving
        try:
            client.wait_at_barrier("jaxpar-exit", exit_timeout_s * 1000)
        except Exception:  # noqa: BLE001 - a process gone meanwhile: the watch has said so, or leaving anyway
            pass
        _leaving = True
        if process == 0:   # the service's host leaves last: the others' shutdown calls need it
            outlive(client, everyone[1:], heartbeat_s)

    threading.Thread(target=watch, name="jaxpar-peer-watch", daemon=True).start()
    atexit.register(finish)


def outlive(client, others: list[int], wait_s: float) -> None:
    """Process 0 at exit: wait (at most `wait_s`) until `others` have shut down their link to the
    coordination service this process hosts; leaving first would fail their shutdown call, which JAX
    answers with an abort (SIGABRT) in those processes."""
    deadline = time.monotonic() + wait_s
    time.sleep(min(1.0, wait_s))   # their shutdown calls follow the exit barrier by milliseconds
    while others and time.monotonic() < deadline:
        try:
            if not set(others) & set(client.get_live_nodes(others)):
                return
        except Exception:  # noqa: BLE001 - nothing left to wait for
            return
        time.sleep(0.05)


def leave_together(client, everyone: list[int], heartbeat_s: int) -> None:
    """Every process shuts its link to the coordination service down, process 0 (which hosts the
    service) last: a barrier (at most `heartbeat_s`), then the others shut down while process 0
    `outlive`s them. With recoverability on, JAX's own shutdown does not wait for everyone, and a
    process whose shutdown call finds the service gone is aborted (SIGABRT) by JAX."""
    try:
        client.wait_at_barrier("jaxpar-leave", heartbeat_s * 1000)
    except Exception:  # noqa: BLE001 - a peer already gone: leave anyway
        pass
    if jax.process_index() == 0:
        outlive(client, [p for p in everyone if p != 0], heartbeat_s)
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - a peer already gone: leave anyway, with the reason
        pass


def check_processes(expected: int | None = None, heartbeat_s: int = 30) -> None:
    """Every process has the same number of devices, and there are as many processes as asked."""
    if expected is not None and jax.process_count() != expected:
        raise ConfigError(f"num_processes={expected} but {jax.process_count()} processes joined the run")
    per_process: dict[int, int] = {}
    for d in jax.devices():
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    if len(set(per_process.values())) > 1:
        counts = ", ".join(f"process {p}: {n}" for p, n in sorted(per_process.items()))
        # Every process reads the same list and leaves, together: the first to exit would read as a dead
        # peer to the others, whose coordination agent then aborts them (SIGABRT) before they can say why.
        leave_together(jax_distributed.global_state.client, list(per_process), heartbeat_s)
        raise ConfigError(f"processes have different device counts ({counts}); every process must "
                          "bring the same number of devices")


_joining = False
_leaving = False  # this process is leaving on purpose: the peer watch stays quiet
ENV_HOST = "JAXPAR_HOST"  # overrides the host name: `jaxpar launch` makes each process a host of its own


@functools.cache
def process_hosts() -> tuple[int, ...]:
    """Host number of each process (processes on one machine share one), from their host names.

    One process per GPU is SLURM's default with JAX, so hosts and processes differ: a host is a
    machine (NVLink / ICI inside, InfiniBand / DCN between). Exchanged once with a tiny all-gather.
    """
    if jax.process_count() == 1:
        return (0,)
    name = os.environ.get(ENV_HOST) or socket.gethostname()
    digest = np.frombuffer(hashlib.sha256(name.encode()).digest()[:8], np.int64)
    names = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1).tolist()
    first = {h: i for i, h in reversed(list(enumerate(names)))}
    numbers = {h: k for k, h in enumerate(sorted(first, key=first.get))}
    return tuple(numbers[h] for h in names)


def joining() -> bool:
    """Whether this process tried to join a multi-process run (then it must leave with os._exit:
    a normal interpreter exit waits in jax.distributed's shutdown barrier for the others)."""
    return _joining


def leave(message: str, code: int) -> NoReturn:
    """Print `message` and leave a multi-process run at once: a normal interpreter exit would wait in
    jax.distributed's shutdown barrier for processes that will never reach it. Bad input (code 2) is
    also left with the coordination service for the others to name (`report_error`)."""
    global _leaving
    _leaving = True
    if code == 2:
        report_error(message.removeprefix("jaxpar: error: "))
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def is_main() -> bool:
    """Process 0 prints logs, metrics and progress; the others stay quiet."""
    return jax.process_index() == 0


PEER_FAILURE = re.compile(r"gloo|connection (closed|reset)|heartbeat|unavailable|coordination service", re.I)


FIRST_ERROR = "jaxpar/first-error"  # the coordination service's key: the first process's reason to stop


def report_error(message: str) -> None:
    """Leave `message` (why this process stops) with the coordination service, where the first report
    stays, so that the processes which see this one vanish name the cause (`first_error`), not only
    the vanishing. Best effort and bounded: the service leaves with process 0."""
    state = jax_distributed.global_state  # (not jax.process_index(): that would start a backend)
    client = state.client
    if client is None or (state.num_processes or 1) == 1:
        return

    def put() -> None:
        try:  # (allow_overwrite=False: a second report is refused, the first kept)
            client.key_value_set(FIRST_ERROR, f"process {state.process_id}: {message}")
        except Exception:  # noqa: BLE001 - another process reported first, or the service is gone
            pass

    writer = threading.Thread(target=put, daemon=True)
    writer.start()
    writer.join(timeout=2.0)


def first_error() -> str | None:
    """The first report a process left with `report_error`, or None (none, or the service is gone)."""
    client = jax_distributed.global_state.client
    if client is None:
        return None
    try:
        return client.key_value_try_get(FIRST_ERROR)
    except Exception:  # noqa: BLE001 - NOT_FOUND, or the service is gone
        return None


def peer_failure(e: BaseException) -> str | None:
    """If `e` is a collective failing because another process died, a one-line explanation, naming the
    first error another process reported (`report_error`) when there is one."""
    if jax.process_count() == 1 or not PEER_FAILURE.search(str(e)):
        return None
    if (reported := first_error()) is not None:
        return f"{reported} (process {jax.process_index()} stopped with it)"
    first = str(e).strip().splitlines()[0][:200]
    return (f"process {jax.process_index()}: a collective with the other processes failed ({first}); "
            "another process probably died: see its output")
