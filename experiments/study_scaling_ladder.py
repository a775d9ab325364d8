"""Study (a), the scaling ladder: when does each parallelism become necessary, and what does it cost?

    python experiments/study_scaling_ladder.py            # full: 3 models x 8..16,384 devices, ~2 min
    python experiments/study_scaling_ladder.py --quick    # llama3-70b / 405b on 64 and 8,192 H100, seconds

Question. Training Llama 3 8B / 70B / 405B on 8 to 16,384 accelerators, which rung of the ladder
plain DP -> + ZeRO (ZeRO-1 or FSDP) -> + TP inside a node -> + PP across nodes -> + CP is needed
(memory wall: nothing on the lower rungs fits; batch wall: the batch has fewer sequences than the
lower rungs need data-parallel ranks), and what does each rung buy in MFU?

Method. For each (model, hardware, sequence, devices) the planner's candidates (jaxpar/planning/planner.py:
every factorisation into data, fsdp, pipeline, context and tensor, with remat, gradient accumulation,
ZeRO stage, micro-batches and GPipe / 1F1B / interleaved schedules) are sorted into the lowest rung whose
axes they use; each rung's curve is the best fitting layout of that rung or any lower one (the rungs
are nested), ranked by the analytic model's tokens/s (jaxpar.cost.estimate). Tokens per step: 16M in
every sweep, Llama 3 405B's published batch (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4):
2,048 sequences of 8,192 tokens, or 128 of 131,072 (llama3.1-*).

Band. Every comparison uses the cost model's out-of-sample error band for megatron-core on the H100
family (jaxpar/cost/bands.toml, experiments/study_stacks.py): rungs or layouts closer than the band are
ties. The tpu-v5p curves are priced with the stack that runs there, MaxText (megatron-core is a CUDA program:
its preset prices no TPU), under MaxText's band on TPU v5p where published runs calibrate one.

Assumptions. Software megatron-core on H100 (fused attention; TP, DP and PP communication overlapped with
compute: jaxpar/cost/software.py), maxtext on TPU v5p. Tensor <= 8 on H100 (one NVLink node) and <= 16 on TPU v5p; data and
fsdp are not combined (no HSDP); pipeline <= 32 stages, context <= 32; pipeline x context where the planner
ranks it for megatron-core (jaxpar.planning.planner.check_plannable).

Published points (405B panels): Dubey et al. 2024, table 4: 8,192 H100 TP8 PP16 DP64 at 430 TFLOP/s per
GPU, 16,384 H100 TP8 PP16 DP128 at 400, and at seq 131,072 TP8 CP16 PP16 DP8 at 380 (MFU of the 989
TFLOP/s dense bf16 peak). Each is predicted in its own layout with megatron-core's preset and the options
the run used (section 3.3.2): interleaved 1F1B with one sequence per micro-batch (32, 16 and 16 per
data-parallel rank), the distributed optimizer (ZeRO-1), sequence parallelism, bf16, ring context
parallelism on the load-balanced layout; the paper names no recompute policy and no interleaving depth,
so each recompute level is priced (the layout's figure: the fastest that fits) at v = 7 chunks per stage
(126 layers over 16 stages). Writes experiments/results/study_scaling_ladder.md and .png.

Appendix, jaxpar's own program. The best layout for llama3-70b at seq 8,192 on 64, 512 and 2,048 H100
(quick: 64) is compiled from shapes on as many simulated CPU devices (jaxpar.planning.verify, what `plan
--verify` runs; the best layout of the highest rung jaxpar's program plans): its collectives are compared with the model's prediction for jaxpar's program on
XLA:CPU, per mesh-axis group, with the memory per device beside XLA's peak. This checks the structure
the curves rest on (which collectives a layout needs and how many bytes), not the megatron-core timing.
"""
from __future__ import annotations

import sys
import time

from jaxpar.devices import simulate_cpu_devices

CONFIRM = (64, 512, 2048)   # llama3-70b, h100-sxm, seq 8192: the best layout compiled at these sizes
QUICK_CONFIRM = (64,)
simulate_cpu_devices(max(QUICK_CONFIRM if "--quick" in sys.argv[1:] else CONFIRM))  # before JAX starts

from _study import OKABE_ITO, SHORT, arguments, band, band_line, finish, layout, md_table, pct, progress, search, versus

from jaxpar.core import validate
from jaxpar.core.strategy import AXES, parse_inline
from jaxpar.cost import MEGATRON_CORE, SOFTWARE, estimate, load_hardware
from jaxpar.cost.report import mfu_convention
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.planning import planner

STEM = "study_scaling_ladder"
RUNGS = ("DP", "+ZeRO", "+TP", "+PP", "+CP")
# (hardware, seq, global batch): 16M tokens per step; model names for that sequence length
SWEEPS = (("h100-sxm", 8192, 2048), ("h100-sxm", 131072, 128), ("tpu-v5p", 8192, 2048))
MODELS = {8192: ("llama3-8b", "llama3-70b", "llama3-405b"), 131072: ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")}
MAX_TENSOR = {"h100-sxm": 8, "tpu-v5p": 16}
STACK = {"h100-sxm": "megatron-core", "tpu-v5p": "maxtext"}   # the stack each machine runs (Software.platforms)
PEAK_H100 = 989e12
BAND = band("h100-sxm", "megatron-core")   # the share within which two H100 figures tie
TIE_FALLBACK = 0.01                         # where no published run calibrates the pair: 1%
# Dubey et al. 2024, table 4 (Llama 3 405B on H100): (seq, GPUs, mesh, TFLOP/s per GPU)
PUBLISHED = ((8192, 8192, dict(tensor=8, pipeline=16, data=64), 430e12),
             (8192, 16384, dict(tensor=8, pipeline=16, data=128), 400e12),
             (131072, 16384, dict(tensor=8, context=16, pipeline=16, data=8), 380e12))
TOKENS = 16 * 2**20                         # per step, table 4's batch
REMATS = ("none", "dots", "full")           # the recompute levels priced for a published layout
QUICK = dict(devices="64,8192", models="llama3-70b,llama3-405b", sweeps="h100-sxm:8192")


def rung(st) -> int:
    """The lowest rung whose axes the strategy uses."""
    s = st.sizes
    return (4 if s["context"] > 1 else 3 if s["pipeline"] > 1 else 2 if s["tensor"] > 1
            else 1 if st.zero in (1, 3) else 0)


def keep(sizes) -> bool:
    return (sizes["data"] == 1 or sizes["fsdp"] == 1) and sizes["pipeline"] <= 32 and sizes["context"] <= 32


def ladder(name: str, hw_name: str, seq: int, batch: int, devices: int) -> dict:
    """Cumulative best per rung: rung r's entry is the best of rungs 0..r ('OOM' or 'batch' if none)."""
    hw, model = load_hardware(hw_name), parse_model(name)
    found = search(model, hw, devices, seq, batch, SOFTWARE[STACK[hw_name]], keep=keep, key=rung,
                   max_tensor=min(MAX_TENSOR[hw_name], devices))
    out, best, valid = [], None, 0
    for r in range(len(RUNGS)):
        valid += found["valid"].get(r, 0)
        if r in found and (best is None or found[r][0].tokens_per_s > best[0].tokens_per_s):
            best = found[r]
        out.append(best if best else ("OOM" if valid else "batch"))
    return {"model": name, "hw": hw_name, "seq": seq, "batch": batch, "devices": devices, "rungs": out}


def as_published(seq: int, n: int, mesh: dict) -> dict:
    """A published 405B run in its own layout (module docstring: megatron-core, interleaved 1F1B v = units //
    stages, one sequence per micro-batch, ZeRO-1, SP, ring CP): {remat: estimate or why not}, checked as
    megatron-core runs it (validate.check, program=False)."""
    model = parse_model("llama3-405b" if seq == 8192 else "llama3.1-405b")
    batch, sizes = TOKENS // seq, {a: mesh.get(a, 1) for a in AXES}
    st = parse_inline(",".join(f"{a}={k}" for a, k in sizes.items() if k > 1))
    opts = dict(zero=1, sequence_parallel=True, pp_schedule="1f1b", pp_repeats=model.units // sizes["pipeline"],
                microbatches=batch // sizes["data"], dtype="bfloat16")
    opts |= dict(attention="ring", cp_layout="zigzag") if sizes["context"] > 1 else {}
    out = {}
    for remat in REMATS:
        run = st.with_options(**opts, remat=remat).resolved(n)
        try:
            validate.check(model, run, batch=batch, seq=seq, padded_zero=True, program=False)
        except ConfigError as e:
            out[remat] = str(e)
            continue
        out[remat] = estimate(model, run, load_hardware("h100-sxm"), batch, seq, MEGATRON_CORE)
    return out


def own_figure(priced: dict):
    """(remat, estimate) of the fastest recompute level that fits, or None."""
    fits = [(r, e) for r, e in priced.items() if not isinstance(e, str) and e.fits]
    return max(fits, key=lambda x: x[1].tokens_per_s, default=None)


def published(results) -> tuple[list[list], list]:
    """Each published row: its MFU, the model's for that very layout at each recompute level and its figure
    (the fastest that fits), the model's best layout of the sweep at that size, the comparisons within the
    band. Also (seq, GPUs, published MFU, the model's MFU for that layout) for the figure."""
    rows, points = [], []
    for seq, n, mesh, tflops in PUBLISHED:
        name = "llama3-405b" if seq == 8192 else "llama3.1-405b"
        pub = tflops / PEAK_H100
        priced = as_published(seq, n, mesh)
        levels = "; ".join(f"{r}: {'refused' if isinstance(e, str) else pct(e.mfu) + ('' if e.fits else ' OOM')} "
                           f"{'' if isinstance(e, str) else f'{e.memory.total / 2**30:.1f} GiB'}".strip()
                           for r, e in priced.items())
        own = own_figure(priced)
        best = next((r["rungs"][-1] for r in results if r["model"] == name and r["devices"] == n
                     and r["hw"] == "h100-sxm"), None)
        best = None if isinstance(best, str) else best
        points.append((seq, n, pub, own[1].mfu if own else None))
        rows.append([f"{seq:,}", f"{n:,}", " ".join(f"{SHORT[a]}{mesh[a]}" for a in reversed(AXES) if a in mesh),
                     pct(pub), levels, f"{pct(own[1].mfu)} ({own[0]})" if own else "nothing fits",
                     versus(own[1].mfu, pub, BAND) if own else "-",
                     "not run" if best is None else f"{pct(best[0].mfu)} ({layout(best[1])})",
                     versus(best[0].mfu, own[1].mfu, BAND) if best and own else "-",
                     versus(best[0].mfu, pub, BAND) if best else "-"])
    return rows, points


def compiled_layout(results, n: int):
    """The llama3-70b (seq 8,192, H100) layout compiled at `n` devices: the best of the highest rung whose
    layout jaxpar's own program plans (planner.check_plannable), or None."""
    model = parse_model("llama3-70b")
    entry = next((r for r in results if r["model"] == "llama3-70b" and r["devices"] == n and r["hw"] == "h100-sxm"
                  and r["seq"] == 8192), None) or ladder("llama3-70b", "h100-sxm", 8192, 2048, n)
    for best in reversed(entry["rungs"]):
        if isinstance(best, str):
            continue
        try:
            planner.check_plannable(model, best[1], 2048, 8192)
        except ConfigError:
            continue
        return best
    return None


def confirm(results, sizes) -> tuple[list[list], float]:
    """Compile the llama3-70b layout of `compiled_layout` at each size: rows of per-axis-group bytes, and the
    largest byte error (fraction) over all groups carrying at least 1% of a step's bytes."""
    import jax  # noqa: PLC0415  deferred: JAX starts after simulate_cpu_devices, and only for the compiles

    from jaxpar.planning.verify import verify_plan  # noqa: PLC0415  deferred: imports JAX
    rows, worst = [], 0.0
    model = parse_model("llama3-70b")
    for n in sizes:
        entry = compiled_layout(results, n)
        if entry is None:
            continue
        checks, report = verify_plan(model, entry[1], 2048, 8192, jax.devices()[:n])
        total = sum(c.compiled for c in checks if c.what.startswith("bytes"))
        for c in checks:
            big = c.what.startswith("bytes") and max(c.compiled, c.predicted) >= 0.01 * total
            worst = max(worst, abs(c.error)) if big else worst
            rows.append([f"{n:,}", layout(entry[1]), c.what, f"{c.predicted / 2**30:.3f}", f"{c.compiled / 2**30:.3f}",
                         "new" if c.error == float("inf") else f"{c.error:+.2%}"])
    return rows, worst


def cell(entry) -> str:
    return entry if isinstance(entry, str) else pct(entry[0].mfu)


def first(rows, test) -> int | None:
    return next((i for i, e in enumerate(rows["rungs"]) if test(e)), None)


def tie_share(hw: str) -> float:
    """The band of the stack `hw` runs on its family (experiments/_study.py), 1% where none calibrates it."""
    return band(hw, STACK[hw]) or TIE_FALLBACK


def summary(r) -> list:
    """One table row: MFU per rung, the rung where it first fits and the rung that wins (the first whose
    tokens/s ties the best within the band: past it, a rung buys nothing the model can tell apart)."""
    rungs = r["rungs"]
    fits = first(r, lambda e: not isinstance(e, str))
    if fits is None:
        return [r["model"], r["hw"], f"{r['seq']:,}", f"{r['devices']:,}", *map(cell, rungs), "-", "-", "nothing fits", "-"]
    top, share = rungs[-1][0].tokens_per_s, tie_share(r["hw"])
    wins = first(r, lambda e: not isinstance(e, str) and e[0].tokens_per_s >= top * (1 - share))
    est, st = rungs[-1]
    return [r["model"], r["hw"], f"{r['seq']:,}", f"{r['devices']:,}", *map(cell, rungs), RUNGS[fits], RUNGS[wins],
            layout(st), f"{est.memory.total / 2**30:.1f}"]


def ticks(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def published_points(ax, points) -> None:
    """Each published run (black star) beside the model's figure for that same layout (open diamond, the
    band as its error bar), joined by a thin line: how far the model falls from that run."""
    for seq, n, pub, own in points:
        ax.scatter([n], [pub], marker="*", s=150, color="black", zorder=6,
                   label="published (Llama 3 405B, Dubey et al. 2024, table 4)")
        if own is not None:
            ax.errorbar([n * 1.12], [own], yerr=[[own * BAND], [own * BAND]], fmt="D", mfc="white", mec="black",
                        ecolor="black", ms=6, capsize=2, zorder=6,
                        label=f"model, that published layout (megatron-core; ±{BAND:.1%} band)")
            ax.plot([n, n * 1.12], [pub, own], color="black", lw=0.6, zorder=5)


def figure(plt, results, sweeps, models_by_seq, devices, points):
    styles = [("o", ":"), ("s", "--"), ("^", "-."), ("D", "-"), ("v", "-")]
    fig, axes = plt.subplots(len(sweeps), 3, figsize=(11, 2.8 * len(sweeps) + 0.9), squeeze=False, sharex=True,
                             sharey="row")
    for i, (hw, seq, batch) in enumerate(sweeps):
        for j, name in enumerate(models_by_seq[seq]):
            ax = axes[i][j]
            rows = [r for r in results if (r["hw"], r["seq"], r["model"]) == (hw, seq, name)]
            for k, label in enumerate(RUNGS):
                pts = [(r["devices"], r["rungs"][k][0].mfu) for r in rows if not isinstance(r["rungs"][k], str)]
                if pts:
                    marker, ls = styles[k]
                    ax.plot(*zip(*pts), marker=marker, ls=ls, color=OKABE_ITO[k], label=f"up to {label}",
                            ms=3 + 1.5 * (len(RUNGS) - k), lw=1.2, alpha=0.9)
            for r in rows:  # why a rung's curve is missing: nothing fits anywhere / the batch is too small
                if all(isinstance(e, str) for e in r["rungs"]):
                    ax.text(r["devices"], 0.03, "OOM", ha="center", fontsize=7, color="0.4", rotation=90)
            if hw == "h100-sxm" and name.endswith("405b"):
                published_points(ax, [p for p in points if p[0] == seq and p[1] in devices])
            ax.set_xscale("log", base=2)
            ax.set_xticks(devices, [ticks(n) for n in devices])
            ax.minorticks_off()
            ax.set_title(f"{name} on {hw}, seq {seq:,}" + (" (uncalibrated)" if hw == "tpu-v5p" else ""), fontsize=9)
            top = max((e[0].mfu for r in results if (r["hw"], r["seq"]) == (hw, seq)
                       for e in r["rungs"] if not isinstance(e, str)), default=0.0)
            ax.set_ylim(0, max(0.75, 1.08 * top))
            if j == 0:
                ax.set_ylabel("predicted MFU (fraction of peak)")
            if i == len(sweeps) - 1:
                ax.set_xlabel("devices (16M tokens per step)")
    for k, label in enumerate(RUNGS):  # a rung that fits nowhere still gets its legend entry
        if all(isinstance(r["rungs"][k], str) for r in results):
            axes[0][0].plot([], [], marker=styles[k][0], ls=styles[k][1], color=OKABE_ITO[k], label=f"{label}: fits nowhere")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h), labels.append(lab)
    fig.suptitle("The scaling ladder: best MFU using the parallelisms up to each rung (a curve starts where its "
                 f"rung first fits)\nmegatron-core, 16M tokens per step; H100 band ±{BAND:.1%}", fontsize=10)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if len(sweeps) == 1 else 0.05, 1, 0.97))
    return fig


def main() -> None:
    args = arguments(__doc__, QUICK, devices=(str, "8,32,128,512,2048,8192,16384", "device counts, comma-separated"),
                     models=(str, "", "restrict to these models (comma-separated; default all)"),
                     sweeps=(str, "", "restrict to hardware:seq pairs, e.g. h100-sxm:8192 (default all)"))
    devices = [int(d) for d in args.devices.split(",")]
    sizes = QUICK_CONFIRM if args.quick else CONFIRM
    sweeps = [s for s in SWEEPS if not args.sweeps or f"{s[0]}:{s[1]}" in args.sweeps.split(",")]
    wanted = set(args.models.split(",")) if args.models else None
    models_by_seq = {seq: [m for m in names if wanted is None or m in wanted] for seq, names in MODELS.items()}
    work = [(m, hw, seq, batch, n) for hw, seq, batch in sweeps for m in models_by_seq[seq] for n in devices]
    t0, results = time.perf_counter(), []
    with progress(len(work), "cell") as bar:
        for m, hw, seq, batch, n in work:
            bar.set_description(f"{m} {hw} {n}")
            results.append(ladder(m, hw, seq, batch, n))
            bar.update()
    pub_rows, points = published(results)
    body = head(results) + [*md_table(["model", "hardware", "seq", "devices", *RUNGS, "fits from", "wins from",
                                       "best layout", "GiB/device"], [summary(r) for r in results]), "",
            "## Published (Dubey et al. 2024, table 4: Llama 3 405B on H100, 16M tokens per step), each in its own layout",
            "", "The model's figure for the published layout: megatron-core's preset with the run's own options "
            "(interleaved 1F1B, v = 7, one sequence per micro-batch, ZeRO-1, SP, bf16; module docstring) at each "
            "recompute level (`OOM`: the model's memory exceeds 80 GB), the fastest that fits; `versus` within "
            f"the band ±{BAND:.1%}.", "",
            *md_table(["seq", "GPUs", "layout", "published MFU", "model, that layout, per recompute",
                       "model, that layout", "model vs published", "model's best layout of the sweep",
                       "best vs that layout (model)", "best vs published"], pub_rows), ""]
    t1 = time.perf_counter()
    rows, worst = confirm(results, sizes)
    body += ["## APPENDIX: jaxpar's own program: the compiled confirmation (llama3-70b, seq 8,192, the best layout "
             "at each size)", "",
             "jaxpar's program for that layout compiled from shapes on as many simulated CPU devices "
             "(jaxpar.planning.verify), bytes per device per step by mesh-axis group (GiB), the model's prediction "
             "for jaxpar's program on XLA:CPU beside the compiled count; memory: the model's jaxpar-program figure "
             "beside XLA's peak. A finding about jaxpar's program, not about the hardware.", "",
             *md_table(["devices", "layout", "what", "predicted", "compiled", "error"], rows), "",
             f"largest byte error over groups with >= 1% of the bytes: {worst:.2%}", "",
             f"{len(work)} cells in {t1 - t0:.1f} s; {len(sizes)} compiles in {time.perf_counter() - t1:.1f} s"]
    finish(args, STEM, "Study (a): the scaling ladder", body,
           lambda plt: figure(plt, results, sweeps, models_by_seq, devices, points))


def head(results) -> list[str]:
    """The results file's conventions: the band, tokens per step, MFU, what the table's words mean."""
    est = next(r["rungs"][-1][0] for r in results if not isinstance(r["rungs"][-1], str))
    return [band_line("h100-sxm", "megatron-core"), "",
            "tpu-v5p: " + band_line("tpu-v5p", STACK["tpu-v5p"]) + f" `wins from` there uses {TIE_FALLBACK:.0%} "
            "where no run calibrates it.", "",
            f"Tokens per step: {TOKENS // 2**20}M in every sweep ({TOKENS:,}: 2,048 sequences of 8,192 or 128 of "
            "131,072), Llama 3 405B's published batch (Dubey et al. 2024, table 4), so that its published runs "
            "sit on the same axes.", "", mfu_convention(est) + "; the published MFU is table 4's TFLOP/s per GPU "
            "over the 989 TFLOP/s dense bf16 peak.", "",
            "MFU of the best fitting layout allowed up to each rung (rungs are nested: `+TP` may also use ZeRO). "
            "`OOM`: valid layouts exist on these rungs, none fits in memory (the memory wall); `batch`: none is valid, "
            "the batch has too few sequences for that many data-parallel ranks (the batch wall). `wins from`: the "
            "first rung whose tokens/s ties the best within the band. Software megatron-core on H100, maxtext on TPU v5p.", ""]


if __name__ == "__main__":
    main()
