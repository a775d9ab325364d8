"""`jaxpar plan --phase prefill|decode`: search the inference layouts of N devices with the cost model.

Candidates: every way to write N as data x context x expert x tensor, with context > 1 only for a
prefill (a decode step has one token per sequence), expert > 1 only for a model with MoE layers,
tensor at most one node's devices (jaxpar.planning.planner's rule: tensor parallelism all-reduces every layer)
a context split run with ring attention, and `estimate`'s accelerator defaults (bfloat16
compute: jaxpar/cost/defaults.py). Each candidate is checked as `generate` checks it
(jaxpar.core.validate.check_generation), costed for --global-batch sequences of a --seq-token prompt and
--gen-len new tokens (jaxpar/cost/inference.py), and kept only if it fits in the device's memory.

Ranking: by step latency, fastest first. The batch, prompt and device count are fixed across
candidates, so a step's throughput (batch x tokens per sequence / latency) ranks them the same way:
the faster layout is also the higher-throughput one at this batch.
"""
from __future__ import annotations

from jaxpar.collectives import human_bytes
from jaxpar.core import validate
from jaxpar.cost.defaults import accelerator_defaults
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost.inference import PHASES, InferenceEstimate, Request, inference_estimate
from jaxpar.cost.software import JAXPAR, Software
from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.planning.planner import divisors
from jaxpar.core.strategy import AXES, Options, Strategy


def candidates(model: ModelConfig, devices: int, phase: str, max_tensor: int) -> list[Strategy]:
    """The layouts searched (module docstring), as resolved strategies named like `plan`'s."""
    out = []
    for tensor in divisors(devices):
        if tensor > max_tensor:
            continue
        for context in divisors(devices // tensor) if phase == "prefill" else [1]:
            for expert in divisors(devices // (tensor * context)) if model.moe_layers else [1]:
                sizes = {"data": devices // (tensor * context * expert), "context": context, "expert": expert,
                         "tensor": tensor}
                name = "-".join(f"{a}{sizes[a]}" for a in AXES if sizes.get(a, 1) > 1) or "single"
                options = Options(attention="ring") if context > 1 else Options()
                st = Strategy(name=name, mesh=tuple((a, sizes.get(a, 1)) for a in AXES), options=options)
                out.append(accelerator_defaults(st, 1, set())[0])  # as `estimate` costs it (bfloat16)
    return out


def plan_inference(model: ModelConfig, hardware: Hardware | str, devices: int, request: Request, top: int = 10,
                   software: Software = JAXPAR) -> tuple[list[tuple[InferenceEstimate, Strategy]], int, int]:
    """(the `top` fitting layouts for `request`, fastest first, with their estimates; candidates considered;
    valid)."""
    phase, batch, prompt, generate = request.phase, request.batch, request.prompt, request.generate
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} is not one of {', '.join(PHASES)}")
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    considered = valid = 0
    results = []
    for st in candidates(model, devices, phase, min(hw.devices_per_node or 16, devices)):
        considered += 1
        try:
            validate.check_generation(model, st, batch, prompt, generate, phase)
        except ConfigError:
            continue
        valid += 1
        est = inference_estimate(model, st, hw, request, software)
        if est.fits:
            results.append((est, st))
    results.sort(key=lambda r: (r[0].step_s, r[1].name))
    return results[:top], considered, valid


def format_inference_plan(results, considered: int, valid: int, phase: str, software: str = "jaxpar") -> str:
    unit = "prompt tok/s" if phase == "prefill" else "new tok/s"
    width = max([len("strategy"), *(len(st.name) for _, st in results)])
    lines = [f"{considered} {phase} layouts, {valid} valid, {len(results)} shown (fit in memory, lowest step "
             f"latency first = highest throughput at this batch; software {software})",
             f"{'#':>3}  {'strategy':<{width}} {'step ms':>9} {unit:>14} {'mem/dev':>10} {'bound':>17}"]
    for i, (est, st) in enumerate(results, 1):
        lines.append(f"{i:>3}  {st.name:<{width}} {est.step_s * 1e3:>9.3f} {est.tokens_per_s:>14,.0f} "
                     f"{human_bytes(est.memory_total):>10} {est.bound:>17}")
    if not results:
        lines.append("nothing fits: more devices, a smaller batch or a shorter prompt / generation")
    return "\n".join(lines)
