"""`jaxpar plan`: which strategy to rent for a model, a cluster and a batch.

Enumerates meshes over the six axes for N devices, with the options a practitioner would try for
each (ZeRO-3 on the fsdp axis, ZeRO-0 or ZeRO-1 on `data`, sequence parallelism whenever tensor > 1, remat none /
selective / full, ring attention when the sequence is split, pipeline micro-batches), drops those
that violate a constraint (jaxpar.core.validate.check, the same checks a run makes) or do not fit in
memory, and ranks the rest by the analytic model's tokens/s (jaxpar.cost.estimate).

Search space limits, stated: tensor parallelism stays inside a node (<= devices_per_node; TPU slices:
<= 16); the expert axis is searched for MoE models only (sizes that divide the expert count; it doubles as
a batch axis for the other layers); pipeline micro-batches M = 4 * stages or one sequence each, when the
batch allows it and M >= stages; schedules GPipe, 1F1B, circular and interleaved 1F1B
(`interleaved_repeats`); gradient accumulation gives per-device micro-batches of 1, 2, 4 or the whole local batch; context parallelism
uses ring attention (all-gather and zigzag are not searched); tensor stays <= kv_heads (a run replicates
K/V heads beyond that, which the cost model does not count yet: cost.estimate.check_modelled_layout);
pipeline x context is not searched for jaxpar's own program (`check_plannable` says why).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import pathlib

from jaxpar.core import validate
from jaxpar.cost import estimate, program_memory
from jaxpar.cost.estimate import HBM_HEADROOM, check_modelled, check_modelled_layout
from jaxpar.cost.defaults import priced_zero
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost import band
from jaxpar.cost.report import mfu_convention
from jaxpar.cost.software import JAXPAR, SOFTWARE, Software, check_platform, mesh_refusal
from jaxpar.errors import ConfigError
from jaxpar.planning.question import Question, written
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


def candidate_options(sizes: dict[str, int], global_batch: int, units: int = 1, dtype: str = "bfloat16",
                      software: Software = JAXPAR, grad_dtype: str = "float32"):
    """What `software` runs (Software.remats, pp_schedules, pp_interleaved): its remat policies x gradient
    accumulation (per-device micro-batch of 1, 2, 4 or all sequences) x ZeRO (0, or 1 on `data` without
    fsdp where it runs ZeRO-1, Software.zeros; padded flat shards where the size does not divide) x pipeline micro-batches (4 x stages, or one
    sequence each) x its schedules with one chunk per stage, and its interleaved ones with the most chunks
    per stage that split the units evenly or nearly (`interleaved_repeats`: the smallest bubble, the most
    sends); another stack's tensor parallelism as
    collective matmuls where it runs them on request (Software.async_tp without a standing tp_overlap:
    torchtitan's async TP, MaxText's collective matmul)."""
    stages = sizes["pipeline"]
    rows = global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"]) or 1
    # pipelines: M = 4 x stages, or one sequence per micro-batch (Megatron's usual), when >= stages
    micros = sorted({m for m in (4 * stages, rows) if m >= stages and rows % m == 0}) if stages > 1 else [1]
    zeros = (None, 1) if sizes["data"] > 1 and sizes["fsdp"] == 1 and 1 in software.zeros else (None,)
    schedules = [(kind, 1) for kind in software.pp_schedules] if stages > 1 else [("gpipe", 1)]
    if stages > 1 and (v := interleaved_repeats(units, stages)):   # (interleaved 1F1B: M a multiple of S)
        schedules += [(kind, v) for kind in software.pp_interleaved]
    overlap = ("collective_matmul" if sizes["tensor"] > 1 and software.async_tp and not software.tp_overlap
               and not software.jaxpar_program else "none")   # Megatron-Core overlaps its TP whatever the option
    for micro in micros:
        local = rows // micro or 1
        accums = sorted({max(local // b, 1) for b in (1, 2, 4, local)})
        for remat, accum, zero, (kind, v) in itertools.product(software.remats, accums, zeros, schedules):
            yield Options(zero=zero, remat=remat, dtype=dtype, grad_dtype=grad_dtype, sequence_parallel=sizes["tensor"] > 1,
                          attention="ring" if sizes["context"] > 1 else "dense", attention_kernel="auto",
                          microbatches=micro, grad_accum=accum, pp_schedule=kind, pp_repeats=v, overlap=overlap)


def interleaved_repeats(units: int, stages: int) -> int:
    """The most chunks per stage, v > 1, whose S*v chunks take the units evenly or with at most the first
    and last chunk one unit lighter (jaxpar/core/schedule.py default_split): one unit per chunk where S
    divides the units; Llama 3 405B's 126 layers on 8 stages in 64 chunks of 2, the ends of 1
    (Megatron-Bridge's 405B recipe: PP8 VP8; Dubey et al. 2024, 3.3.2, the ends one layer lighter).
    0: none."""
    for v in range(units // stages, 1, -1):
        if stages * v * -(-units // (stages * v)) - units <= 2:
            return v
    return 0


def runs(software: Software, sizes: dict[str, int]) -> bool:
    """Whether `software` runs a mesh of `sizes` (jaxpar.cost.software.mesh_refusal: its axes, FSDP inside
    pipeline stages only where it shards them so); candidate_options gives only the options it runs."""
    return not mesh_refusal(software, sizes)


OBJECTIVES = ("throughput", "energy")


def check_plannable(model: ModelConfig, st: Strategy, global_batch: int, seq: int, program: bool = True) -> None:
    """What the planner (and the guide's studies, experiments/_study.py) rank: layouts a run takes
    (jaxpar.core.validate.check; ZeRO over sizes that do not divide as padded flat shards) that the cost model
    counts (jaxpar.cost.estimate.check_modelled_layout). `program`: the layout is for jaxpar's own program, whose
    constraints apply; another stack's (Megatron-Core runs Llama 3's TP8 CP16 PP16) is checked as that stack
    runs it. jaxpar's pipeline x context trains (loss and gradients equal one device) but is not planned: its
    compiled memory is above the model's (llama3-8b on 64 devices, TP8 PP4 CP2, seq 8k: 62 GiB per device
    compiled against 45 predicted, 1F1B 19 against 11), and its embedding output is resharded over pipeline x
    context by a collective-permute the model does not send."""
    validate.check(model, st, batch=global_batch, seq=seq, padded_zero=True, program=program)
    check_modelled_layout(model, st)
    if program and st.size("pipeline") > 1 and st.size("context") > 1:
        raise ConfigError(f"{st.name}: pipeline x context is not planned (its compiled memory is not modelled yet)")


def plan(model: ModelConfig, hardware: Hardware | str, devices: int, seq: int, global_batch: int,  # many parameters: the planner's public question, each a `plan` flag
         top: int = 10, software: Software = JAXPAR, objective: str = "throughput",
         headroom: float = HBM_HEADROOM, dtype: str = "bfloat16",
         grad_dtype: str = "float32", misses: Misses | None = None) -> tuple[list, int, int]:
    """(best estimates, candidates considered, candidates that were valid), each estimate for `software`,
    ranked by step time (`throughput`) or by joules per token (`energy`: needs the profile's [power]), best
    first, ties marked and not reordered (`rank`, `tie_spans`). A plan fits within HBM less the `headroom` share
    (jaxpar.cost.estimate.HBM_HEADROOM). Every candidate computes in `dtype` and reduces its gradients in
    `grad_dtype`. `misses`, if given, collects why candidates failed (`nothing_fits`)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}")
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    if objective == "energy" and not hw.tdp_w:
        raise ConfigError(f"--objective energy needs a power model: hardware {hw.name} has no [power] table "
                          "(tdp_w, idle_w; see jaxpar/cost/energy.py)")
    check_modelled(model)
    check_platform(software, hw)
    if software.jaxpar_program:
        validate.check_program_dtype(dtype, grad_dtype)
    if dtype == "float8":
        hw.matmul_peak(dtype)   # refused where the profile states no float8 peak
    if seq > model.max_seq:
        raise ConfigError(f"seq={seq} must be between 1 and the model's max_seq={model.max_seq}")
    max_tensor = min(hw.devices_per_node or 16, devices)
    considered = valid = 0
    results = []
    for sizes in candidate_meshes(devices, max_tensor, model.experts if model.moe_layers else 0):
        if not runs(software, sizes):
            continue
        for options in candidate_options(sizes, global_batch, model.units, dtype, software, grad_dtype):
            considered += 1
            name = "-".join(f"{a}{s}" for a, s in sizes.items() if s > 1) or "single"
            st = Strategy(name=name, mesh=tuple((a, sizes[a]) for a in AXES), options=options)
            try:
                check_plannable(model, st, global_batch, seq, software.jaxpar_program)
            except ConfigError as e:
                if misses is not None:
                    misses.refused[str(e)] += 1
                continue
            valid += 1
            est = estimate(model, st, hw, global_batch, seq, software, headroom=headroom)
            if est.fits:
                results.append((est, st))
            elif misses is not None and (misses.least is None or est.memory.total < misses.least[0].memory.total):
                misses.least = (est, st)
    return rank(results, objective)[:top], considered, valid


@dataclasses.dataclass
class Misses:
    """Why `plan`'s candidates failed: each refusal's text with its count, and the valid plan that needs
    the least memory (which still did not fit)."""
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    least: tuple | None = None  # (estimate, strategy)


def nothing_fits(misses: Misses, considered: int, valid: int) -> str:
    """The one line `plan` answers with when no candidate fits: the binding constraint, with its values."""
    if valid == 0:
        reason, count = misses.refused.most_common(1)[0] if misses.refused else ("no layout", 0)
        return (f"nothing fits: none of the {considered} candidate layouts is valid (divisibility or batch); the most "
                f"common reason ({count} of them): {reason}")
    est, st = misses.least
    line = (f"nothing fits: memory: the {valid} valid layouts need at least {est.memory.total / 2**30:.1f} GiB per "
            f"device ({st.name}), over the {est.usable_bytes / 2**30:.1f} GiB limit; more devices, a smaller "
            "batch or a shorter sequence")
    if misses.refused and valid * 2 < considered:   # divisibility bound the search first
        reason, count = misses.refused.most_common(1)[0]
        line += (f"; {considered - valid} of {considered} candidates were not valid (the most common reason, "
                 f"{count} of them: {reason})")
    return line


# Plans whose scores (step time, or joules per token) differ by less than this share are ties: the analytic
# model is not that precise, so the plan says so (`tie #i-#j`) and leaves the ranking fastest first; the
# `free` column shows which of them has more headroom. `tie_band` is the one place that reads it, where no
# published run calibrates the stack and hardware.
TIE_BAND = 0.005


def tie_band(est) -> float:
    """The relative band within which a plan ties with `est`: where published runs of its stack on its
    hardware family calibrate the model, the paired band's 90th percentile (band.paired_band: how far the
    model's ratio of two published layouts' speeds fell from the published ratio; the error of a difference,
    not the absolute error), else their out-of-sample median error (band.Band.guide) where too few pairs are
    published; TIE_BAND where no published run calibrates the pair (jaxpar's own program)."""
    b, paired = band.band_for(est.family, est.software), band.paired_band()
    if b is None:
        return TIE_BAND
    return max(TIE_BAND, paired.high if paired.high is not None else b.guide())


def score(est, objective: str = "throughput") -> float:
    """What the ranking minimises: seconds per step, or joules per token."""
    return est.energy.joules_per_token if objective == "energy" else est.step_time_s


def axes_used(st: Strategy) -> int:
    return sum(1 for _, n in st.mesh if n > 1)


def rank(results: list, objective: str = "throughput") -> list:
    """(estimate, strategy) pairs best score first, as the header says; equal scores by the most free memory,
    then by fewer mesh axes > 1. A tie (`tie_spans`) is marked, never reordered."""
    return sorted(results, key=lambda r: (score(r[0], objective), r[0].memory.total - r[0].usable_bytes,
                                          axes_used(r[1])))


def tie_spans(results: list, objective: str = "throughput") -> list[tuple[int, int]]:
    """For each row of a `rank`ed list, the (first, last) rows of its tie group (itself alone when untied):
    the rows within `tie_band` of the score of the group's first row, the best of them."""
    spans: list[tuple[int, int]] = []
    while len(spans) < len(results):
        first = last = len(spans)
        best = results[first][0]
        limit = score(best, objective) * (1.0 + tie_band(best))
        while last + 1 < len(results) and score(results[last + 1][0], objective) <= limit:
            last += 1
        spans += [(first, last)] * (last - first + 1)
    return spans


def recomputed(st: Strategy, est) -> str:
    """What a step recomputes beyond its remat policy, as the cost model counts it ('' when nothing or
    nothing more): jaxpar's 1F1B reruns each chunk's forward from the stashed input (`1F1B-chunks`) and
    its pipelines' stage vmap recomputes `dots_no_batch` as `full` (`full-in-stages`; both
    jaxpar/cost/program_flops.py); ring attention and a fused attention kernel recompute QK^T in the
    backward pass (`QK^T`; jaxpar/cost/flops.py)."""
    if not est.flops.recompute:
        return ""
    o, sw = st.options, SOFTWARE.get(est.software, JAXPAR)
    own, pipelined = sw.jaxpar_program, st.size("pipeline") > 1
    parts = []
    if own and pipelined and o.pp_schedule == "1f1b":
        parts.append("1F1B-chunks")
    if own and pipelined and o.remat == "dots_no_batch":
        parts.append("full-in-stages")
    fused = sw.fused_attention or (own and o.attention_kernel != "dense")
    if (o.attention == "ring" and st.size("context") > 1) or fused:
        parts.append("QK^T")
    return "+".join(parts)


RECOMPUTE_NOTE = ("remat=P+X: policy P, and X recomputed beyond it (1F1B-chunks: jaxpar's 1F1B reruns each chunk's "
                  "forward; full-in-stages: dots_no_batch recomputes as full inside a pipeline's stages; QK^T: ring "
                  "attention or a fused kernel recompute the scores in the backward pass)")


def remat_label(st: Strategy, est=None) -> str:
    """`remat=P`, or `remat=P+X` where the step recomputes X beyond policy P (`recomputed`; RECOMPUTE_NOTE)."""
    extra = recomputed(st, est) if est is not None else ""
    return f"remat={st.options.remat}" + (f"+{extra}" if extra else "")


def priced(st: Strategy, est=None) -> int:
    """The ZeRO stage `est` was priced with (jaxpar.cost.defaults.priced_zero: 3 over fsdp x context where
    the stack's FSDP spans the context ranks), or the strategy's without an estimate."""
    return st.zero if est is None else priced_zero(st, SOFTWARE[est.software])[0]


def describe(st: Strategy, est=None) -> str:
    """The plan in one line: mesh name and the options that differ between plans (what it recomputes
    beyond the remat policy when `est` is given: `remat_label`)."""
    o = st.options
    flags = [remat_label(st, est)] + ([f"accum={o.grad_accum}"] if o.grad_accum > 1 else [])
    if o.sequence_parallel:
        flags.append("sp")
    if st.size("context") > 1:
        flags.append(f"attention={o.attention}")
    if st.size("pipeline") > 1:
        kind = {"circular": "circular", "1f1b": "1F1B"}.get(o.pp_schedule)
        flags.append(f"M={o.microbatches}" + (f", {kind}" if kind else "") + (f" v={o.pp_repeats}" if o.pp_repeats > 1 else ""))
    flags.append(f"zero={priced(st, est)}")
    return f"{st.name} ({', '.join(flags)})"


def why(est, runner_up, than: str = "the next") -> str:
    """One line: how much faster than `runner_up` (the next plan), and the two time terms that differ
    most; a tie within `tie_band`."""
    if runner_up is None:
        return ""
    mine, theirs = est.time.terms(), runner_up.time.terms()
    diffs = sorted(((theirs[k] - mine[k], k) for k in mine), reverse=True)
    parts = [f"{k} {'-' if d > 0 else '+'}{abs(d) * 1e3:.0f} ms" for d, k in diffs[:2] if abs(d) >= 5e-4]
    gain = runner_up.step_time_s - est.step_time_s
    if abs(gain) <= tie_band(est) * est.step_time_s:
        return f"ties with {than} (within {tie_band(est):.1%})"
    if gain < 0:
        return f"{-gain * 1e3:,.0f} ms/step behind {than}"
    return f"{gain * 1e3:,.0f} ms/step ahead of {than}" + (": " + ", ".join(parts) if parts else "")


def row_why(results: list, spans: list[tuple[int, int]], i: int, objective: str) -> str:
    """The `why` cell of row i: its tie group, or how far it is ahead of the best of the next group."""
    first, last = spans[i]
    if last > first:
        return f"tie #{first + 1}-#{last + 1}"
    if last + 1 >= len(results):
        return ""
    return why(results[i][0], results[last + 1][0])


def format_plan(results, considered: int, valid: int, software: str = "jaxpar", objective: str = "throughput") -> str:
    """The ranked plans as a table, with the fit rule above it and what a tie and a label mean below."""
    names = [describe(st, est) for est, st in results]
    width = max([len("strategy"), *map(len, names)])
    order = "fewest joules per token first" if objective == "energy" else "fastest first"
    fit = (f"fit in {1 - results[0][0].headroom:.0%} of HBM" if results else "fit in memory")
    lines = [f"{considered} candidates, {valid} valid, {len(results)} shown ({fit}, {order}; "
             f"software {software})",
             f"{'#':>3}  {'strategy':<{width}} {'tokens/s':>12} {'MFU':>6} {'mem/dev':>9} {'free':>8} {'J/token':>9} "
             f"{'dominant':>14}  why"]
    spans = tie_spans(results, objective)
    for i, ((est, st), name) in enumerate(zip(results, names)):
        joules = f"{est.energy.joules_per_token:>9.3g}" if est.energy else f"{'-':>9}"
        free = (est.usable_bytes - est.memory.total) / 2**30
        lines.append(f"{i + 1:>3}  {name:<{width}} {est.tokens_per_s:>12,.0f} {est.mfu:>6.1%} "
                     f"{est.memory.total / 2**30:>7.1f}Gi {free:>6.1f}Gi {joules} {est.dominant:>14}  "
                     f"{row_why(results, spans, i, objective)}")
    if not results:
        lines.append("nothing fits: more devices, a smaller batch or a shorter sequence")
    if any(a < b for a, b in spans):
        what = "joules per token" if objective == "energy" else "step times"
        lines.append(f"tie: {what} within {tie_band(results[0][0]):.1%} of the group's first, the best of them (the cost "
                     "model is not that precise); still listed best first: `free` says which has more headroom")
    if any("+" in n.split("remat=", 1)[1].split(",", 1)[0] for n in names):
        lines.append(RECOMPUTE_NOTE)
    if results:
        lines += [mfu_convention(results[0][0]), band.describe(results[0][0].family, software),
                  f"#1's {band.regime_band(results[0][0].regime).describe()}"]
        if band.band_for(results[0][0].family, software) is not None:
            lines.append(f"ties: the {band.paired_band().describe()}")
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
    if st.options.attention_kernel != "dense":   # a fused kernel (auto never resolves to dense) keeps no scores
        return None
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
    zero = priced(st, est)   # a stage the stack decides stays unset, so that reading the file back prices it again
    first = (f"zero = {st.zero}" if zero == st.zero
             else f"# zero = {zero} over fsdp x context: {est.software}'s FSDP spans the context ranks")
    options = [first] + [f"{f.name} = {toml_value(getattr(st.options, f.name))}"
                                      for f in OPTION_FIELDS if f.name != "zero"
                                      and getattr(st.options, f.name) != getattr(Options(), f.name)]
    desc = (f"jaxpar plan: {describe(st, est)}; predicted {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}, "
            f"{est.memory.total / 2**30:.1f} GiB/device on {est.hardware}")
    return f'description = "{desc}"\n[mesh]\n{mesh}\n[options]\n' + "\n".join(options) + "\n"


def write_plans(results, directory, question: Question | None = None) -> list:
    """Write each plan as DIR/plan-<rank>-<name>.toml (the strategy) and, given the `question`, beside it
    DIR/plan-<rank>-<name>.run.toml (the question, naming the mesh file: `estimate --run`); return the
    mesh files' paths."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (est, st) in enumerate(results, 1):
        path = out / f"plan-{i:02d}-{st.name}.toml"
        path.write_text(to_toml(st, est))
        if question is not None:
            path.with_suffix(".run.toml").write_text(written(question).to_toml(path.name))
        paths.append(path)
    return paths


def to_json(results, considered: int, valid: int, objective: str = "throughput") -> dict:
    """`plan --json`: each plan's estimate, strategy, options and `tie`, the ranks of its tie group."""
    spans = tie_spans(results, objective)
    return {"considered": considered, "valid": valid,
            "plans": [dict(est.to_json(), strategy=describe(st, est), options=dataclasses.asdict(st.options),
                           tie=[first + 1, last + 1]) for (est, st), (first, last) in zip(results, spans)]}
