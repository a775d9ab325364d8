"""Test-only fault injection, switched on by environment variables that no normal run sets.

Crash tests must stop a training process at a *known* point, whatever the machine's speed: a test
that races a timer against a subprocess fails at random on a fast (or a loaded) machine. So the
process stops itself where the test asks, and the test then does to it what it wants:

  JAXPAR_KILL_DURING_SAVE=N  SIGKILL this process right after the save of step N has started
                             (the write is still in flight: a half-written checkpoint is left behind)
  JAXPAR_HOLD_AFTER_STEP=N   after step N completed (metrics written, any save of it started),
                             print HOLD_LINE to stderr and block until killed
  JAXPAR_RAISE_AFTER_STEP=N  after step N completed, raise RuntimeError (an unexpected error); with
                             JAXPAR_FAULT_PROCESS=I only in process I of a multi-process run
  JAXPAR_KILL_AFTER_STEP=N:MS
                             SIGKILL this process MS milliseconds after step N completed, wherever
                             it then is (in the next step, in a save, in the metrics' write)
  JAXPAR_SHELL_AFTER_STEP=N:COMMAND
                             after step N completed, run COMMAND in a shell and wait for it (a
                             fault of the environment at a known point: delete the checkpoint
                             directory, remount it read-only inside the test's mount namespace)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import jax

KILL_DURING_SAVE = "JAXPAR_KILL_DURING_SAVE"
HOLD_AFTER_STEP = "JAXPAR_HOLD_AFTER_STEP"
RAISE_AFTER_STEP = "JAXPAR_RAISE_AFTER_STEP"
KILL_AFTER_STEP = "JAXPAR_KILL_AFTER_STEP"
SHELL_AFTER_STEP = "JAXPAR_SHELL_AFTER_STEP"
FAULT_PROCESS = "JAXPAR_FAULT_PROCESS"
HOLD_LINE = "jaxpar: test hook: holding after step {step} until killed"


def _asked(variable: str, step: int) -> bool:
    if os.environ.get(variable) != str(step):
        return False
    if FAULT_PROCESS in os.environ:
        return str(jax.process_index()) == os.environ[FAULT_PROCESS]
    return True


def after_save_started(step: int) -> None:
    if _asked(KILL_DURING_SAVE, step):
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int) -> None:
    """`step` completed steps are done; block here for ever, or raise, if a test asked to."""
    if _asked(HOLD_AFTER_STEP, step):
        print(HOLD_LINE.format(step=step), file=sys.stderr, flush=True)
        threading.Event().wait()
    at, _, ms = os.environ.get(KILL_AFTER_STEP, "").partition(":")
    if at == str(step):
        timer = threading.Timer(int(ms or 0) / 1000, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    at, _, command = os.environ.get(SHELL_AFTER_STEP, "").partition(":")
    if command and at == str(step):
        subprocess.run(command, shell=True, check=True)
    if _asked(RAISE_AFTER_STEP, step):
        raise RuntimeError(f"test hook: an unexpected error after step {step}")
