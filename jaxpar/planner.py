"""`jaxpar plan`: which strategy to rent for a model, a cluster and a batch.

Enumerates meshes over the six axes for N devices, with the options a practitioner would try for
each (ZeRO-3 on the fsdp axis, ZeRO-0 or ZeRO-1 on `data`, sequence parallelism whenever tensor > 1, remat none /
selective / full, ring attention when the sequence is split, pipeline micro-batches), drops those
that violate a constraint (jaxpar.validate.check, the same checks a run makes) or do not fit in
memory, and ranks the rest by the analytic model's tokens/s (jaxpar.cost.estimate).

Search space limits, stated: tensor parallelism stays inside a node (<= devices_per_node; TPU slices:
<= 16); the expert axis is searched for MoE models only (sizes that divide the expert count; it doubles as
a batch axis for the other layers); pipeline micro-batches M = 4 * stages
when the batch allows it; circular schedules are not searched; gradient accumulation gives
per-device micro-batches of 1, 2, 4 or the whole local batch.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from jaxpar import validate
from jaxpar.cost import estimate
from jaxpar.cost.estimate import check_modelled
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.errors import ConfigError
from jaxpar.strategy import AXES, Options, Strategy
from jaxpar.models.config import ModelConfig


def powers_of_two_up_to(n: int) -> list[int]:
    return [2 ** i for i in range(n.bit_length()) if n % 2 ** i == 0]


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidate_meshes(devices: int, max_tensor: int, experts: int = 0):
    """Axis sizes with product == devices: every divisor for fsdp, pipeline, context and tensor (<=
    max_tensor), expert over the divisors of `experts` (MoE models; 1 otherwise), data the rest."""
    divs = divisors(devices)
    expert_sizes = [e for e in divs if experts % e == 0] if experts else [1]
    for tensor, pipeline, context, fsdp, expert in itertools.product(divs, divs, divs, divs, expert_sizes):
        if tensor > max_tensor:
            continue
        rest = tensor * pipeline * context * fsdp * expert
        if devices % rest:
            continue
        yield {"data": devices // rest, "fsdp": fsdp, "pipeline": pipeline, "context": context,
               "expert": expert, "tensor": tensor}


def candidate_options(sizes: dict[str, int], global_batch: int):
    """Remat policy x gradient accumulation (per-device micro-batch of 1, 2, 4 or all sequences)."""
    micro = 4 * sizes["pipeline"] if sizes["pipeline"] > 1 else 1
    local = global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"] * micro) or 1
    accums = sorted({max(local // b, 1) for b in (1, 2, 4, local)})
    zeros = (None, 1) if sizes["data"] > 1 and sizes["fsdp"] == 1 else (None,)
    for remat, accum, zero in itertools.product(("none", "dots_no_batch", "full"), accums, zeros):
        yield Options(zero=zero, remat=remat, dtype="bfloat16", sequence_parallel=sizes["tensor"] > 1,
                      attention="ring" if sizes["context"] > 1 else "dense", microbatches=micro,
                      grad_accum=accum)


def plan(model: ModelConfig, hardware: Hardware | str, devices: int, seq: int, global_batch: int,
         top: int = 10) -> tuple[list, int, int]:
    """(best estimates, candidates considered, candidates that were valid)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    check_modelled(model)
    if seq > model.max_seq:
        raise ConfigError(f"seq={seq} must be between 1 and the model's max_seq={model.max_seq}")
    max_tensor = min(hw.devices_per_node or 16, devices)
    considered = valid = 0
    results = []
    for sizes in candidate_meshes(devices, max_tensor, model.experts if model.moe_layers else 0):
        for options in candidate_options(sizes, global_batch):
            considered += 1
            name = "-".join(f"{a}{s}" for a, s in sizes.items() if s > 1) or "single"
            st = Strategy(name=name, mesh=tuple((a, sizes[a]) for a in AXES), options=options)
            try:
                validate.check(model, st, batch=global_batch, seq=seq)
            except ConfigError:
                continue
            valid += 1
            est = estimate(model, st, hw, global_batch, seq)
            if est.fits:
                results.append((est, st))
    results.sort(key=lambda r: -r[0].tokens_per_s)
    return results[:top], considered, valid


def describe(st: Strategy) -> str:
    o = st.options
    flags = [f"remat={o.remat}"] + ([f"accum={o.grad_accum}"] if o.grad_accum > 1 else [])
    if o.sequence_parallel:
        flags.append("sp")
    if st.size("context") > 1:
        flags.append(f"attention={o.attention}")
    if st.size("pipeline") > 1:
        flags.append(f"M={o.microbatches}")
    flags.append(f"zero={st.zero}")
    return f"{st.name} ({', '.join(flags)})"


def format_plan(results, considered: int, valid: int) -> str:
    lines = [f"{considered} candidates, {valid} valid, {len(results)} shown (fit in memory, fastest first)",
             f"{'#':>3}  {'strategy':<72} {'tokens/s':>12} {'MFU':>6} {'mem/dev':>9} {'dominant':>12}"]
    for i, (est, st) in enumerate(results, 1):
        lines.append(f"{i:>3}  {describe(st):<72} {est.tokens_per_s:>12,.0f} {est.mfu:>6.1%} "
                     f"{est.memory.total / 2**30:>7.1f}Gi {est.dominant:>12}")
    if not results:
        lines.append("nothing fits: more devices, a smaller batch or a shorter sequence")
    return "\n".join(lines)


def to_json(results, considered: int, valid: int) -> dict:
    return {"considered": considered, "valid": valid,
            "plans": [dict(est.to_json(), strategy=describe(st), options=dataclasses.asdict(st.options))
                      for est, st in results]}
