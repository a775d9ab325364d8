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
"""
from __future__ import annotations

import json
import pathlib

from jaxpar.errors import ConfigError

SCALARS = ("loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "model_flops_per_s", "mfu",
           "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")


class Sinks:
    """The metric writers of one run; `write(record)` each step, `close()` at the end."""

    def __init__(self, jsonl: str | None = None, tensorboard: str | None = None):
        self._jsonl = self._tb = None
        if tensorboard:  # (both paths were checked writable by cli.main: jaxpar.core.inputs.check_outputs)
            try:
                from tensorboardX import SummaryWriter  # deferred: optional dependency, jaxpar[tensorboard]
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboardX package: "
                                  "pip install 'jaxpar[tensorboard]'") from None
            self._tb = SummaryWriter(logdir=tensorboard)
        if jsonl:
            pathlib.Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl, "w")

    def write(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key in SCALARS:
                if key in record:
                    self._tb.add_scalar(f"train/{key}", record[key], record["step"], walltime=record.get("time"))
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
