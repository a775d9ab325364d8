"""Checkpoints on orbax's CheckpointManager: asynchronous saves, keep the newest N, restore onto
any mesh and strategy.

A checkpoint holds the train state (parameters, optimizer state, step) as a flat dict keyed by
tree path, plus JSON metadata: the model config, the strategy it was written under, the seed and
the data-stream position (the step: batches are a pure function of (seed, step, row)).

Restoring builds abstract targets (jax.ShapeDtypeStruct) carrying the *new* trainer's shardings,
so orbax reads each device's slice directly onto the new mesh: that is the resharding.

In a multi-process run every process calls save and restore with its own shards of the global
arrays; orbax writes them collectively into one directory (which all hosts must see: a shared file
system or a bucket) and process 0 writes the metadata.

Every save also writes a CRC-32 per array (per saved slice) into the `meta` item, and every restore
checks them: see jaxpar/training/integrity.py for the scheme and what a multi-process run checks.

Odd cases, each with a clear outcome:
  - resume with no checkpoint          -> fresh start, and `restore` says so
  - model config differs               -> ConfigError naming the field and both values
  - a checkpoint that cannot be read, or whose arrays do not match their checksums
                                       -> DamagedCheckpoint (a ConfigError) naming the step, the array
                                          and, where it can be told, the file, plus the older steps there
                                          and how to ask for one (`restore(step=N)`, `--resume-step N`):
                                          nothing falls back to an older checkpoint by itself
  - an interrupted (half-written) save -> never listed: orbax writes to a temporary directory and
                                          renames it only when complete
  - a directory written by something else -> ConfigError (no `jaxpar.json` marker)
  - a directory that cannot be written -> ConfigError before any training
  - a crash (SIGKILL) mid-training     -> resume from the newest complete checkpoint: at most K
                                          steps lost, plus the step during which a save was written
  - a save that fails (disk full, the directory gone or turned read-only)
                                       -> SaveFailed (a ConfigError) naming the save's step, the step
                                          the run reached, the cause and the newest complete checkpoint
                                          left; the run stops there, the older checkpoints untouched
  - a second run on the same directory -> ConfigError naming the holder of DIR/jaxpar.lock (host, pid,
                                          start); a dead holder's lock is broken (`DirectoryLock`)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import signal
import socket
import sys
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.training import faults
from jaxpar.training.integrity import (DamagedCheckpoint, check_meta, checksums, quiet_failed_reads, read_error,
                                       verify)
from jaxpar.errors import ConfigError
from jaxpar.training.lock import LOCK, DirectoryLock, describe_holder

MARKER = "jaxpar.json"
SET_ASIDE = "set-aside"  # newer checkpoints moved out of the way when resuming from an older step
FORMAT = {"format": "jaxpar-checkpoint", "version": 1}


def flatten(tree) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def unflatten(template, flat: dict[str, Any]):
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


class OrbaxErrorLog(logging.Filter):
    """Drops orbax's ERROR log records: orbax logs a failed write from each background thread it
    passes through, with a traceback, before the error reaches the caller, and jaxpar reports it
    there in one line (SaveFailed, DamagedCheckpoint)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


ORBAX_ERROR_LOG = OrbaxErrorLog()


def orbax_unraisable(hook):
    """sys.unraisablehook without two kinds of noise a failed orbax write leaves behind, each already
    reported as SaveFailed: tensorstore's callbacks for the writes still in flight, which find the
    event loop orbax closed on the first failure ("Event loop is closed", raised inside asyncio alone),
    and those writes' coroutines, collected at interpreter exit."""

    def filtered(u) -> None:
        frames = [code.co_filename for code in _frames(u.exc_traceback)]
        closed_loop = (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
                       and all(f"{os.sep}asyncio{os.sep}" in f for f in frames))
        code = getattr(u.object, "cr_code", None)
        orbax_write = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        if not (closed_loop or orbax_write):
            hook(u)

    filtered.orbax_quiet = True
    return filtered


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def quiet_orbax() -> None:
    """Leave the report of a failed checkpoint write to jaxpar's one line (idempotent), and ignore
    SIGPIPE: orbax wakes its asyncio loops through a socket pair, and a wake-up from a tensorstore
    callback that races the loop's close writes to a closed socket. With SIGPIPE at its default (the
    CLI sets it, so that `jaxpar estimate ... | head` stops quietly) that write kills the process in
    the middle of training; ignored, it fails with EPIPE, which asyncio ignores."""
    logging.getLogger("absl").addFilter(ORBAX_ERROR_LOG)
    quiet_failed_reads()   # and the abandoned sibling writes of a failed save, which asyncio logs when collected
    if not getattr(sys.unraisablehook, "orbax_quiet", False):
        sys.unraisablehook = orbax_unraisable(sys.unraisablehook)
    if hasattr(signal, "SIGPIPE") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)


class SaveFailed(ConfigError):
    """A checkpoint could not be written; the message says which, why, where the run stopped, and
    what is left to resume from."""


def setting_up(name: str) -> bool:
    """A file process 0 writes into a fresh directory before its marker (Checkpointer._check_directory):
    the lock, a dead holder's lock it is breaking, the marker before its atomic rename."""
    return name == LOCK or name.startswith(f"{LOCK}.broken-by-") or name == f".{MARKER}.tmp"


class Checkpointer:
    def __init__(self, directory: str, every: int, keep: int = 3, data: str | None = None):
        """`data`: the `jaxpar data` directory the run trains on, recorded in each checkpoint's metadata
        (so that `eval` and `generate --prompt-text` find its validation split and tokenizer)."""
        self.dir = pathlib.Path(directory).resolve()
        self.every = every
        self.data = data
        self.lock = DirectoryLock(self.dir) if jax.process_index() == 0 else None
        quiet_orbax()
        self._check_directory()
        # cleanup_tmp_directories: a save that failed half-way (disk full) leaves a temporary directory,
        # never listed as a checkpoint; the next run on the directory removes it
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True),
            item_names=("state", "meta"))
        self._pending: int | None = None  # the step whose save is in flight
        self._saved: int | None = None    # the newest step this run saved completely
        self._reached = 0                 # the newest step the run completed (for the error of a failed save)

    def _check_directory(self) -> None:
        """Refuse a directory jaxpar did not write. Every process checks (read-only, so all agree);
        process 0 alone creates the directory and the marker, and the others wait for it. A directory
        holding only what process 0 writes while it sets a fresh one up (`setting_up`) is fresh: the
        other processes may list it at that moment."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"--ckpt-dir {self.dir} exists and is not a directory")
        fresh = not (self.dir.is_dir() and any(not setting_up(p.name) for p in self.dir.iterdir()))
        if not fresh:
            marker = self.dir / MARKER
            try:
                ok = json.loads(marker.read_text()).get("format") == FORMAT["format"]
            except (OSError, ValueError):
                ok = False
            if not ok:
                raise ConfigError(f"--ckpt-dir {self.dir} is not empty and was not written by jaxpar "
                                  f"(no {MARKER}); refusing to write or read checkpoints there")
        nearest = self.dir
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise ConfigError(f"--ckpt-dir {self.dir} cannot be written: {nearest} is not writable")
        if jax.process_index() == 0:
            try:  # os.access says yes to root even on a read-only mount: a real write decides
                self.dir.mkdir(parents=True, exist_ok=True)
                self.lock.acquire()  # in multi-process runs process 0 holds it for the run
                if self.lock.broken is not None:
                    print(f"--ckpt-dir {self.dir}: broke the lock of {describe_holder(self.lock.broken)}, "
                          "which no longer runs")
                tmp = self.dir / (f".{MARKER}.tmp" if fresh else f".write-test.{os.getpid()}")
                tmp.write_text(json.dumps(FORMAT))
                if fresh:
                    tmp.rename(self.dir / MARKER)  # atomic: another process never reads half a marker
                else:
                    tmp.unlink()
            except OSError as e:
                raise ConfigError(f"--ckpt-dir {self.dir} cannot be written: {e.strerror or e} "
                                  f"({e.filename or self.dir})") from None
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxpar checkpoint directory ready")

    # ---- save ----------------------------------------------------------------------------------
    def maybe_save(self, step: int, state, trainer, force: bool = False) -> bool:
        """Save after `step` completed steps if it is a multiple of `every`.

        The write is asynchronous but overlaps only the one training step that follows: the next
        call waits for it. So a crash loses at most K steps plus the one step in flight. A save that
        fails raises SaveFailed at that wait (or at once if it cannot start): the run stops with the
        older checkpoints as they were."""
        self._reached = max(self._reached, step)
        self.wait()
        if not force and (self.every <= 0 or step % self.every):
            return False
        self._check_writable(step)
        flat = flatten(trainer.stored_state(state, inverse=True))   # layer order under every strategy
        meta = {"step": step, "seed": trainer.tc.seed, "model": dataclasses.asdict(trainer.model_cfg),
                "strategy": trainer.strategy.describe(), "devices": trainer.mesh.size,
                "checksums": checksums(flat)}  # every process takes part (one all-gather)
        if self.data is not None:
            meta["data"] = self.data
        self._pending = step
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                                     meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types for a failed write
            raise self._failed(e) from None
        faults.after_save_started(step)
        return bool(saved)

    def _check_writable(self, step: int) -> None:
        """Before a save: the directory and its marker are still there, a file can be written in it,
        and the lock still names this run (process 0). Found here, before orbax starts its writer
        threads, a directory deleted or turned read-only mid-run stops the run at once (a save that
        fails as it starts leaves orbax's threads waiting for it, and the process cannot exit)."""
        where = f"checkpoint of step {step} not written; training stopped after step {self._reached}"
        if not (self.dir / MARKER).is_file():
            what = "is gone" if not self.dir.exists() else f"lost its {MARKER} marker"
            raise SaveFailed(f"--ckpt-dir {self.dir} {what}: {where}; {self._left()}")
        probe = self.dir / f".write-test.{socket.gethostname()}.{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise SaveFailed(f"--ckpt-dir {self.dir} cannot be written any more ({e.strerror or e}): {where}; "
                             f"{self._left()}") from None
        if self.lock is not None:
            self.lock.check(self._reached)

    def _failed(self, e: BaseException) -> SaveFailed:
        step, self._pending = self._pending, None
        return SaveFailed(f"checkpoint of step {step} could not be written to {self.dir}: {write_error(e)}; "
                          f"training stopped after step {self._reached}; {self._left()}")

    def _left(self) -> str:
        """What a resume can start from, for the message of a failed save."""
        try:
            self.manager.reload()
            steps = sorted(self.manager.all_steps()) if self.dir.is_dir() else []
        except Exception:  # noqa: BLE001 - the directory may be unreadable by now
            steps = []
        if steps:
            return f"the newest complete checkpoint there is step {steps[-1]} (--resume continues from it)"
        mine = f" (this run's last, step {self._saved}, is gone)" if self._saved is not None else ""
        return f"no complete checkpoint is left there{mine}"

    def wait(self) -> None:
        """Until the save in flight is written; SaveFailed if it could not be."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(e) from None
        if self._pending is not None:
            self._saved, self._pending = self._pending, None

    def close(self) -> None:
        try:
            self.wait()
            self.manager.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    # ---- restore ----------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        return sorted(self.manager.all_steps())

    def restore(self, trainer, step: int | None = None):
        """(state, step, message) from checkpoint `step` (default: the newest complete one), on
        `trainer`'s mesh; (None, 0, message) if there is none. A damaged checkpoint raises
        DamagedCheckpoint naming it and the older steps one may ask for instead."""
        quiet_failed_reads()
        steps = self.steps()
        if step is None:
            if not steps:
                return None, 0, f"no checkpoint in {self.dir}: starting from scratch"
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(f"--resume-step {step}: no complete checkpoint of step {step} in {self.dir}; "
                              f"it holds {_listing(steps)}")
        try:
            return self._restore(trainer, step)
        except DamagedCheckpoint as e:
            older = [s for s in steps if s < step]
            hint = (f"Older checkpoints there: {_listing(older)}; to resume from one, add --resume-step "
                    f"{older[-1]} (nothing falls back to an older checkpoint unasked)." if older else
                    "There is no older checkpoint to fall back to.")
            raise DamagedCheckpoint(f"{e}{'' if str(e).endswith(('.', '?')) else '.'} {hint}") from None

    def _restore(self, trainer, step: int):
        where = f"checkpoint step {step} in {self.dir}"
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many types for unreadable files
            raise DamagedCheckpoint(f"{where} cannot be read: its metadata: "
                                    f"{read_error(e, [], self.dir / str(step))}") from None
        check_model(check_meta(meta, where).get("model", {}), dataclasses.asdict(trainer.model_cfg), step)
        abstract = trainer.abstract_state()
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
                  for (k, v), s in zip(flatten(abstract).items(), flatten(trainer.state_shardings).values())}
        try:
            flat = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:  # noqa: BLE001
            raise DamagedCheckpoint(f"{where} is corrupt or incomplete: "
                                    f"{read_error(e, list(target), self.dir / str(step))}") from None
        if "checksums" in meta:
            verify(flat, meta["checksums"], where)
            note = ""
        else:
            note = " (written without checksums: not verified)"
        state = trainer.stored_state(unflatten(abstract, flat))
        now = trainer.strategy.describe()
        if meta.get("strategy") != now or meta.get("devices") != trainer.mesh.size:
            msg = (f"restored step {step} from {self.dir}, resharded from {meta.get('strategy')} on "
                   f"{meta.get('devices')} devices to {now} on {trainer.mesh.size} devices")
        else:
            msg = f"restored step {step} from {self.dir} ({now})"
        return state, step, msg + note

    # ---- housekeeping (every process calls these; process 0 changes the files) ------------------
    def set_aside_after(self, step: int) -> list[pathlib.Path]:
        """Move the checkpoints newer than `step` into DIR/set-aside/ (kept, not deleted), so a run
        resumed from `step` saves its own steps there again. Returns where they went."""
        moved = []
        for s in (s for s in self.steps() if s > step):
            dest = self.dir / SET_ASIDE / str(s)
            n = 1
            while dest.exists():
                n += 1
                dest = self.dir / SET_ASIDE / f"{s}.{n}"
            moved.append(dest)
            if jax.process_index() == 0:
                dest.parent.mkdir(exist_ok=True)
                (self.dir / str(s)).rename(dest)
        self._sync_and_reload("set aside")
        return moved

    def delete_all(self) -> list[int]:
        """Delete every checkpoint in the directory (--overwrite-ckpt). Returns their steps."""
        steps = self.steps()
        for s in steps:
            self.manager.delete(s)
        self._sync_and_reload("deleted")
        return steps

    def _sync_and_reload(self, what: str) -> None:
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxpar checkpoints {what}")
        self.manager.reload()


def _listing(steps: list[int]) -> str:
    return "no checkpoints" if not steps else f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


ERRNO = re.compile(r"No space left on device|Read-only file system|No such file or directory|Permission denied|"
                   r"Disk quota exceeded|Input/output error")


def write_error(e: BaseException) -> str:
    """The cause of a failed write in a few words: the operating system's error where one is named
    anywhere in the chain (orbax wraps tensorstore's, which wraps the OS's), else the first line."""
    chain, seen = [e], set()
    while chain[-1].__cause__ or chain[-1].__context__:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        chain.append(nxt)
    for x in chain:
        if isinstance(x, OSError) and x.strerror:
            return x.strerror + (f" ({x.filename})" if x.filename else "")
        if m := ERRNO.search(str(x)):
            return m.group(0)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return first[:200]


def check_model(saved: dict, current: dict, step: int) -> None:
    for key in sorted(set(saved) | set(current)):
        if key == "name":
            continue
        if saved.get(key) != current.get(key):
            raise ConfigError(f"checkpoint step {step} was written for a different model: "
                              f"{key}={saved.get(key)!r} in the checkpoint, {key}={current.get(key)!r} now")


def restore_arrays(directory: str, model: dict, target: dict[str, Any], step: int | None = None,
                   flag: str = "--checkpoint"):
    """Some arrays of a training checkpoint, read straight into `target`'s shardings (jax.ShapeDtypeStruct
    per flat key, e.g. only the parameters for `jaxpar generate`: the optimizer state stays on disk).
    Returns (flat arrays, step, message). Read-only: nothing in `directory` is created or changed.
    ConfigError for a directory jaxpar did not write, one without checkpoints, or a checkpoint of
    another model (`model`: the current ModelConfig as a dict), each naming `flag`; DamagedCheckpoint as
    `restore`."""
    path, manager = _read_only(directory, flag)
    try:
        meta, step = _meta(manager, path, step, flag)
        where = f"checkpoint step {step} in {path}"
        check_model(meta.get("model", {}), model, step)
        restore = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                         partial_restore=True)
        try:
            flat = manager.restore(step, args=ocp.args.Composite(state=restore))["state"]
        except Exception as e:  # noqa: BLE001
            raise DamagedCheckpoint(f"{where} is corrupt or incomplete: {read_error(e, list(target), path / str(step))}") from None
    finally:
        manager.close()
    if "checksums" in meta:
        verify(flat, meta["checksums"], where)
    return flat, step, f"restored {len(flat)} arrays of step {step} from {path} (written under {meta.get('strategy')})"


def restore_params(trainer, directory: str, step: int | None = None) -> tuple[Any, str]:
    """(parameters, message) of a training checkpoint in `trainer`'s shardings and stored order, read-only
    (the optimizer state stays on disk, and a run may still be writing the directory): what `jaxpar eval`
    evaluates."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          trainer.abstract_state().params, trainer.param_shardings)
    template = type(trainer.abstract_state())(target, None, None)  # the state's tree, only its params read
    flat, _, message = restore_arrays(directory, dataclasses.asdict(trainer.model_cfg), flatten(template), step,
                                      "--ckpt-dir")
    params = unflatten(template, flat).params
    if trainer.unit_order is not None:  # checkpoints hold layer order (Trainer.stored_state)
        params = jax.jit(trainer.reorder, out_shardings=trainer.param_shardings)(params)
    return params, message


def saved_meta(directory: str, step: int | None = None, flag: str = "--checkpoint") -> tuple[dict, int]:
    """(metadata, step) of a training checkpoint (newest step unless given): the model it was written for,
    its strategy, devices and seed, so that `eval` needs no --model. Read-only."""
    path, manager = _read_only(directory, flag)
    try:
        return _meta(manager, path, step, flag)
    finally:
        manager.close()


def _read_only(directory: str, flag: str) -> tuple[pathlib.Path, "ocp.CheckpointManager"]:
    """A checkpoint manager that creates nothing, on a directory jaxpar wrote (else ConfigError)."""
    path = pathlib.Path(directory).resolve()
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory")
    try:
        ok = json.loads((path / MARKER).read_text()).get("format") == FORMAT["format"]
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{flag} {path} was not written by jaxpar (no {MARKER})")
    quiet_failed_reads()
    return path, ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False),
                                       item_names=("state", "meta"))


def _meta(manager, path: pathlib.Path, step: int | None, flag: str) -> tuple[dict, int]:
    """(checked metadata, step) of checkpoint `step` (newest if None) through an open manager."""
    steps = sorted(manager.all_steps())
    if not steps:
        raise ConfigError(f"{flag} {path} holds no complete checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"{flag} {path}: no complete checkpoint of step {step}; it holds {_listing(steps)}")
    where = f"checkpoint step {step} in {path}"
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - orbax raises many types for unreadable files
        raise DamagedCheckpoint(f"{where} cannot be read: its metadata: {read_error(e, [], path / str(step))}") from None
    return check_meta(meta, where), step


# ---- the directory lock: one run writes a --ckpt-dir at a time ------------------------------------
