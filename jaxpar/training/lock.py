"""The lock on a checkpoint directory: one run writes it at a time.

A run takes `DIR/jaxpar.lock` by an exclusive create (O_EXCL) and reads it back, recording its host,
pid and start time; a second run on the same directory is refused, naming the holder. A lock whose
holder is gone (same host, the pid no longer alive or reused by another process: its start time in
/proc differs) is broken and retaken; a lock from another host is never broken automatically (delete the
file once that run has ended). Only process 0 of a multi-process run takes it
(jaxpar/training/checkpoint.py `Checkpointer`).
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import socket
import time

from jaxpar.errors import ConfigError

LOCK = "jaxpar.lock"


def this_host() -> str:
    return socket.gethostname()


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22), or None where
    /proc cannot tell (not Linux, no such process). With the pid it names one process: a pid reused by
    a later process has a later start."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def holder_alive(holder: dict) -> bool | None:
    """Whether the process a lock names still runs: None when it is on another host (nothing here can
    tell), False when no process has its pid or the pid now belongs to a later process."""
    if holder.get("host") != this_host():
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    ticks = process_start_ticks(int(holder["pid"]))
    return holder.get("start_ticks") is None or ticks is None or ticks == holder["start_ticks"]


def describe_holder(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


class DirectoryLock:
    """DIR/jaxpar.lock: the run that writes DIR, as JSON {host, pid, started, start_ticks}.

    Taken with an atomic exclusive create (O_CREAT | O_EXCL: of two runs, exactly one creates it), then
    read back: the run holds the lock only if the file names it. A second run on DIR is refused,
    naming the holder. A lock whose holder is gone (same host, and no process with its pid and start
    time) is broken: renamed to a name of this process's own (atomic: of two runs breaking it, one
    wins the rename), read again to make sure it is the dead holder's, deleted, and the create tried
    again. A lock of another host is never broken automatically, as nothing here can tell whether
    that run still writes: delete DIR/jaxpar.lock by hand once no run there uses DIR. The holder
    checks the lock still names it before every save (`check`), and deletes it when done (`release`,
    also at interpreter exit; a killed run leaves it, and the next run on the host breaks it)."""

    def __init__(self, directory: pathlib.Path):
        self.path = directory / LOCK
        self.me = {"host": this_host(), "pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.broken: dict | None = None  # the dead holder whose lock this run broke, if any

    def _read(self, path: pathlib.Path | None = None) -> dict | None:
        try:
            holder = json.loads((path or self.path).read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and "pid" in holder else None

    def _ours(self, holder: dict | None) -> bool:
        return holder is not None and (holder.get("host"), holder.get("pid")) == (self.me["host"], self.me["pid"])

    def acquire(self) -> None:
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._judge(self._read())
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            if self._ours(self._read()):
                atexit.register(self.release)
                return
        raise ConfigError(f"--ckpt-dir {self.path.parent}: could not take the lock {self.path} (it keeps "
                          "changing hands: several runs are starting on this directory at once)")

    def _judge(self, holder: dict | None) -> None:
        """Return to try the create again (the lock is gone, or it was ours, or its dead holder's lock
        is broken); raise if another run holds it."""
        if holder is None:  # being written by a run that just created it, or damaged
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return
            if age < 10:
                time.sleep(0.1)
                return
            raise ConfigError(f"--ckpt-dir {self.path.parent}: the lock {self.path} is unreadable; if no run "
                              "uses this directory, delete the lock file and start again")
        if self._ours(holder):  # this process took it before (a second Checkpointer on the same directory)
            self.path.unlink(missing_ok=True)
            return
        alive = holder_alive(holder)
        if alive is None:
            raise ConfigError(f"--ckpt-dir {self.path.parent} is in use by another run ({describe_holder(holder)}: "
                              f"its lock {self.path}); a lock of another host is not broken automatically: if that "
                              "run has ended, delete the lock file and start again")
        if alive:
            raise ConfigError(f"--ckpt-dir {self.path.parent} is in use by another run ({describe_holder(holder)}, "
                              f"still running: its lock {self.path}); wait for it to end or stop it first")
        self._break(holder)

    def _break(self, dead: dict) -> None:
        aside = self.path.with_name(f"{LOCK}.broken-by-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another run broke it first
            return
        if self._read(aside) == dead:
            aside.unlink()
            self.broken = dead
            return
        try:  # what we moved is a live run's new lock: put it back
            os.link(aside, self.path)
        except FileExistsError:
            pass
        aside.unlink()

    def check(self, step: int) -> None:
        holder = self._read()
        if not self._ours(holder):
            now = f"now names {describe_holder(holder)}" if holder else "is gone"
            raise ConfigError(f"the lock {self.path} of this run {now}: another run may be writing "
                              f"--ckpt-dir {self.path.parent}; stopped after step {step} rather than write beside it")

    def release(self) -> None:
        atexit.unregister(self.release)
        if self._ours(self._read()):
            try:
                self.path.unlink()
            except OSError:  # gone, or the directory turned read-only: the next run breaks it (holder dead)
                pass
