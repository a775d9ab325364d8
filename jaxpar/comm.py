"""See the communication: compile one training step and report its collectives, FLOPs and memory.

``analyze(trainer)`` compiles the trainer's step (from shapes only when ``abstract``) and returns
the ``comm`` JSON object of DESIGN.md::

    {"model", "mesh": {axis: size}, "devices",
     "collectives": [{"kind", "axes", "count", "bytes", "wire_bytes", "phase"}],
     "totals": {"count", "bytes", "wire_bytes"}, "flops_per_device",
     "memory": {"argument", "output", "temp", "peak"}, "compile_seconds", "warnings": [...]}

plus ``"reduced_from"`` when the mesh was too big to compile (below). ``format_table``,
``compare`` and ``plot`` present one or several reports.

Collectives
    ``jaxpar.hlo.tally_compiled``: kind x mesh axes x phase, per device per step, loop trip counts
    included. Three facts about XLA:CPU (the backend these analyses run on) shape what is seen:
    * it has no ReduceScatterCreator pass, so a reduce-scatter that the SPMD partitioner would
      form on GPU/TPU (gradients under FSDP and ZeRO-1, the row-parallel output under sequence
      parallelism) stays an all-reduce whose result is immediately dynamic-sliced to 1/n. Same
      ``bytes``, but twice the ring ``wire_bytes``. ``scatter_like_all_reduces`` finds them and
      ``analyze`` lists them in ``warnings``;
    * it has no AllReduceReassociate pass, so ``AR(x) + AR(y)`` is not rewritten to ``AR(x + y)``
      (e.g. the input gradients of the q, k and v projections under tensor parallelism are
      all-reduced one by one);
    * its all-reduce combiner merges independent all-reduces into one tuple-shaped op whose
      ``op_name`` lists all of theirs; the tally gives the whole op one phase (``optimizer`` wins
      if any part is in the optimizer scope, then ``backward``).

FLOPs per device
    XLA's ``cost_analysis()`` counts each while-loop body once, whatever its trip count. We add
    ``(runs - 1) x FLOPs`` for every ``dot`` that runs more than once per step (runs from the
    HLO call graph with ``known_trip_count``; a dot costs 2 x result elements x contracted
    elements). Non-dot ops inside loop bodies (elementwise, reductions: a few percent of a
    transformer's FLOPs) stay counted once, so the figure is a slight under-estimate; the raw
    XLA figure is kept in ``warnings``.

Memory per device
    From ``compiled.memory_analysis()``: ``argument``, ``output`` and ``temp`` sizes, and
    ``peak = argument + output - alias + temp`` (donated state aliases its output). XLA:CPU's
    own ``peak_memory_in_bytes`` leaves out the temporaries, so it is not used.

Meshes above ``DEVICE_LIMIT`` (2048) devices
    XLA:CPU refuses to compile for more than 2048 devices ("Multiprocess computations aren't
    implemented on the CPU backend"). ``analyze_strategy`` then shrinks the outermost
    data-parallel axes, ``data`` first and ``fsdp`` second, to the largest divisors of their
    sizes that fit, scales the global batch down by the same factor so that every per-device
    activation shape is unchanged, compiles that, and rescales each collective whose device
    group spans a shrunk axis from the compiled group size n_small to the full size n_full:

    * ``count`` is unchanged: the step runs the same collectives, over bigger groups;
    * ``bytes`` (the full buffer of each instance) is unchanged. For all-reduce, all-to-all and
      collective-permute the per-device buffer is an activation or gradient shard whose shape
      does not depend on the data-parallel size. For all-gather and reduce-scatter over
      ``data``/``fsdp`` the full buffer is a parameter or gradient (FSDP, ZeRO-1): its size is
      fixed by the model, and only the per-device shard shrinks as n grows;
    * ``wire_bytes`` follows the ring formula with n_full (AG, RS, A2A (n-1)/n; AR 2(n-1)/n).

    Assumptions, stated in ``reduced_from``: an all-gather of an activation over a data axis
    (XLA gathers the token ids for an FSDP embedding lookup) would grow by n_full/n_small and
    is under-reported (it is a few KiB); a group over a *part* of a shrunk axis
    (``'fsdp:(2)4'``) is left as compiled, with a warning. FLOPs per device are unchanged.
    Memory: the parameter and optimizer-state shards are recomputed for the full mesh
    (``argument``, ``output`` and ``peak`` move by the difference); ``temp`` is the reduced
    compile's, an over-estimate when ``fsdp`` (or ``data`` under ZeRO-1) shrank, because
    gradient shards are bigger there.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Iterable, Sequence

import numpy as np

from jaxpar import hlo
from jaxpar.errors import ConfigError
from jaxpar.strategy import AXES, Strategy

DEVICE_LIMIT = 2048  # XLA:CPU compiles SPMD programs for at most this many devices
SHRINKABLE = ("data", "fsdp")  # outermost data-parallel axes, shrunk in this order


# ----------------------------------------------------------------------------------------------
# One compiled step
# ----------------------------------------------------------------------------------------------


# The executable is never run, so LLVM need not optimise it: level 0 roughly halves XLA:CPU's compile
# time (llama3-70b on 256 devices: 10 -> 6 CPU seconds) and leaves the optimised HLO, and with it the
# collectives and the cost and memory analyses, unchanged.
ANALYSIS_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def analyze(trainer, abstract: bool = True, *, compiler_options: dict | None = ANALYSIS_COMPILER_OPTIONS) -> dict:
    """Compile ``trainer``'s step and report its communication, FLOPs and memory (module docstring).
    Pass ``compiler_options=None`` to compile the executable a run would use (``compare_strategies``)."""
    lowered = trainer.lower_step(abstract=abstract)
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options)
    compile_seconds = time.perf_counter() - t0
    text = compiled.as_text()
    mesh = trainer.mesh
    tally = hlo.tally_compiled(compiled, mesh)
    flops, flops_note = flops_per_device(compiled, text)
    warnings = list(tally.warnings) + [flops_note] + _scatter_like_notes(text, mesh)
    return {
        "model": trainer.model_cfg.name,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "devices": int(mesh.size),
        "collectives": [_as_dict(c) for c in tally],
        "totals": hlo.totals(tally),
        "flops_per_device": flops,
        "memory": memory_per_device(compiled),
        "compile_seconds": round(compile_seconds, 3),
        "warnings": warnings,
    }


def _as_dict(c: hlo.Collective) -> dict:
    return {"kind": c.kind, "axes": list(c.axes), "count": c.count, "bytes": c.bytes,
            "wire_bytes": c.wire_bytes, "phase": c.phase}


def memory_per_device(compiled) -> dict:
    """argument / output / temp bytes and peak = argument + output - alias + temp."""
    m = compiled.memory_analysis()
    argument, output = m.argument_size_in_bytes, m.output_size_in_bytes
    temp, alias = m.temp_size_in_bytes, m.alias_size_in_bytes
    return {"argument": argument, "output": output, "temp": temp, "peak": argument + output - alias + temp}


def flops_per_device(compiled, text: str | None = None) -> tuple[float, str]:
    """XLA's FLOPs per device with loop-body dots multiplied by their trip counts, and a note."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost.get("flops", 0.0))
    per_step, counted_once = dot_flops(compiled.as_text() if text is None else text)
    extra = per_step - counted_once
    note = (f"flops_per_device: XLA's cost_analysis counts each loop body once ({xla:.4g} FLOPs); "
            f"dots inside loops multiplied by their trip counts add {extra:.4g} "
            f"(non-dot ops inside loops stay counted once)")
    return xla + extra, note


def dot_flops(hlo_text: str) -> tuple[float, float]:
    """FLOPs of every ``dot`` per step (trip counts included) and as counted with each loop body
    run once (XLA's cost analysis view): 2 x result elements x contracted elements."""
    computations, entry = hlo._parse_module(hlo_text)  # noqa: SLF001 (shared HLO reader)
    shapes = {i.name: i.shape for instrs in computations.values() for i in instrs}
    once = {name: [_without_trip_count(i) for i in instrs] for name, instrs in computations.items()}
    per_step = _sum_dot_flops(computations, entry, shapes)
    return per_step, _sum_dot_flops(once, entry, shapes)


def _without_trip_count(instr):
    if instr.opcode != "while":
        return instr
    return dataclasses.replace(instr, text=re.sub(r'"known_trip_count":\{"n":"\d+"\}',
                                                  '"known_trip_count":{"n":"1"}', instr.text))


def _sum_dot_flops(computations, entry: str, shapes: dict[str, str]) -> float:
    total = 0.0
    for instr, times, _ in hlo._executed_instructions(computations, entry):  # noqa: SLF001
        if instr.opcode == "dot" and times:
            total += times * _one_dot_flops(instr, shapes)
    return total


def _one_dot_flops(instr, shapes: dict[str, str]) -> float:
    lhs = _operands(instr.text)[0]
    lhs_dims = _dims(shapes[lhs])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.text)
    contracted = math.prod(lhs_dims[int(d)] for d in contracting[1].split(",") if d) if contracting else 1
    return 2.0 * math.prod(_dims(instr.shape)) * contracted


def _dims(shape: str) -> list[int]:
    match = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    return [int(d.strip().removeprefix("<=")) for d in match[1].split(",") if d.strip()] if match else []


def _operands(text: str) -> list[str]:
    """Names of an instruction's operands (``text`` starts with ``opcode(``)."""
    start = text.index("(")
    return re.findall(r"%([\w.\-]+)", text[start:hlo._closing(text, start)])  # noqa: SLF001


# ----------------------------------------------------------------------------------------------
# All-reduces that are reduce-scatters in disguise (XLA:CPU forms no reduce-scatter)
# ----------------------------------------------------------------------------------------------

_PASS_THROUGH = frozenset({"bitcast", "copy", "reshape", "convert"})  # keep every element, in order


def scatter_like_all_reduces(hlo_text: str, axis_names: Sequence[str], device_ids) -> list[hlo.Collective]:
    """The all-reduces whose every result is only ever dynamic-sliced to 1/n (n = group size):
    what GPU/TPU XLA turns into reduce-scatters. ``bytes`` counts those results, per step."""
    computations, entry = hlo._parse_module(hlo_text)  # noqa: SLF001
    users = _users(computations)
    mesh = hlo._MeshIndex.build(axis_names, device_ids)  # noqa: SLF001
    merged: dict[tuple, list] = {}
    for instr, times, _ in hlo._executed_instructions(computations, entry):  # noqa: SLF001
        if instr.opcode != "all-reduce" or not times:
            continue
        axes, n = hlo._communicator(instr, mesh)  # noqa: SLF001
        if not axes or axes == hlo.UNMATCHED_AXES:
            continue
        sliced = sum(hlo._shape_bytes(shape) for name, shape in _results(instr, users)  # noqa: SLF001
                     if _only_sliced(name, _elements(shape), n, users, computations))
        if sliced:
            entry_ = merged.setdefault((axes, hlo.phase_of(hlo._op_name(instr))), [0, 0, 0.0])  # noqa: SLF001
            entry_[0] += times
            entry_[1] += times * sliced
            entry_[2] += times * sliced * 2 * (n - 1) / n
    return [hlo.Collective("all-reduce", axes, c, b, w, phase) for (axes, phase), (c, b, w) in merged.items()]


def _users(computations) -> dict[str, list[tuple]]:
    """Instruction name -> [(user instruction, operand position), ...] (names are module-unique)."""
    out: dict[str, list[tuple]] = {}
    for instrs in computations.values():
        for instr in instrs:
            if "(" not in instr.text:
                continue
            for pos, name in enumerate(_operands(instr.text)):
                out.setdefault(name, []).append((instr, pos))
    return out


def _results(instr, users) -> list[tuple[str, str]]:
    """(name, shape) of each array an all-reduce produces: itself, or its get-tuple-elements."""
    if not instr.shape.startswith("("):
        return [(instr.name, instr.shape)]
    return [(u.name, u.shape) for u, _ in users.get(instr.name, []) if u.opcode == "get-tuple-element"]


def _elements(shape: str) -> int:
    return math.prod(_dims(shape))


def _only_sliced(name: str, elements: int, n: int, users, computations, exits: tuple[str, ...] = ()) -> bool:
    """Whether every use of ``name`` is a dynamic-slice keeping elements/n, through bitcasts,
    copies, reshapes and converts, into fusions and out of them again (``exits``: the fusions whose
    result ``name`` becomes if it is the root of their fused computation)."""
    uses = users.get(name, [])
    if not uses:
        return bool(exits) and _only_sliced(exits[-1], elements, n, users, computations, exits[:-1])
    for user, pos in uses:
        if user.opcode == "dynamic-slice":
            ok = pos == 0 and _elements(user.shape) * n == elements
        elif user.opcode in _PASS_THROUGH:
            ok = _only_sliced(user.name, elements, n, users, computations, exits)
        elif user.opcode == "fusion":
            param = _fusion_parameter(user, pos, computations)
            ok = param is not None and _only_sliced(param, elements, n, users, computations, exits + (user.name,))
        else:
            ok = False
        if not ok:
            return False
    return True


def _fusion_parameter(fusion, pos: int, computations) -> str | None:
    called = re.search(r"\bcalls=%?([\w.\-]+)", fusion.text)
    for instr in computations.get(called[1], []) if called else []:
        if instr.opcode == "parameter" and re.match(rf"parameter\({pos}\)", instr.text):
            return instr.name
    return None


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
    sizes = strategy.sizes
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


def rescale(collectives: Iterable[hlo.Collective], full_sizes: dict[str, int],
            shrunk: dict[str, tuple[int, int]]) -> tuple[list[hlo.Collective], list[str]]:
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
        out.append(dataclasses.replace(c, wire_bytes=c.bytes * _wire_factor(c.kind, n)))
    return out, notes


def _base(axis_label: str) -> str:
    return axis_label.split(":")[0]


def _wire_factor(kind: str, n: int) -> float:
    if kind == "collective-permute":
        return 1.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


def analyze_strategy(model, strategy: Strategy, tc, devices: list | None = None, *,
                     limit: int = DEVICE_LIMIT, abstract: bool = True) -> dict:
    """``analyze`` a (model, strategy, TrainConfig); meshes bigger than ``min(limit, len(devices))``
    are compiled at reduced data parallelism and rescaled (module docstring)."""
    import jax  # noqa: PLC0415

    from jaxpar import validate  # noqa: PLC0415
    from jaxpar.train import Trainer  # noqa: PLC0415

    devices = list(jax.devices() if devices is None else devices)
    full = strategy.resolved(strategy.num_devices if -1 not in strategy.sizes.values() else len(devices))
    validate.check(model, full, batch=tc.batch, seq=tc.seq)
    room = min(limit, len(devices))
    if full.num_devices <= room:
        return analyze(Trainer(model, full, tc, devices[:full.num_devices]), abstract)
    small, shrunk = reduce_strategy(full, room)
    scale = math.prod(f // s for f, s in shrunk.values())
    small_tc = dataclasses.replace(tc, batch=tc.batch // scale)
    trainer = Trainer(model, small, small_tc, devices[:small.num_devices])
    report = analyze(trainer, abstract)
    return _rescaled_report(report, trainer, full, shrunk, tc.batch)


def _rescaled_report(report: dict, trainer, full: Strategy, shrunk: dict, batch: int) -> dict:
    collectives = [hlo.Collective(c["kind"], tuple(c["axes"]), c["count"], c["bytes"], c["wire_bytes"], c["phase"])
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
        totals=hlo.totals(scaled),
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
    import jax  # noqa: PLC0415
    from jax.sharding import AbstractMesh, AxisType  # noqa: PLC0415

    from jaxpar.sharding import Layout, optimizer_shardings, param_shardings  # noqa: PLC0415

    mesh = AbstractMesh(tuple(strategy.size(a) for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    layout = Layout(mesh, strategy)
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
    from jaxpar.data import Synthetic  # noqa: PLC0415
    from jaxpar.strategy import parse_strategy  # noqa: PLC0415
    from jaxpar.train import Trainer, gather  # noqa: PLC0415

    reports = []
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
    import statistics  # noqa: PLC0415

    step = trainer.lower_step(abstract=True).compile()
    state = trainer.state_from_params(params)
    losses, times = [], []
    for i in range(steps):
        batch = trainer.batch(source, i)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Presenting reports
# ----------------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def human_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def mesh_label(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "1 device"


def _rows(report: dict) -> dict[tuple[str, str, str], dict]:
    return {(c["kind"], ",".join(c["axes"]), c["phase"]): c for c in report["collectives"]}


def _row_order(keys: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return sorted(set(keys), key=lambda k: (hlo.KINDS.index(k[0]), k[1], hlo.PHASES.index(k[2])))


def format_table(report: dict) -> str:
    """One report as text: kind x axes x phase with totals, then FLOPs, memory and warnings."""
    lines = [f"{report['model']} on {mesh_label(report['mesh'])} ({report['devices']} devices), "
             "per device per step"]
    if "reduced_from" in report:
        r = report["reduced_from"]
        lines.append(f"  compiled at {mesh_label(r['compiled_mesh'])} ({r['compiled_devices']} devices, "
                     f"batch {r['compiled_batch']} of {r['batch']}) and rescaled: see reduced_from")
    head = f"{'kind':<20}{'axes':<16}{'phase':<11}{'count':>7}{'bytes':>14}{'wire bytes':>14}"
    lines += ["", head, "-" * len(head)]
    rows = _rows(report)
    for key in _row_order(rows):
        c = rows[key]
        lines.append(f"{key[0]:<20}{key[1]:<16}{key[2]:<11}{c['count']:>7}"
                     f"{human_bytes(c['bytes']):>14}{human_bytes(c['wire_bytes']):>14}")
    t = report["totals"]
    lines += ["-" * len(head),
              f"{'total':<47}{t['count']:>7}{human_bytes(t['bytes']):>14}{human_bytes(t['wire_bytes']):>14}", ""]
    m = report["memory"]
    lines.append(f"FLOPs per device  {human_flops(report['flops_per_device'])}")
    lines.append("memory per device " + ", ".join(f"{k} {human_bytes(m[k])}" for k in ("argument", "output", "temp", "peak")))
    lines.append(f"compile           {report['compile_seconds']:.1f} s")
    if report.get("warnings"):
        lines += ["", "notes:"] + [f"  - {w}" for w in report["warnings"]]
    return "\n".join(lines)


def report_name(report: dict) -> str:
    return report.get("name") or mesh_label(report["mesh"])


def compare(reports: Sequence[dict]) -> str:
    """Several reports side by side: bytes per kind x axes x phase, totals, FLOPs, memory, runs."""
    names = [report_name(r) for r in reports]
    width = max(14, *(len(n) + 2 for n in names))
    label = 47
    head = f"{'kind / axes / phase':<{label}}" + "".join(f"{n:>{width}}" for n in names)
    lines = [f"model {reports[0]['model']}, per device per step (bytes)", "", head, "-" * len(head)]
    all_rows = [_rows(r) for r in reports]
    for key in _row_order(k for rows in all_rows for k in rows):
        cells = [human_bytes(rows[key]["bytes"]) if key in rows else "-" for rows in all_rows]
        lines.append(f"{' / '.join(key):<{label}}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append("-" * len(head))

    def row(title: str, values: Iterable[str]) -> None:
        lines.append(f"{title:<{label}}" + "".join(f"{v:>{width}}" for v in values))

    row("total bytes", (human_bytes(r["totals"]["bytes"]) for r in reports))
    row("total wire bytes", (human_bytes(r["totals"]["wire_bytes"]) for r in reports))
    row("collective instances", (str(r["totals"]["count"]) for r in reports))
    row("devices", (str(r["devices"]) for r in reports))
    row("FLOPs per device", (human_flops(r["flops_per_device"]) for r in reports))
    row("peak memory per device", (human_bytes(r["memory"]["peak"]) for r in reports))
    row("compile seconds", (f"{r['compile_seconds']:.1f}" for r in reports))
    if any("run" in r for r in reports):
        row("|loss - 1-device loss| (max over steps)",
            (f"{r['run']['loss_diff']:.2e}" if "run" in r else "-" for r in reports))
        row("step time (ms)", (f"{r['run']['step_time_s'] * 1e3:.1f}" if "run" in r else "-" for r in reports))
    return "\n".join(lines)


def plot(reports: Sequence[dict], path: str) -> None:
    """PNG: per strategy, stacked bars of bytes and wire bytes per device per step by kind and axes."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [report_name(r) for r in reports]
    groups = sorted({(c["kind"], ",".join(c["axes"])) for r in reports for c in r["collectives"]},
                    key=lambda g: (hlo.KINDS.index(g[0]), g[1]))
    colors = plt.get_cmap("tab20")
    biggest = max(max(r["totals"]["bytes"], r["totals"]["wire_bytes"]) for r in reports)
    unit, scale = ("GiB", 2**30) if biggest > 10 * 2**30 else ("MiB", 2**20) if biggest > 10 * 2**20 else ("KiB", 2**10)
    fig, panels = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(names) + 4), 5), sharey=True)
    for panel, field in zip(panels, ("bytes", "wire_bytes")):
        bottom = [0.0] * len(reports)
        for i, (kind, axes) in enumerate(groups):
            heights = [sum(c[field] for c in r["collectives"] if (c["kind"], ",".join(c["axes"])) == (kind, axes))
                       / scale for r in reports]
            panel.bar(names, heights, bottom=bottom, color=colors(i % 20), label=f"{kind} over {axes}")
            bottom = [b + h for b, h in zip(bottom, heights)]
        panel.set_title(field.replace("_", " ") + " per device per step")
        panel.tick_params(axis="x", rotation=30)
    panels[0].set_ylabel(unit)
    panels[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{reports[0]['model']}: collectives by kind and mesh axes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
