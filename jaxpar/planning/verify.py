"""`jaxpar plan --verify`: each top plan compiled, its communication and memory beside the prediction.

The planner ranks on the analytic model (jaxpar/cost); this checks the model on the plans it picked.
Each plan's training step is compiled from shapes on simulated CPU devices (jaxpar.analysis.comm:
meshes beyond what XLA:CPU compiles are compiled at reduced data parallelism and rescaled, the rules
stated in that module), and compared with the prediction for the program that was compiled: jaxpar's
own (software `jaxpar`) under XLA:CPU's collective passes (`jaxpar.cost.compiler.CPU`), whatever
software the plan was ranked for. With `plan --verify --target tpu-v5p:8x8x4` the step is compiled by
XLA:TPU for that topology instead (jaxpar/analysis/target.py) and held against `jaxpar.cost.compiler.TPU`
(its known gaps: `TPU_GAPS` there). Per mesh-axis group: the bytes of every collective over exactly
those axes (all phases and kinds; scalar sums, a few bytes, included on the compiled side); per
device: the predicted memory (params + grads + optimizer + activations) against XLA's peak. A
difference over TOLERANCE is flagged.
"""
from __future__ import annotations

import dataclasses

from jaxpar.analysis import comm as analysis
from jaxpar.analysis.target import is_tpu_target
from jaxpar.collectives import human_bytes
from jaxpar.cost import comm as cost_comm
from jaxpar.cost import program_memory
from jaxpar.cost.shape import step_shape
from jaxpar.cost.software import program_kernel
from jaxpar.training.trainer import TrainConfig

TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Check:
    what: str            # "bytes over data,fsdp" or "memory per device"
    predicted: float
    compiled: float

    @property
    def error(self) -> float:
        if not self.compiled:
            return 0.0 if not self.predicted else float("inf")
        return self.predicted / self.compiled - 1.0

    @property
    def flagged(self) -> bool:
        return abs(self.error) > TOLERANCE


def verify_plan(model, strategy, global_batch: int, seq: int, devices: list | None = None) -> tuple[list[Check], dict]:
    """(checks, the compiled report) for one plan (a resolved Strategy), compiled on `devices` (default: all)."""
    report = analysis.analyze_strategy(model, strategy, TrainConfig(batch=global_batch, seq=seq), devices)
    platform = "tpu" if devices and is_tpu_target(devices) else "cpu"
    compiled: dict[tuple, float] = {}
    for c in report["collectives"]:
        key = tuple(dict.fromkeys(a.split(":")[0] for a in c["axes"]))
        compiled[key] = compiled.get(key, 0.0) + c["bytes"]
    predicted: dict[tuple, float] = {}
    for c in cost_comm.collectives(model, strategy, step_shape(model, strategy, global_batch, seq), compiler=platform):
        predicted[c.axes] = predicted.get(c.axes, 0.0) + c.bytes
    checks = [Check(f"bytes over {','.join(axes)}", predicted.get(axes, 0.0), compiled.get(axes, 0.0))
              for axes in sorted(predicted.keys() | compiled.keys())]
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
        lines.append(f"    {c.what:<34}{human_bytes(c.predicted):>14}{human_bytes(c.compiled):>14}{err:>9}{flag}")
    return "\n".join(lines)
