"""What the step benchmarks share: random host parameters, and one strategy's step compiled, tallied,
timed and predicted (imported by experiments/bench_*.py after they set up the simulated devices)."""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxpar.analysis import comm as analysis_comm
from jaxpar.analysis.tally import tally_compiled
from jaxpar.cost import comm as cost_comm
from jaxpar.cost.shape import step_shape
from jaxpar.training.data import Synthetic
from jaxpar.models.config import parse_model
from jaxpar.training.trainer import TrainConfig, Trainer


def host_params(trainer: Trainer):
    """Random host arrays (the step time does not depend on the values; XLA:CPU compiles the random
    initialiser slowly)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: (0.02 * rng.normal(size=a.shape)).astype(a.dtype), trainer.abstract_params)


def compiled_step(model: str, strategy, batch: int, seq: int, steps: int) -> dict:
    """The step of `model` under `strategy` compiled as `jaxpar comm` compiles it: its collectives (the
    HLO tally), XLA's memory analysis, the fastest of `steps` timed steps after a first one, and the
    cost model's collectives for the same step (XLA:CPU traits)."""
    tr = Trainer(parse_model(model), strategy, TrainConfig(batch=batch, seq=seq, steps=steps))
    compiled = tr.lower_step().compile(analysis_comm.ANALYSIS_COMPILER_OPTIONS)
    state, src = tr.state_from_params(host_params(tr)), Synthetic(tr.model_cfg.vocab)
    times = []
    for step in range(steps + 1):
        b = tr.batch(src, step)
        t0 = time.perf_counter()
        state, metrics = compiled(state, b)
        float(metrics["loss"])
        times.append(time.perf_counter() - t0)
    m, st = tr.model_cfg, tr.strategy
    return {"trainer": tr, "tally": tally_compiled(compiled, tr.mesh), "memory": compiled.memory_analysis(),
            "step_s": min(times[1:]), "tokens": batch * seq,
            "predicted": cost_comm.collectives(m, st, step_shape(m, st, batch, seq), compiler="cpu")}
