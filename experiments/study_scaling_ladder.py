"""Study (a), the scaling ladder: when does each parallelism become necessary, and what does it cost?

    python experiments/study_scaling_ladder.py            # full: 3 models x 8..16,384 devices, ~1 min
    python experiments/study_scaling_ladder.py --quick    # llama3-70b / 405b on 64 and 8,192 H100, seconds

Question. Training Llama 3 8B / 70B / 405B on 8 to 16,384 accelerators, which rung of the ladder
plain DP -> + ZeRO (ZeRO-1 or FSDP) -> + TP inside a node -> + PP across nodes -> + CP is needed
(memory wall: nothing on the lower rungs fits; batch wall: the batch has fewer sequences than the
lower rungs need data-parallel ranks), and what does each rung buy in MFU?

Method. For each (model, hardware, sequence, devices) the planner's candidates (jaxpar/planning/planner.py:
every factorisation into data, fsdp, pipeline, context and tensor, with remat, gradient accumulation,
ZeRO stage, micro-batches and GPipe / 1F1B / interleaved schedules) are sorted into the lowest rung whose
axes they use; each rung's curve is the best fitting layout of that rung or any lower one (the rungs
are nested), ranked by the analytic model's tokens/s (jaxpar.cost.estimate). Sweeps: seq 8,192 with
2,048 sequences per step and seq 131,072 (llama3.1-*) with 128 sequences: 16M tokens per step in
both, as Llama 3 405B trained (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2).

Assumptions. Software megatron-core (fused attention; TP, DP and PP communication overlapped with
compute: jaxpar/cost/software.py) on both devices. h100-sxm is calibrated on the Megatron-Core H100
rows (tests/test_cost_published.py); tpu-v5p is NOT calibrated (its efficiencies are copied from the
A100: read its curves as shapes, not values). Tensor <= 8 on H100 (one NVLink node) and <= 16 on TPU
v5p; data and fsdp are not combined (no HSDP); pipeline <= 32 stages, context <= 32; pipeline x context
is not planned (it trains, but its compiled memory is not modelled yet: jaxpar.planning.planner.check_plannable),
so the +CP rung here never has PP, unlike Llama 3's long-context layout (TP8 CP16 PP16).

Published points (405B panels): Dubey et al. 2024, table 4: 8,192 H100 TP8 PP16 DP64 at 430 TFLOP/s
per GPU, 16,384 H100 TP8 PP16 DP128 at 400, and at seq 131,072 TP8 CP16 PP16 DP8 at 380 (MFU of the
989 TFLOP/s dense bf16 peak). Writes experiments/results/study_scaling_ladder.md and .png.

Compiled confirmation. The best layout for llama3-70b at seq 8,192 on 64, 512 and 2,048 H100 (quick: 64)
is compiled from shapes on as many simulated CPU devices (jaxpar.planning.verify, what `plan --verify` runs):
jaxpar's own program, so its collectives are compared with the model's prediction for that program on
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

from _study import OKABE_ITO, SHORT, arguments, finish, layout, md_table, pct, progress, search

from jaxpar.cost import MEGATRON_CORE, load_hardware
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import AXES

STEM = "study_scaling_ladder"
RUNGS = ("DP", "+ZeRO", "+TP", "+PP", "+CP")
# (hardware, seq, global batch): 16M tokens per step; model names for that sequence length
SWEEPS = (("h100-sxm", 8192, 2048), ("h100-sxm", 131072, 128), ("tpu-v5p", 8192, 2048))
MODELS = {8192: ("llama3-8b", "llama3-70b", "llama3-405b"), 131072: ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")}
MAX_TENSOR = {"h100-sxm": 8, "tpu-v5p": 16}
PEAK_H100 = 989e12
# Dubey et al. 2024, table 4 (Llama 3 405B on H100): (seq, GPUs, mesh, TFLOP/s per GPU)
PUBLISHED = ((8192, 8192, dict(tensor=8, pipeline=16, data=64), 430e12),
             (8192, 16384, dict(tensor=8, pipeline=16, data=128), 400e12),
             (131072, 16384, dict(tensor=8, context=16, pipeline=16, data=8), 380e12))
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
    found = search(model, hw, devices, seq, batch, MEGATRON_CORE, keep=keep, key=rung,
                   max_tensor=min(MAX_TENSOR[hw_name], devices))
    out, best, valid = [], None, 0
    for r in range(len(RUNGS)):
        valid += found["valid"].get(r, 0)
        if r in found and (best is None or found[r][0].tokens_per_s > best[0].tokens_per_s):
            best = found[r]
        out.append(best if best else ("OOM" if valid else "batch"))
    return {"model": name, "hw": hw_name, "seq": seq, "batch": batch, "devices": devices, "rungs": out}


def published(results) -> list[list]:
    """Each published row: its MFU, the model's for that very mesh (best options; refused or OOM said
    so) and the model's best layout of the sweep at that size."""
    rows = []
    for seq, n, mesh, tflops in PUBLISHED:
        name = "llama3-405b" if seq == 8192 else "llama3.1-405b"
        sizes = {a: mesh.get(a, 1) for a in AXES}
        found = search(parse_model(name), load_hardware("h100-sxm"), n, seq, 2048 * 8192 // seq, MEGATRON_CORE,
                       keep=lambda s: s == sizes)
        mine = (found[0] if 0 in found else None)
        own = (f"{pct(mine[0].mfu)} ({mine[1].options.remat}, M={mine[1].options.microbatches}, "
               f"v={mine[1].options.pp_repeats})" if mine else "OOM" if found["valid"]
               else "not planned (pipeline x context: jaxpar.planning.planner.check_plannable)")
        best = next((r["rungs"][-1] for r in results if r["model"] == name and r["devices"] == n
                     and r["hw"] == "h100-sxm"), None)
        rows.append([f"{seq:,}", f"{n:,}", " ".join(f"{SHORT[a]}{k}" for a, k in reversed(sizes.items()) if k > 1),
                     pct(tflops / PEAK_H100), own, "not run" if best is None else
                     best if isinstance(best, str) else f"{pct(best[0].mfu)} ({layout(best[1])})"])
    return rows


def confirm(results, sizes) -> tuple[list[list], float]:
    """Compile the best llama3-70b layout (seq 8,192, H100) at each size: rows of per-axis-group bytes,
    and the largest byte error (fraction) over all groups carrying at least 1% of a step's bytes."""
    import jax  # noqa: PLC0415

    from jaxpar.planning.verify import verify_plan  # noqa: PLC0415
    rows, worst = [], 0.0
    model = parse_model("llama3-70b")
    for n in sizes:
        entry = next((r["rungs"][-1] for r in results if r["model"] == "llama3-70b" and r["devices"] == n
                      and r["hw"] == "h100-sxm" and r["seq"] == 8192), None)
        if entry is None:
            entry = ladder("llama3-70b", "h100-sxm", 8192, 2048, n)["rungs"][-1]
        if isinstance(entry, str):
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


def summary(r) -> list:
    """One table row: MFU per rung, the rung where it first fits and the rung that wins (the first
    within 1% of the best tokens/s: past it, a rung buys nothing)."""
    rungs = r["rungs"]
    fits = first(r, lambda e: not isinstance(e, str))
    if fits is None:
        return [r["model"], r["hw"], f"{r['seq']:,}", f"{r['devices']:,}", *map(cell, rungs), "-", "-", "nothing fits", "-"]
    top = rungs[-1][0].tokens_per_s
    wins = first(r, lambda e: not isinstance(e, str) and e[0].tokens_per_s >= 0.99 * top)
    est, st = rungs[-1]
    return [r["model"], r["hw"], f"{r['seq']:,}", f"{r['devices']:,}", *map(cell, rungs), RUNGS[fits], RUNGS[wins],
            layout(st), f"{est.memory.total / 2**30:.1f}"]


def ticks(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def figure(plt, results, sweeps, models_by_seq, devices):
    styles = [("o", ":"), ("s", "--"), ("^", "-."), ("D", "-"), ("v", "-")]
    fig, axes = plt.subplots(len(sweeps), 3, figsize=(11, 2.8 * len(sweeps) + 0.9), squeeze=False, sharex=True,
                             sharey=True)
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
                pub = [(n, tf / PEAK_H100) for s, n, _, tf in PUBLISHED if s == seq and n in devices]
                if pub:
                    ax.scatter(*zip(*pub), marker="*", s=150, color="black", zorder=5,
                               label="published (Llama 3 405B, Dubey et al. 2024, table 4)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(devices, [ticks(n) for n in devices])
            ax.minorticks_off()
            ax.set_title(f"{name} on {hw}, seq {seq:,}" + (" (uncalibrated)" if hw == "tpu-v5p" else ""), fontsize=9)
            ax.set_ylim(0, 0.75)
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
    fig.suptitle("The scaling ladder: best MFU using the parallelisms up to each rung "
                 "(a curve starts where its rung first fits; megatron-core)", fontsize=10)
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 0.98))
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
    headers = ["model", "hardware", "seq", "devices", *RUNGS, "fits from", "wins from", "best layout", "GiB/device"]
    body = ["MFU of the best fitting layout allowed up to each rung (rungs are nested: `+TP` may also use ZeRO). "
            "`OOM`: valid layouts exist on these rungs, none fits in memory (the memory wall); `batch`: none is valid, "
            "the batch has too few sequences for that many data-parallel ranks (the batch wall). `wins from`: the "
            "first rung within 1% of the best tokens/s. Software megatron-core; tpu-v5p uncalibrated.", "",
            *md_table(headers, [summary(r) for r in results]), "",
            "## Published (Dubey et al. 2024, table 4: Llama 3 405B on H100, 16M tokens per step)", "",
            *md_table(["seq", "GPUs", "layout", "published MFU", "predicted MFU, that layout",
                       "predicted MFU, best layout of the sweep"], published(results)),
            "", "## Compiled confirmation: llama3-70b, seq 8,192, the best layout at each size", "",
            "jaxpar's program for that layout compiled from shapes on as many simulated devices (jaxpar.planning.verify), "
            "bytes per device per step by mesh-axis group (GiB), predicted for XLA:CPU beside compiled; memory: "
            "the model's jaxpar-program figure beside XLA's peak.", ""]
    t1 = time.perf_counter()
    rows, worst = confirm(results, sizes)
    body += [*md_table(["devices", "layout", "what", "predicted", "compiled", "error"], rows), "",
             f"largest byte error over groups with >= 1% of the bytes: {worst:.2%}", "",
             f"{len(work)} cells in {t1 - t0:.1f} s; {len(sizes)} compiles in {time.perf_counter() - t1:.1f} s"]
    finish(args, STEM, "Study (a): the scaling ladder", body, lambda plt: figure(plt, results, sweeps, models_by_seq, devices))


if __name__ == "__main__":
    main()
