"""`jaxpar plan`: which strategy to rent for a model, a cluster and a batch.

Enumerates meshes over the six axes for N devices, with the options a practitioner would try for
each (ZeRO-3 on the fsdp axis, ZeRO-0 or ZeRO-1 on `data`, sequence parallelism whenever tensor > 1, remat none /
selective / full, ring attention when the sequence is split, pipeline micro-batches), drops those
that violate a constraint (jaxpar.core.validate.check, the same checks a run makes) or do not fit in
memory, and ranks the rest by the analytic model's tokens/s (jaxpar.cost.estimate).

Search space limits, stated: tensor parallelism stays inside a node (<= devices_per_node; TPU slices:
<= 16); the expert axis is searched for MoE models only (sizes that divide the expert count; it doubles as
a batch axis for the other layers); pipeline micro-batches M = 4 * stages or one sequence each, when the
batch allows it and M >= stages; schedules GPipe, 1F1B, circular and interleaved 1F1B (one unit per chunk); gradient
accumulation gives per-device micro-batches of 1, 2, 4 or the whole local batch; context parallelism
uses ring attention (all-gather and zigzag are not searched); tensor stays <= kv_heads (a run replicates
K/V heads beyond that, which the cost model does not count yet: cost.estimate.check_modelled_layout);
pipeline x context is not searched (`check_plannable` says why).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import pathlib

from jaxpar.core import validate
from jaxpar.cost import estimate, program_memory
from jaxpar.cost.estimate import check_modelled, check_modelled_layout
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost.software import JAXPAR, Software
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import AXES, OPTION_FIELDS, Options, Strategy, toml_value
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


def candidate_options(sizes: dict[str, int], global_batch: int, units: int = 1):
    """Remat policy x gradient accumulation (per-device micro-batch of 1, 2, 4 or all sequences) x ZeRO
    (0 or 1 on `data` without fsdp; padded flat shards where the size does not divide) x pipeline
    micro-batches (4 x stages, or one sequence each) x schedule: GPipe, 1F1B, and the circular and
    interleaved 1F1B schedules with one unit per chunk, v = units / stages (the smallest bubble, the most
    sends)."""
    stages = sizes["pipeline"]
    rows = global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"]) or 1
    # pipelines: M = 4 x stages, or one sequence per micro-batch (Megatron's usual), when >= stages
    micros = sorted({m for m in (4 * stages, rows) if m >= stages and rows % m == 0}) if stages > 1 else [1]
    zeros = (None, 1) if sizes["data"] > 1 and sizes["fsdp"] == 1 else (None,)
    schedules = [("gpipe", 1)] + ([("1f1b", 1)] if stages > 1 else [])
    if stages > 1 and units % stages == 0 and units // stages > 1:   # (interleaved 1F1B: M a multiple of S)
        schedules += [("circular", units // stages), ("1f1b", units // stages)]
    for micro in micros:
        local = rows // micro or 1
        accums = sorted({max(local // b, 1) for b in (1, 2, 4, local)})
        for remat, accum, zero, (kind, v) in itertools.product(("none", "dots_no_batch", "full"), accums, zeros,
                                                               schedules):
            yield Options(zero=zero, remat=remat, dtype="bfloat16", sequence_parallel=sizes["tensor"] > 1,
                          attention="ring" if sizes["context"] > 1 else "dense", microbatches=micro,
                          grad_accum=accum, pp_schedule=kind, pp_repeats=v)


OBJECTIVES = ("throughput", "energy")


def check_plannable(model: ModelConfig, st: Strategy, global_batch: int, seq: int) -> None:
    """What the planner (and the guide's studies, experiments/_study.py) rank: layouts a run takes
    (jaxpar.core.validate.check; ZeRO over sizes that do not divide as padded flat shards) that the cost model
    counts (jaxpar.cost.estimate.check_modelled_layout). Pipeline x context trains (loss and gradients
    equal one device) but is not planned: its compiled memory is above the model's (llama3-8b on 64 devices,
    TP8 PP4 CP2, seq 8k: 62 GiB per device compiled against 45 predicted, 1F1B 19 against 11), and its
    embedding output is resharded over pipeline x context by a collective-permute the model does not send."""
    validate.check(model, st, batch=global_batch, seq=seq, padded_zero=True)
    check_modelled_layout(model, st)
    if st.size("pipeline") > 1 and st.size("context") > 1:
        raise ConfigError(f"{st.name}: pipeline x context is not planned (its compiled memory is not modelled yet)")


def plan(model: ModelConfig, hardware: Hardware | str, devices: int, seq: int, global_batch: int,
         top: int = 10, software: Software = JAXPAR, objective: str = "throughput") -> tuple[list, int, int]:
    """(best estimates, candidates considered, candidates that were valid), each estimate for `software`,
    ranked by tokens/s (`throughput`) or by joules per token (`energy`: needs the profile's [power])."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}")
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    if objective == "energy" and not hw.tdp_w:
        raise ConfigError(f"--objective energy needs a power model: hardware {hw.name} has no [power] table "
                          "(tdp_w, idle_w; see jaxpar/cost/energy.py)")
    check_modelled(model)
    if seq > model.max_seq:
        raise ConfigError(f"seq={seq} must be between 1 and the model's max_seq={model.max_seq}")
    max_tensor = min(hw.devices_per_node or 16, devices)
    considered = valid = 0
    results = []
    for sizes in candidate_meshes(devices, max_tensor, model.experts if model.moe_layers else 0):
        for options in candidate_options(sizes, global_batch, model.units):
            considered += 1
            name = "-".join(f"{a}{s}" for a, s in sizes.items() if s > 1) or "single"
            st = Strategy(name=name, mesh=tuple((a, sizes[a]) for a in AXES), options=options)
            try:
                check_plannable(model, st, global_batch, seq)
            except ConfigError:
                continue
            valid += 1
            est = estimate(model, st, hw, global_batch, seq, software)
            if est.fits:
                results.append((est, st))
    if objective == "energy":
        results.sort(key=lambda r: (r[0].energy.joules_per_token, -r[0].tokens_per_s))
    else:
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
        kind = {"circular": "circular", "1f1b": "1F1B"}.get(o.pp_schedule)
        flags.append(f"M={o.microbatches}" + (f", {kind}" if kind else "") + (f" v={o.pp_repeats}" if o.pp_repeats > 1 else ""))
    flags.append(f"zero={st.zero}")
    return f"{st.name} ({', '.join(flags)})"


def why(est, runner_up, than: str = "the next") -> str:
    """One line: how much faster than `runner_up` (the next plan), and the two time terms that differ most."""
    if runner_up is None:
        return ""
    mine, theirs = est.time.terms(), runner_up.time.terms()
    diffs = sorted(((theirs[k] - mine[k], k) for k in mine), reverse=True)
    parts = [f"{k} {'-' if d > 0 else '+'}{abs(d) * 1e3:.0f} ms" for d, k in diffs[:2] if abs(d) >= 5e-4]
    gain = runner_up.step_time_s - est.step_time_s
    if gain < 1e-4 * est.step_time_s or not parts:
        return f"ties with {than}"
    return f"{gain * 1e3:.0f} ms/step ahead of {than}: " + ", ".join(parts)


def format_plan(results, considered: int, valid: int, software: str = "jaxpar", objective: str = "throughput") -> str:
    names = [describe(st) for _, st in results]
    width = max([len("strategy"), *map(len, names)])
    order = "fewest joules per token first" if objective == "energy" else "fastest first"
    lines = [f"{considered} candidates, {valid} valid, {len(results)} shown (fit in memory, {order}; "
             f"software {software})",
             f"{'#':>3}  {'strategy':<{width}} {'tokens/s':>12} {'MFU':>6} {'mem/dev':>9} {'J/token':>9} "
             f"{'dominant':>14}  why"]
    for i, ((est, st), name) in enumerate(zip(results, names), 1):
        nxt = results[i][0] if i < len(results) else None
        joules = f"{est.energy.joules_per_token:>9.3g}" if est.energy else f"{'-':>9}"
        lines.append(f"{i:>3}  {name:<{width}} {est.tokens_per_s:>12,.0f} {est.mfu:>6.1%} "
                     f"{est.memory.total / 2**30:>7.1f}Gi {joules} {est.dominant:>14}  {why(est, nxt)}")
    if not results:
        lines.append("nothing fits: more devices, a smaller batch or a shorter sequence")
    return "\n".join(lines)


def scores_note(model: ModelConfig, results, software: Software, global_batch: int, seq: int) -> str | None:
    """Why context or tensor parallelism may win in jaxpar's own program: its dense attention keeps each
    layer's [heads, s, s] scores, their exponentials and probabilities for the backward pass, so at long
    sequences a plain data-parallel layout fits only with rematerialisation, while splitting the scores
    (context splits the queries' rows under ring attention, tensor the heads) buys remat=none. Measured
    on the model: the top plan's options with every device on `fsdp`, one sequence per device per
    accumulation step and remat=none, with and without
    the score entries of the activation inventory (jaxpar.cost.program_memory.activation_bytes, score_keys=0)."""
    if not results or not software.jaxpar_program or not model.has_attention:
        return None
    est, st = results[0]
    split = st.size("context") * st.size("tensor")
    if split == 1:
        return None
    n = st.num_devices
    per_device = max(1, global_batch // n)   # one sequence per device per accumulation step: the least memory
    plain = Strategy(name=f"fsdp{n}", mesh=tuple((a, n if a == "fsdp" else 1) for a in AXES),
                     options=dataclasses.replace(st.options, zero=3, remat="none", sequence_parallel=False,
                                                 attention="dense", overlap="none", grad_accum=per_device))
    kept = program_memory.activation_bytes(model, plain, global_batch, seq)
    scores = kept - program_memory.activation_bytes(model, plain, global_batch, seq, score_keys=0)
    if scores < 0.5 * kept:
        return None
    gib = 2 ** 30
    return (f"note: jaxpar's dense attention keeps every layer's [heads, s, s] scores for the backward pass: "
            f"{scores / gib:.1f} of the {kept / gib:.1f} GiB of activations per device with all {n} devices on fsdp, "
            f"one sequence each at a time and remat=none (model state aside), so data-parallel layouts need "
            f"recomputation to fit; context and tensor parallelism split the scores (top plan: context x tensor = "
            f"{split}). A fused attention kernel (--software megatron-core) never stores them.")


def to_toml(st: Strategy, est) -> str:
    """A mesh_configs file for a plan: `train`, `comm` and `estimate` take it as --mesh PATH."""
    mesh = "\n".join(f"{a} = {n}" for a, n in st.mesh if n > 1) or "data = 1"
    options = [f"zero = {st.zero}"] + [f"{f.name} = {toml_value(getattr(st.options, f.name))}"
                                      for f in OPTION_FIELDS if f.name != "zero"
                                      and getattr(st.options, f.name) != getattr(Options(), f.name)]
    desc = (f"jaxpar plan: {describe(st)}; predicted {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}, "
            f"{est.memory.total / 2**30:.1f} GiB/device on {est.hardware}")
    return f'description = "{desc}"\n[mesh]\n{mesh}\n[options]\n' + "\n".join(options) + "\n"


def write_plans(results, directory) -> list:
    """Write each plan as DIR/plan-<rank>-<name>.toml; return the paths."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (est, st) in enumerate(results, 1):
        path = out / f"plan-{i:02d}-{st.name}.toml"
        path.write_text(to_toml(st, est))
        paths.append(path)
    return paths


def to_json(results, considered: int, valid: int) -> dict:
    return {"considered": considered, "valid": valid,
            "plans": [dict(est.to_json(), strategy=describe(st), options=dataclasses.asdict(st.options))
                      for est, st in results]}
