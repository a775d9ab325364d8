"""Where `jaxpar train` writes its per-step metrics: a JSONL file, TensorBoard event files, or both.

One record per step, its `step` counted from 1 as the progress bar and the log lines count (a checkpoint
of step N holds the state after it): `loss`, `grad_norm`, `lr` (the learning rate the step applied),
`tokens` (tokens trained on up to and including this step), `time` (unix seconds when the step ended),
`step_time_s`, `tokens_per_s`, `model_flops_per_s` (the step's matmul FLOPs, forward and backward,
without recomputation: jaxpar/cost/flops.py; an MoE model's from its active parameters, the k routed
experts per token), `xla_preset`; with `--hardware`,
`mfu` (model FLOP/s over the devices' peak) and `mfu_nominal` (true when the devices are not that
hardware: simulated CPU devices); an MoE model adds its router statistics. docs/running.md gives every
field with its unit. JSONL keeps every field at full precision; TensorBoard gets the numeric ones
under `train/` through tensorboardX (TensorBoard's event format without TensorFlow), at the record's
step and wall time, so a run is watched as a MaxText, Levanter or torchtitan run is: `tensorboard
--logdir DIR`. Only process 0 writes.

Every step is logged exactly once across preemptions (`check`, then `Sinks`):
  - a fresh run refuses a metrics file that holds records, and a TensorBoard directory that holds
    event files, unless `overwrite` (--overwrite-metrics) replaces them, as --ckpt-dir refuses
    checkpoints it would overwrite;
  - a resumed run (restored from the checkpoint of step N) keeps the JSONL records of steps 1..N, drops
    the later ones (steps the run will take again; also a last line cut short by a kill), and appends.
    The cut is a new file renamed over the old one, so a kill during it leaves one or the other whole.
    TensorBoard's event files cannot be cut: the resumed run writes a new event file that opens with a
    SessionLog START at step N + 1 (tensorboardX's `purge_step`), upon which TensorBoard's reader hides
    every earlier event of step N + 1 or later, so each step is read once (the event files of the
    interrupted run keep those events on disk).
A file that is not a regular file (/dev/null, a pipe) is written as a stream: never refused, never cut.
A failed write (a full disk) is a ConfigError naming the file and the step, not a traceback.
"""
from __future__ import annotations

import json
import os
import pathlib

from jaxpar.errors import ConfigError

SCALARS = ("loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "model_flops_per_s", "mfu",
           "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")
EVAL_SCALARS = ("eval_loss", "eval_ppl")   # held-out evaluation (--eval-every), on the steps it runs
EVENT_FILES = "events.out.tfevents.*"


def read_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file, in order; a last line cut short (no newline, not JSON: the
    run was killed while writing it) is left out. ConfigError for any other line that is not a record
    with an integer step (not a metrics file)."""
    lines = pathlib.Path(path).read_bytes().split(b"\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            if n == len(lines):  # the last line, unterminated: a write interrupted by a kill
                break
            raise ConfigError(f"--metrics {path}, line {n}: not a JSON record; is it a jaxpar metrics file?") from None
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) or not isinstance(record.get("step"), int):
            raise ConfigError(f"--metrics {path}, line {n}: a record without an integer step; is it a jaxpar "
                              "metrics file?")
        records.append(record)
    return records


def _regular(path: str) -> bool:
    return pathlib.Path(path).is_file()


def check(jsonl: str | None, tensorboard: str | None, *, resume: bool, overwrite: bool) -> None:
    """Before anything is built: a fresh run does not overwrite a metrics file or TensorBoard events
    unasked, and a resumed run's metrics file is readable as one."""
    if overwrite and resume:
        raise ConfigError("--resume and --overwrite-metrics contradict each other: --resume keeps the metrics of "
                          "the steps before the restored one, --overwrite-metrics deletes them")
    if overwrite and not (jsonl or tensorboard):
        raise ConfigError("--overwrite-metrics needs --metrics or --tensorboard")
    if resume:
        if jsonl and _regular(jsonl):
            read_records(jsonl)
        return
    if overwrite:
        return
    if jsonl and _regular(jsonl) and os.path.getsize(jsonl):
        steps = [r["step"] for r in read_records(jsonl)]
        held = f"the records of steps {min(steps)}-{max(steps)}" if steps else "data"
        raise ConfigError(f"--metrics {jsonl} already holds {held}; add --resume (with --ckpt-dir) to continue "
                          "the run it logs, or --overwrite-metrics to replace it")
    if tensorboard and (events := sorted(pathlib.Path(tensorboard).glob(EVENT_FILES))):
        raise ConfigError(f"--tensorboard {tensorboard} already holds {len(events)} event file(s); add --resume "
                          "(with --ckpt-dir) to continue the run they log, or --overwrite-metrics to replace them")


def cut_after(path: str, step: int) -> int:
    """Keep the records of steps 1..`step` in JSONL file `path` (atomically: a new file renamed over it).
    Returns how many records were dropped."""
    records = read_records(path)
    kept = [r for r in records if r["step"] <= step]
    tmp = pathlib.Path(f"{path}.{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"--metrics {path}: cannot cut it back to step {step}: {e.strerror or e}") from None
    return len(records) - len(kept)


class Sinks:
    """The metric writers of one run; `write(record)` each step, `close()` at the end. `resumed_at`: the
    step a resumed run restored (its records after that step are cut, and TensorBoard purges them);
    None for a fresh run (`overwrite`: replace what `check` would refuse)."""

    def __init__(self, jsonl: str | None = None, tensorboard: str | None = None, *, resumed_at: int | None = None,
                 overwrite: bool = False):
        self._jsonl = self._tb = None
        self.jsonl_path, self._failed = jsonl, False
        if tensorboard:  # (both paths were checked writable by cli.main: jaxpar.core.inputs.check_outputs)
            try:
                from tensorboardX import SummaryWriter  # deferred: optional dependency, jaxpar[tensorboard]
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboardX package: "
                                  "pip install 'jaxpar[tensorboard]'") from None
            if overwrite:
                for old in pathlib.Path(tensorboard).glob(EVENT_FILES):
                    old.unlink()
            # a file of its own per process (the name has only the second and the host otherwise)
            self._tb = SummaryWriter(logdir=tensorboard, filename_suffix=f".{os.getpid()}",
                                     purge_step=None if resumed_at is None else resumed_at + 1)
        if jsonl:
            pathlib.Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            regular = _regular(jsonl) or not pathlib.Path(jsonl).exists()
            if resumed_at is not None and _regular(jsonl):
                cut_after(jsonl, resumed_at)
            self._jsonl = open(jsonl, "a" if resumed_at is not None or not regular else "w")

    def write(self, record: dict) -> None:
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            except OSError as e:
                self._failed = True
                raise ConfigError(f"--metrics {self.jsonl_path}: cannot write the record of step {record['step']}: "
                                  f"{e.strerror or e}") from None
        if self._tb is not None:
            for key in SCALARS:
                if key in record:
                    self._tb.add_scalar(f"train/{key}", record[key], record["step"], walltime=record.get("time"))
            for key in EVAL_SCALARS:
                if key in record:
                    self._tb.add_scalar(f"eval/{key}", record[key], record["step"], walltime=record.get("time"))
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            try:
                jsonl.close()
            except OSError as e:
                if not self._failed:  # (a failed write was reported already; its buffer fails again here)
                    raise ConfigError(f"--metrics {self.jsonl_path}: cannot write: {e.strerror or e}") from None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
