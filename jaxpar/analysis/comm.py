"""See the communication: compile one training step and report its collectives, FLOPs and memory.

``analyze(trainer)`` compiles the trainer's step from shapes alone (no arrays) and returns the ``comm`` JSON
object of docs/design.md: {"model", "mesh", "devices", "collectives": [{"kind", "axes", "count", "bytes",
"wire_bytes", "phase"}], "totals", "flops_per_device", "matmul_flops_per_device", "memory": {"argument", "output", "temp", "peak"},
"compile_seconds", "warnings"}, plus ``"reduced_from"`` for a mesh too big to compile.

    collectives   jaxpar.analysis.tally.tally_compiled: kind x mesh axes x phase, per device per step,
                  loop trip counts included (XLA:CPU forms no reduce-scatter and does not reassociate
                  all-reduces; its combiner merges independent ones: listed in ``warnings``)
    FLOPs         XLA's cost_analysis() plus (runs - 1) x FLOPs of every dot or convolution run more than
                  once per step; the matmuls alone beside it (`matmul_flops_per_device`)
    memory        compiled.memory_analysis(): peak = argument + output - alias + temp
    big meshes    above DEVICE_LIMIT (2048) devices the outermost data axes are shrunk (the batch with
                  them, per-device shapes unchanged), and each collective over a shrunk axis rescaled

docs/analysis.md states each reading and its assumptions; jaxpar.analysis.report presents the reports.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from jaxpar.analysis.overlap import overlap_report
from jaxpar.analysis.patterns import dot_flops, scatter_like_all_reduces
from jaxpar.analysis.tally import tally_compiled
from jaxpar.analysis.target import is_tpu_target, mesh_order
from jaxpar.collectives import Collective, human_bytes, totals, wire_factor
from jaxpar.core import validate
from jaxpar.core.sharding import model_layout, optimizer_shardings, param_shardings
from jaxpar.core.strategy import AXES, Strategy, parse_strategy
from jaxpar.devices import MAX_DEVICES
from jaxpar.errors import ConfigError
from jaxpar.training.data import Synthetic
from jaxpar.training.trainer import Trainer, gather

DEVICE_LIMIT = MAX_DEVICES  # XLA:CPU compiles SPMD programs for at most this many devices
SHRINKABLE = ("data", "fsdp")  # outermost data-parallel axes, shrunk in this order


# ----------------------------------------------------------------------------------------------
# One compiled step
# ----------------------------------------------------------------------------------------------


# The executable is never run, so LLVM need not optimise it: level 0 roughly halves XLA:CPU's compile
# time (llama3-70b on 256 devices: 10 -> 6 CPU seconds) and leaves the optimised HLO, and with it the
# collectives and the cost and memory analyses, unchanged.
ANALYSIS_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def analyze(trainer, *, compiler_options: dict | None = ANALYSIS_COMPILER_OPTIONS) -> dict:
    """Compile ``trainer``'s step and report its communication, FLOPs and memory (module docstring).
    Pass ``compiler_options=None`` to compile the executable a run would use (``compare_strategies``)."""
    lowered = trainer.lower_step()
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options)   # (merged with the step's own: its xla_preset)
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a step that cannot fit the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(e) or not is_tpu_target(list(trainer.mesh.devices.flat)):
            raise
        raise ConfigError(f"mesh {trainer.strategy.name} does not fit: XLA:TPU says "
                          f"{str(e).splitlines()[0].removeprefix('RESOURCE_EXHAUSTED: ')}") from None
    report = analyze_compiled(compiled, trainer.mesh, trainer.model_cfg.name, time.perf_counter() - t0)
    report["warnings"] += _moe_notes(tally_compiled(compiled, trainer.mesh), trainer)
    return report


def analyze_compiled(compiled, mesh, model_name: str, compile_seconds: float) -> dict:
    """The report of any compiled step on `mesh` (a training step, or `jaxpar.serving.generate`'s prefill and
    decode steps for `comm --phase`)."""
    text = compiled.as_text()
    tally = tally_compiled(compiled, mesh)
    positions = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    flops = flops_per_device(compiled, text)
    tpu = is_tpu_target(list(mesh.devices.flat))
    return {
        "model": model_name,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "devices": int(mesh.size),
        "collectives": [_as_dict(c) for c in tally],
        "totals": totals(tally),
        "flops_per_device": flops.total,
        "matmul_flops_per_device": flops.matmul,
        "memory": memory_per_device(compiled),
        "compile_seconds": round(compile_seconds, 3),
        "overlap": overlap_report(text, mesh.axis_names, positions),
        "warnings": list(tally.warnings) + [flops.note] + ([] if tpu else _scatter_like_notes(text, mesh)),
        "compiler": f"XLA:TPU ({mesh.devices.flat[0].device_kind})" if tpu else "XLA:CPU",
    }


def _as_dict(c: Collective) -> dict:
    return {"kind": c.kind, "axes": list(c.axes), "count": c.count, "bytes": c.bytes,
            "wire_bytes": c.wire_bytes, "phase": c.phase}


def memory_per_device(compiled) -> dict:
    """argument / output / temp bytes and peak = argument + output - alias + temp."""
    m = compiled.memory_analysis()
    argument, output = m.argument_size_in_bytes, m.output_size_in_bytes
    temp, alias = m.temp_size_in_bytes, m.alias_size_in_bytes
    return {"argument": argument, "output": output, "temp": temp, "peak": argument + output - alias + temp}


class CompiledFlops(NamedTuple):
    total: float    # XLA's cost analysis, with the loops' matmuls run their trip counts
    matmul: float   # dots and convolutions (XLA:TPU writes most dots as convolutions), loops included
    note: str


def flops_per_device(compiled, text: str | None = None) -> CompiledFlops:
    """XLA's FLOPs per device with loop-body matmuls multiplied by their trip counts, the matmuls alone
    (jaxpar.analysis.patterns.dot_flops: what the cost model's hardware FLOPs count), and a note."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost.get("flops", 0.0))
    per_step, counted_once = dot_flops(compiled.as_text() if text is None else text)
    extra = per_step - counted_once
    note = (f"flops_per_device: XLA's cost_analysis counts each loop body once ({xla:.4g} FLOPs); "
            f"dots and convolutions inside loops multiplied by their trip counts add {extra:.4g} "
            f"(non-matmul ops inside loops stay counted once)")
    return CompiledFlops(xla + extra, per_step, note)


def _moe_notes(tally, trainer) -> list[str]:
    """The expert all-to-alls per MoE layer execution and phase (2 forward, 2 backward; 4 backward
    under remat `full`, which reruns the forward pair). MoE layers run once per accumulation step each
    (jaxpar.core.validate refuses them under pipeline parallelism)."""
    m, st = trainer.model_cfg, trainer.strategy
    if not m.moe_layers or st.size("expert") == 1:
        return []
    execs = m.moe_layers * st.options.grad_accum
    parts = [f"{c.count / execs:g} {c.phase} ({human_bytes(c.bytes / c.count)} each)" for c in tally
             if c.kind == "all-to-all" and c.axes == ("expert",) and c.count]
    return [f"expert all-to-alls per MoE layer execution ({execs:g} per step): " + ", ".join(parts)] if parts else []


def _scatter_like_notes(text: str, mesh) -> list[str]:
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    notes = []
    for c in scatter_like_all_reduces(text, mesh.axis_names, ids):
        notes.append(f"all-reduce over {','.join(c.axes)} ({c.phase}): {human_bytes(c.bytes)} in {c.count} "
                     "instances are only dynamic-sliced to this device's 1/n afterwards: reduce-scatters that "
                     "XLA:CPU does not form (GPU/TPU would: same bytes, half the wire bytes)")
    return notes


# ----------------------------------------------------------------------------------------------
# Meshes too big to compile: analyse at reduced data parallelism, rescale
# ----------------------------------------------------------------------------------------------


def reduce_strategy(strategy: Strategy, limit: int = DEVICE_LIMIT) -> tuple[Strategy, dict[str, tuple[int, int]]]:
    """Shrink ``data``, then ``fsdp``, to the largest divisors that fit ``limit`` devices.

    Returns the reduced strategy and ``{axis: (full size, reduced size)}`` for each shrunk axis.
    """
    sizes = dict(strategy.sizes)
    shrunk: dict[str, tuple[int, int]] = {}
    for axis in SHRINKABLE:
        total = math.prod(sizes.values())
        if total <= limit:
            break
        others = total // sizes[axis]
        fits = [d for d in _divisors(sizes[axis]) if others * d <= limit]
        new = max(fits) if fits else 1
        if new != sizes[axis]:
            shrunk[axis] = (sizes[axis], new)
            sizes[axis] = new
    total = math.prod(sizes.values())
    if total > limit:
        desc = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
        raise ConfigError(f"mesh {strategy.name} needs {strategy.num_devices} devices; even with data and fsdp "
                          f"shrunk to 1 ({desc}) it needs {total} > {limit}, the most XLA:CPU compiles")
    return dataclasses.replace(strategy, mesh=tuple(sizes.items())), shrunk


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rescale(collectives: Iterable[Collective], full_sizes: dict[str, int],
            shrunk: dict[str, tuple[int, int]]) -> tuple[list[Collective], list[str]]:
    """Collectives of the reduced compile, as the full mesh would run them (module docstring)."""
    out, notes = [], []
    for c in collectives:
        if not any(_base(a) in shrunk for a in c.axes):
            out.append(c)
            continue
        if any(_base(a) in shrunk and a != _base(a) for a in c.axes):
            notes.append(f"{c.kind} over {','.join(c.axes)} ({c.phase}) spans part of a shrunk axis: left as compiled")
            out.append(c)
            continue
        n = math.prod(full_sizes[a] for a in c.axes)
        out.append(dataclasses.replace(c, wire_bytes=c.bytes * wire_factor(c.kind, n)))
    return out, notes


def _base(axis_label: str) -> str:
    return axis_label.split(":")[0]


def analyze_strategy(model, strategy: Strategy, tc, devices: list | None = None, *,
                     limit: int = DEVICE_LIMIT) -> dict:
    """``analyze`` a (model, strategy, TrainConfig); meshes bigger than ``min(limit, len(devices))``
    are compiled at reduced data parallelism and rescaled (module docstring)."""
    devices = list(jax.devices() if devices is None else devices)
    full = strategy.resolved(strategy.num_devices if -1 not in strategy.sizes.values() else len(devices))
    validate.check(model, full, batch=tc.batch, seq=tc.seq)
    if is_tpu_target(devices):  # XLA:TPU: the whole topology, compiled as the slice runs it (analysis/target.py)
        return analyze(Trainer(model, full, tc, mesh_order(devices, full)), compiler_options=None)
    room = min(limit, len(devices))
    if full.num_devices <= room:
        return analyze(Trainer(model, full, tc, devices[:full.num_devices]))
    small, shrunk = reduce_strategy(full, room)
    scale = math.prod(f // s for f, s in shrunk.values())
    small_tc = dataclasses.replace(tc, batch=tc.batch // scale)
    trainer = Trainer(model, small, small_tc, devices[:small.num_devices])
    report = analyze(trainer)
    return _rescaled_report(report, trainer, full, shrunk, tc.batch)


def _rescaled_report(report: dict, trainer, full: Strategy, shrunk: dict, batch: int) -> dict:
    collectives = [Collective(c["kind"], tuple(c["axes"]), c["count"], c["bytes"], c["wire_bytes"], c["phase"])
                   for c in report["collectives"]]
    scaled, notes = rescale(collectives, full.sizes, shrunk)
    delta = state_bytes_per_device(trainer, full) - state_bytes_per_device(trainer, trainer.strategy)
    memory = dict(report["memory"])
    for key in ("argument", "output", "peak"):
        memory[key] += delta
    compiled_mesh = report["mesh"]
    report.update(
        mesh={a: full.size(a) for a in AXES},
        devices=full.num_devices,
        collectives=[_as_dict(c) for c in scaled],
        totals=totals(scaled),
        memory=memory,
        warnings=report["warnings"] + notes,
        reduced_from={
            "compiled_mesh": compiled_mesh,
            "compiled_devices": trainer.strategy.num_devices,
            "compiled_batch": trainer.tc.batch,
            "batch": batch,
            "shrunk_axes": {a: {"full": f, "compiled": s} for a, (f, s) in shrunk.items()},
            "state_bytes_added": delta,
            "rules": ("per-device shapes held constant (global batch scaled with the data-parallel size); "
                      "count and bytes of every collective unchanged; wire_bytes recomputed with the full "
                      "group size; all-gather/reduce-scatter full buffers over data/fsdp taken as "
                      "parameter-sized (activation gathers over those axes are under-reported); "
                      "memory: parameter and optimizer shards recomputed for the full mesh, temp as compiled"),
        },
    )
    return report


def state_bytes_per_device(trainer, strategy: Strategy) -> int:
    """Bytes of one device's parameter + optimizer-state shards if ``trainer``'s model ran on
    ``strategy``'s mesh (an abstract mesh: no devices needed)."""
    mesh = AbstractMesh(tuple(strategy.size(a) for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    layout = model_layout(mesh, strategy, trainer.model_cfg)
    params = trainer.abstract_params
    opt = jax.eval_shape(trainer.optimizer.init, params)
    total = 0
    for tree, shardings in ((params, param_shardings(params, layout)),
                            (opt, optimizer_shardings(opt, params, layout))):
        for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
            total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


# ----------------------------------------------------------------------------------------------
# Several strategies, optionally trained a few steps against one device
# ----------------------------------------------------------------------------------------------


def compare_strategies(model, strategies: Sequence[Strategy], tc, devices: list, *, run_steps: int = 0) -> list[dict]:
    """One report per strategy (``name`` = its spec). With ``run_steps`` K > 0 each strategy also
    trains K steps from the same initial parameters as a 1-device run, on the same batches, and
    its report gets ``run``: {steps, loss (last), loss_diff (max |loss - 1-device loss|), step_time_s}."""
    reports = []
    if run_steps and is_tpu_target(devices):
        raise ConfigError("--run-steps trains on the devices, but a TPU --target's chips only compile here "
                          "(jaxpar/analysis/target.py): drop --run-steps or --target")
    if not run_steps:
        for s in strategies:
            reports.append({"name": s.name, **analyze_strategy(model, s, tc, devices)})
        return reports
    source = Synthetic(model.vocab, seed=tc.seed)
    reference = Trainer(model, parse_strategy("data=1"), tc, devices[:1])
    params = gather(reference.init_state().params)
    ref_losses, _ = _run(reference, params, source, run_steps)
    for s in strategies:
        full = s.resolved(s.num_devices if s.num_devices > 0 else len(devices))
        if full.num_devices > len(devices):
            raise ConfigError(f"--run-steps: mesh {s.name} needs {full.num_devices} devices, "
                              f"{len(devices)} are simulated (raise --devices)")
        trainer = Trainer(model, full, tc, devices[:full.num_devices])
        report = {"name": s.name, **analyze(trainer, compiler_options=None)}
        losses, step_time = _run(trainer, params, source, run_steps)
        report["run"] = {"steps": run_steps, "loss": losses[-1], "step_time_s": step_time,
                         "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}
        reports.append(report)
    return reports


def _run(trainer, params, source, steps: int) -> tuple[list[float], float]:
    """Losses of ``steps`` steps from ``params`` and the median step time, using the executable
    that ``analyze`` compiled (jax caches it), so nothing compiles twice."""
    step = trainer.lower_step().compile()
    state = trainer.state_from_params(params)
    losses, times = [], []
    for i in range(steps):
        batch = trainer.batch(source, i)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times)
