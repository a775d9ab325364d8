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
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.training import faults
from jaxpar.training.integrity import DamagedCheckpoint, checksums, read_error, verify
from jaxpar.errors import ConfigError

MARKER = "jaxpar.json"
SET_ASIDE = "set-aside"  # newer checkpoints moved out of the way when resuming from an older step
FORMAT = {"format": "jaxpar-checkpoint", "version": 1}


def flatten(tree) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def unflatten(template, flat: dict[str, Any]):
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


class Checkpointer:
    def __init__(self, directory: str, every: int, keep: int = 3):
        self.dir = pathlib.Path(directory).resolve()
        self.every = every
        self._check_directory()
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"))

    def _check_directory(self) -> None:
        """Refuse a directory jaxpar did not write. Every process checks (read-only, so all agree);
        process 0 alone creates the directory and the marker, and the others wait for it."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"--ckpt-dir {self.dir} exists and is not a directory")
        fresh = not (self.dir.is_dir() and any(self.dir.iterdir()))
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
        call waits for it. So a crash loses at most K steps plus the one step in flight."""
        self.manager.wait_until_finished()
        if not force and (self.every <= 0 or step % self.every):
            return False
        flat = flatten(trainer.stored_state(state, inverse=True))   # layer order under every strategy
        meta = {"step": step, "seed": trainer.tc.seed, "model": dataclasses.asdict(trainer.model_cfg),
                "strategy": trainer.strategy.describe(), "devices": trainer.mesh.size,
                "checksums": checksums(flat)}  # every process takes part (one all-gather)
        saved = self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                                 meta=ocp.args.JsonSave(meta)))
        faults.after_save_started(step)
        return bool(saved)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

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
        check_model(meta.get("model", {}), dataclasses.asdict(trainer.model_cfg), step)
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


def check_model(saved: dict, current: dict, step: int) -> None:
    for key in sorted(set(saved) | set(current)):
        if key == "name":
            continue
        if saved.get(key) != current.get(key):
            raise ConfigError(f"checkpoint step {step} was written for a different model: "
                              f"{key}={saved.get(key)!r} in the checkpoint, {key}={current.get(key)!r} now")


def restore_arrays(directory: str, model: dict, target: dict[str, Any], step: int | None = None):
    """Some arrays of a training checkpoint, read straight into `target`'s shardings (jax.ShapeDtypeStruct
    per flat key, e.g. only the parameters for `jaxpar generate`: the optimizer state stays on disk).
    Returns (flat arrays, step, message). Read-only: nothing in `directory` is created or changed.
    ConfigError for a directory jaxpar did not write, one without checkpoints, or a checkpoint of
    another model (`model`: the current ModelConfig as a dict); DamagedCheckpoint as `restore`."""
    path = pathlib.Path(directory).resolve()
    if not path.is_dir():
        raise ConfigError(f"--checkpoint {path}: no such directory")
    try:
        ok = json.loads((path / MARKER).read_text()).get("format") == FORMAT["format"]
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"--checkpoint {path} was not written by jaxpar (no {MARKER})")
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False),
                                    item_names=("state", "meta"))
    try:
        steps = sorted(manager.all_steps())
        if not steps:
            raise ConfigError(f"--checkpoint {path} holds no complete checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ConfigError(f"--checkpoint {path}: no complete checkpoint of step {step}; it holds {_listing(steps)}")
        where = f"checkpoint step {step} in {path}"
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many types for unreadable files
            raise DamagedCheckpoint(f"{where} cannot be read: its metadata: {read_error(e, [], path / str(step))}") from None
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
