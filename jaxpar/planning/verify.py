"""`jaxpar plan --verify`: each top plan compiled, its communication and memory beside the prediction.

The planner ranks on the analytic model (jaxpar/cost); this checks the model on the plans it picked.
Each plan's training step is compiled from shapes on simulated CPU devices (jaxpar.analysis.comm:
meshes beyond what XLA:CPU compiles are compiled at reduced data parallelism and rescaled, the rules
stated in that module), and compared with the prediction for the program that was compiled: jaxpar's
own (software `jaxpar`) under XLA:CPU's collective passes (`jaxpar.cost.compiler.CPU`), whatever
software the plan was ranked for. With `plan --verify --target tpu-v5p:8x8x4` the step is compiled by
XLA:TPU for that topology instead (jaxpar/analysis/target.py) and held against `jaxpar.cost.compiler.TPU`.
Per mesh-axis group: the bytes of every collective over exactly those axes (all phases and kinds; scalar
sums, a few bytes, included on the compiled side); per device: the predicted memory (params + grads +
optimizer + activations) against XLA's peak. A difference over TOLERANCE fails the check unless a named
compiler gap (`GAPS`, each found in the compiled step by its own rule below) accounts for it: the check
then holds the prediction against the compiled bytes less the gap's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

from jaxpar.analysis import comm as analysis
from jaxpar.analysis.target import is_tpu_target
from jaxpar.collectives import human_bytes
from jaxpar.cost import comm as cost_comm
from jaxpar.cost import program_memory
from jaxpar.cost.shape import step_shape
from jaxpar.cost.software import program_kernel
from jaxpar.training.trainer import TrainConfig

TOLERANCE = 0.05
REMAT_WARNING = "Involuntary full rematerialization"

# What XLA compiles that jaxpar's program does not ask for and the cost model does not predict, each found
# by its rule in `gaps` (tests/test_planner.py holds each against a step that shows it).
GAPS = {
    "involuntary-remat": "XLA's SPMD partitioner warns of an \"Involuntary full rematerialization\": it cannot "
                         "go from one sharding of a backward activation to the one a ZeRO-1 gradient shard "
                         "propagates into the matmul, and all-gathers it (the backward's all-gathers over "
                         "axes where the program has none)",
    "gather-indices": "XLA's gather partitioning permutes and gathers the embedding lookup's int32 token ids "
                      "across devices (forward collective-permutes and all-gathers over axes where the program "
                      "has none): a few bytes per token",
}


@dataclasses.dataclass(frozen=True)
class Check:
    what: str            # "bytes over data,fsdp" or "memory per device"
    predicted: float
    compiled: float
    gaps: tuple[tuple[str, float], ...] = ()   # (GAPS name, compiled bytes it accounts for)

    @property
    def error(self) -> float:
        """The prediction against the compiled figure less the named gaps' bytes."""
        held = self.compiled - sum(b for _, b in self.gaps)
        if not held:
            return 0.0 if not self.predicted else float("inf")
        return self.predicted / held - 1.0

    @property
    def flagged(self) -> bool:
        return abs(self.error) > TOLERANCE


@contextlib.contextmanager
def partitioner_log():
    """What XLA writes to the process's stderr while the block runs (its C++ warnings), as a list holding
    the text once the block ends; written back to stderr but for the warnings a GAPS entry names."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))
            sys.stderr.writelines(line for line in out[0].splitlines(keepends=True) if REMAT_WARNING not in line)


def gaps(compiled: list[dict], predicted: list, log: str) -> dict[tuple, dict[str, float]]:
    """{axis group: {GAPS name: bytes}}: the compiled collectives a named gap accounts for, per group: those
    of a (kind, axes, phase) the prediction has none of, by each gap's rule."""
    expected = {(c.kind, c.axes, c.phase) for c in predicted}
    found: dict[tuple, dict[str, float]] = {}
    for c in compiled:
        axes = group(c)
        if (c["kind"], axes, c["phase"]) in expected:
            continue
        if c["kind"] == "all-gather" and c["phase"] == "backward" and REMAT_WARNING in log:
            name = "involuntary-remat"
        elif c["kind"] in ("collective-permute", "all-gather") and c["phase"] == "forward":
            name = "gather-indices"
        else:
            continue
        named = found.setdefault(axes, {})
        named[name] = named.get(name, 0.0) + c["bytes"]
    return found


def group(c: dict) -> tuple[str, ...]:
    """A compiled collective's mesh axes, without the tally's partial-group suffixes (`data:(1)2`)."""
    return tuple(dict.fromkeys(a.split(":")[0] for a in c["axes"]))


def verify_plan(model, strategy, global_batch: int, seq: int, devices: list | None = None) -> tuple[list[Check], dict]:
    """(checks, the compiled report) for one plan (a resolved Strategy), compiled on `devices` (default: all)."""
    with partitioner_log() as log:
        report = analysis.analyze_strategy(model, strategy, TrainConfig(batch=global_batch, seq=seq), devices)
    platform = "tpu" if devices and is_tpu_target(devices) else "cpu"
    compiled: dict[tuple, float] = {}
    for c in report["collectives"]:
        compiled[group(c)] = compiled.get(group(c), 0.0) + c["bytes"]
    records = cost_comm.collectives(model, strategy, step_shape(model, strategy, global_batch, seq), compiler=platform)
    predicted: dict[tuple, float] = {}
    for c in records:
        predicted[c.axes] = predicted.get(c.axes, 0.0) + c.bytes
    named = gaps(report["collectives"], records, log[0])
    checks = [Check(f"bytes over {','.join(axes)}", predicted.get(axes, 0.0), compiled.get(axes, 0.0),
                    tuple(named.get(axes, {}).items())) for axes in sorted(predicted.keys() | compiled.keys())]
    mem = program_memory.memory(model, strategy, global_batch, seq, program_kernel(strategy, platform), platform)
    checks.append(Check("memory per device", mem.total, report["memory"]["peak"]))
    return checks, report


def format_checks(rank: int, name: str, checks: list[Check], report: dict) -> str:
    reduced = report.get("reduced_from")
    how = (f"compiled on {reduced['compiled_devices']} devices at reduced data parallelism, rescaled"
           if reduced else f"compiled on {report['devices']} devices ({report.get('compiler', 'XLA:CPU')})")
    lines = [f"#{rank} {name}: {how}",
             f"    {'':<34}{'predicted':>14}{'compiled':>14}{'error':>9}"]
    for c in checks:
        flag = "  <-- over 5%" if c.flagged else ""
        err = f"{c.error:+.1%}" if c.error != float("inf") else "new"
        less = ", ".join(f"{human_bytes(b)} of gap {name}" for name, b in c.gaps)
        lines.append(f"    {c.what:<34}{human_bytes(c.predicted):>14}{human_bytes(c.compiled):>14}{err:>9}{flag}"
                     + (f"  (compiled less {less})" if less else ""))
    for name in dict.fromkeys(name for c in checks for name, _ in c.gaps):
        lines.append(f"    gap {name}: {GAPS[name]}")
    return "\n".join(lines)
