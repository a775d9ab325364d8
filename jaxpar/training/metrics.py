"""Where `jaxpar train` writes its per-step metrics: a JSONL file, TensorBoard event files, or both.

Each step's record is {step, loss, grad_norm, step_time_s, tokens_per_s, model_flops_per_s, xla_preset (the
compiler scheduling preset the step was compiled with: jaxpar/xla_presets.py)} and, when
`--hardware` names a device, `mfu` (model FLOP/s over the devices' peak). A model with mixture-of-experts
layers adds its router statistics, each averaged over the MoE layers (models/moe.py): `moe_aux_loss`
(the load-balancing loss, 1 when balanced), `moe_z_loss`, `moe_dropped_fraction` (token copies over
capacity), `moe_load_max` / `moe_load_min` (the busiest / idlest expert's copies over the mean); it has
no `model_flops_per_s` or `mfu` (the cost model counts no MoE layers yet). JSONL keeps every field at
full precision; TensorBoard gets the same scalars under `train/` through tensorboardX (TensorBoard's
event format without TensorFlow), so a run is watched as a MaxText, Levanter or torchtitan run is:
`tensorboard --logdir DIR`. Only process 0 writes.
"""
from __future__ import annotations

import json
import pathlib

from jaxpar.errors import ConfigError

SCALARS = ("loss", "grad_norm", "step_time_s", "tokens_per_s", "model_flops_per_s", "mfu", "moe_aux_loss",
           "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")


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
                    self._tb.add_scalar(f"train/{key}", record[key], record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
