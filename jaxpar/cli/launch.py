"""`jaxpar launch`: N local processes on CPU, for development and tests of multi-process runs.

    jaxpar launch --processes 2 --devices-per-process 4 -- train --model llama-tiny --mesh fsdp8

Each child runs `python -m jaxpar.cli.main <command>` with D simulated CPU devices and the coordinates of
the run in its environment (jaxpar.distributed reads them): process 0 hosts the coordinator on a free
local port, and the collectives between processes go over gloo (TCP). The launcher

  * forwards SIGTERM and a Ctrl-C to every child as SIGTERM (each child is its own session, so a
    terminal's Ctrl-C reaches them once, through here; JAX's preemption service, which makes every
    process save the same step, catches SIGTERM only), and kills those still running `--grace` seconds
    later or at a second signal; it exits 128 + the first signal's number (130 for a Ctrl-C);
  * fails fast: when one child exits with an error or is killed, the others (whose next collective
    cannot complete) are stopped: SIGTERM, then SIGKILL after the grace period; the launcher exits
    non-zero, naming the process;
  * takes its children with it if it dies itself (Linux: PR_SET_PDEATHSIG), leaving no orphans;
  * returns 0 only when every child returned 0;
  * reports the first error once (`Relay`): the children's standard error passes through line by line,
    but their last words, `jaxpar: error: ...`, are held; when a child fails, the launcher prints the
    first such line (bad input, exit 2: that one line, naming the process) and drops whatever the
    others print while they are stopped (the pages of C++ frames a coordination service prints when
    its peers vanish);
  * passes the children's output through whole lines only: each child's own lines on a descriptor of
    their own (jaxpar.cli.streams.separate_streams: the runtime's C++ output goes to standard error), and
    Gloo's connection notices dropped (`unglued`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar import distributed
from jaxpar.cli.streams import CHILD, clean_lines
from jaxpar.devices import MAX_DEVICES, with_device_count
from jaxpar.errors import ConfigError

MULTI_PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--devices")
MAX_PROCESSES = 64  # each local process is a whole JAX runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, coordinator: str, processes: int, process_id: int, devices: int) -> dict:
    env = dict(base)
    env.update({distributed.ENV_COORDINATOR: coordinator, distributed.ENV_NUM_PROCESSES: str(processes),
                distributed.ENV_PROCESS_ID: str(process_id), "JAX_PLATFORMS": "cpu",
                "PYTHONUNBUFFERED": "1",  # each line reaches the Relay as it is printed
                CHILD: "1",  # separate_streams: the runtime's C++ standard output apart from jaxpar's lines
                distributed.ENV_HOST: f"launch-host-{process_id}",  # each process plays a host
                "XLA_FLAGS": with_device_count(base.get("XLA_FLAGS", ""), devices)})
    return env


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(processes: int, devices_per_process: int, command: list[str], grace_s: float = 2.0) -> int:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("launch needs a command after --, e.g. `jaxpar launch --processes 2 -- train ...`")
    if command[0] == "launch":
        raise ConfigError("launch cannot launch itself")
    if processes < 1 or devices_per_process < 1:
        raise ConfigError(f"--processes={processes} and --devices-per-process={devices_per_process} must be >= 1")
    if processes > MAX_PROCESSES:
        raise ConfigError(f"--processes {processes}: jaxpar launch starts at most {MAX_PROCESSES} local processes "
                          "(each is a whole JAX runtime on this host)")
    if processes * devices_per_process > MAX_DEVICES:
        raise ConfigError(f"--processes {processes} x --devices-per-process {devices_per_process} = "
                          f"{processes * devices_per_process} devices: XLA:CPU simulates at most {MAX_DEVICES}")
    for flag in MULTI_PROCESS_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in command):
            raise ConfigError(f"{flag} is set by launch (--processes, --devices-per-process); remove it from the command")

    coordinator = f"127.0.0.1:{free_port()}"
    children = [subprocess.Popen([sys.executable, "-m", "jaxpar.cli.main", *command], start_new_session=True,
                                 env=child_env(os.environ, coordinator, processes, i, devices_per_process),
                                 preexec_fn=die_with_parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for i in range(processes)]
    relay = Relay(children)
    received: list[int] = []     # signals forwarded to the children
    kill_after: list[float] = []  # JAX turns SIGTERM into a preemption notice and keeps running

    def forward(signum, _frame):
        received.append(signum)
        if len(received) > 1:  # a second signal: stop at once, nothing more saved
            kill_after.insert(0, 0.0)
            print("\njaxpar launch: stopping every process at once (a second signal), nothing more saved",
                  file=sys.stderr, flush=True)
            return
        kill_after.append(time.monotonic() + grace_s)
        for c in children:  # JAX's preemption service catches SIGTERM only: a Ctrl-C reaches them as one
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [c.poll() for c in children]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed and not received:
                relay.failed([i for i, _ in failed])
                running = [c for c in children if c.poll() is None]
                report_failure(relay, failed, len(running))
                stop(running, grace_s)
                code = relay.first(failed)[1]
                return code if code > 0 else 128 - code
            if all(c is not None for c in codes):
                relay.finish()
                return 128 + received[0] if received else 0
            if kill_after and time.monotonic() > kill_after[0]:
                stop([c for c in children if c.poll() is None], 0)
            time.sleep(0.05)
    finally:
        stop([c for c in children if c.poll() is None], grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)


ERROR = "jaxpar: error: "  # how a child's last line starts when it stops on an error (jaxpar.cli)
class Relay:
    """The children's standard output and error, copied to the launcher's whole line by whole line (one
    thread per stream, one lock: no child's line lands inside another's), except their `jaxpar: error:`
    lines, held for `report_failure`, and Gloo's connection notices (`unglued`). After `failed`, no more
    standard error is copied (the others are being stopped, and what they print then is the failure
    seen from their side)."""

    def __init__(self, children: list[subprocess.Popen]):
        self.lock = threading.Lock()
        self.errors: list[tuple[float, int, str]] = []  # (when read, process, line)
        self.quiet = False
        self.threads = [threading.Thread(target=self._copy, args=(i, c.stderr), daemon=True)
                        for i, c in enumerate(children)]
        self.outputs = [threading.Thread(target=self._copy_out, args=(c.stdout,), daemon=True) for c in children]
        for t in self.threads + self.outputs:
            t.start()

    def _copy_out(self, stream) -> None:
        for line in clean_lines(stream):
            with self.lock:
                sys.stdout.write(line)
                sys.stdout.flush()

    def _copy(self, process: int, stream) -> None:
        for line in clean_lines(stream):
            with self.lock:
                if line.startswith(ERROR):
                    self.errors.append((time.monotonic(), process, line.rstrip("\n")))
                    self.quiet = True  # its process is about to exit: the others' output is its echo
                elif not self.quiet:
                    sys.stderr.write(line)
                    sys.stderr.flush()

    def failed(self, processes: list[int]) -> None:
        """`processes` failed: copy nothing more, and wait (briefly) for their last lines."""
        with self.lock:
            self.quiet = True
        for p in processes:
            self.threads[p].join(timeout=2.0)

    def first(self, failed: list[tuple[int, int]]) -> tuple[int, int]:
        """(process, exit code) of the first failure: the first child that said why, else the first exit."""
        codes = dict(failed)
        said = [p for _, p, _ in sorted(self.errors) if p in codes]
        return (said[0], codes[said[0]]) if said else failed[0]

    def line(self, process: int) -> str | None:
        return next((line for _, p, line in sorted(self.errors) if p == process), None)

    def finish(self) -> None:
        """Every child has exited: copy the rest and the held lines (a run stopped by a signal)."""
        for t in self.threads + self.outputs:
            t.join(timeout=5.0)
        for _, _, line in sorted(self.errors):
            print(line, file=sys.stderr, flush=True)


def report_failure(relay: Relay, failed: list[tuple[int, int]], running: int) -> None:
    """One line for bad input (exit 2: the first process's error, naming it), else its error line (its
    traceback has passed through) and the launcher's line naming every failed process."""
    process, code = relay.first(failed)
    line = relay.line(process)
    if code == 2 and line is not None:
        stopped = f"; the launcher stopped the other {running} process(es)" if running else ""
        print(f"{ERROR}process {process}: {line.removeprefix(ERROR)}{stopped}", file=sys.stderr, flush=True)
        return
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    what = "; ".join(f"process {i} {describe_exit(code)}" for i, code in failed)
    print(f"jaxpar launch: {what}; stopping the other {running} process(es)", file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """In the child, before exec: on Linux, be SIGKILLed if the launcher itself dies (even by SIGKILL),
    so no orphan keeps computing; elsewhere nothing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def stop(children: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `grace_s`."""
    for c in children:
        c.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
