"""Study (i), the TPU compile: jaxpar's step compiled by XLA:TPU beside XLA:CPU, and what the CPU simulation tells.

    python experiments/study_tpu_compile.py            # full: 5 layouts on v5e 2x4 + llama3-8b on v6e, 70b on v5p
    python experiments/study_tpu_compile.py --quick    # one layout of a d_model 128 llama (part B: minutes, full only)

Question. Every analysis of jaxpar runs on simulated CPU devices, compiled by XLA:CPU, a compiler no one
trains on. What does that simulation say about the program a TPU slice runs, and what does it not?

Method. (A) One small llama (llama-tiny's depth, widths that fill TPU tiles: d_model 512, head_dim 128)
under five catalogue layouts of 8 devices, compiled twice from shapes (nothing runs): by XLA:CPU on 8
simulated devices (comm.ANALYSIS_COMPILER_OPTIONS) and by XLA:TPU for a v5e 2x4 slice (libtpu's
compile-only chips, jaxpar/analysis/target.py). Per layout and collective kind x mesh axes: count and
bytes on each compiler (the HLO tally, jaxpar/analysis/tally.py; scalar sums left out) beside the cost
model's prediction with its `cpu` and its `tpu` traits (jaxpar/cost/compiler.py); XLA's memory
analysis on each beside the cost model (jaxpar/cost/program_memory.py); and the overlap report
(jaxpar/analysis/overlap.py): the share of collective bytes XLA:TPU issues asynchronously with a matmul
scheduled in flight. (B) Pod scale, XLA:TPU only: llama3-8b on a v6e 8x8 slice (64 chips, fsdp=16 x
tensor=4), llama3-70b on a v5p 8x8x4 slice (256 chips, fsdp=32 x tensor=8); bf16,
full recompute, one 2,048-token sequence per fsdp rank (a short step keeps the compiles to a minute;
collective bytes do not depend on the batch except the activations' tensor all-reduces, which the
model scales). Per mesh axis group: XLA:TPU's bytes and ring wire bytes beside the `tpu` traits'
(flagged beyond 5%), the share hidden behind matmuls, and memory per chip against the model and the
chip's HBM.

Assumptions. XLA:TPU is libtpu 0.0.52 (the `tpu-aot` extra); what its passes do that the `tpu` traits
do not predict is jaxpar/cost/compiler.py's TPU_GAPS, named per row. Wire bytes are per device per
step: a ring all-gather or reduce-scatter moves (n-1)/n of the full buffer, an all-reduce 2(n-1)/n, a
collective-permute its buffer once (jaxpar/collectives.py), so a gather decomposed into a permute ring
moves the wire bytes of the gather it replaces. Writes experiments/results/study_tpu_compile.md and .png.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
from _study import arguments, finish, md_table, pct, progress  # noqa: E402

from jaxpar.analysis import comm, target  # noqa: E402
from jaxpar.core.strategy import catalogue, parse_inline  # noqa: E402
from jaxpar.cost import comm as cost_comm  # noqa: E402
from jaxpar.cost import memory, program_memory  # noqa: E402
from jaxpar.cost.compiler import TPU_GAPS  # noqa: E402
from jaxpar.cost.hardware import load_hardware  # noqa: E402
from jaxpar.cost.shape import step_shape  # noqa: E402
from jaxpar.cost.software import program_kernel  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.training.config import TrainConfig  # noqa: E402
from jaxpar.training.trainer import Trainer  # noqa: E402

STEM = "study_tpu_compile"
SMALL = "llama-tiny:d_model=512,heads=8,kv_heads=8,head_dim=128,mlp_dim=1024,vocab=1024,layers=4"
QUICK = "llama-tiny:d_model=128,heads=8,kv_heads=8,head_dim=128,mlp_dim=256,vocab=256,layers=4"  # compiles 2x faster
SLICE = "v5e:2x4"
LAYOUTS = ("dp8", "fsdp8", "fsdp4-tp2-sp", "dp2-fsdp2-tp2", "pp4-dp2")  # tp8: the tensor rows of these, alone
BATCH, SEQ = 16, 128           # part A: pp4-dp2's 8 micro-batches x data 2
POD = (("llama3-8b", "v6e:8x8", "fsdp=16,tensor=4", "tpu-v6e"),
       ("llama3-70b", "v5p:8x8x4", "fsdp=32,tensor=8", "tpu-v5p"))
POD_SEQ = 2048
POD_OPTIONS = dict(dtype="bfloat16", remat="full")
FLAG = 0.05                    # part B: a per-axis wire-byte difference beyond this is flagged
MIB, GIB = 2**20, 2**30


# ---- reading one compile ------------------------------------------------------------------------

def sums(collectives) -> dict[tuple, list]:
    """(kind, axes) -> [count, bytes, wire bytes], scalar-sized sums (16 values or fewer per op: the loss,
    the gradient norms' partial sums, which no traits predict) left out."""
    out: dict[tuple, list] = {}
    for c in collectives:
        kind, axes, count, nbytes, wire = ((c["kind"], tuple(c["axes"]), c["count"], c["bytes"], c["wire_bytes"])
                                           if isinstance(c, dict) else (c.kind, c.axes, c.count, c.bytes, c.wire_bytes))
        if nbytes > 64 * count:
            acc = out.setdefault((kind, axes), [0, 0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + count, acc[1] + nbytes, acc[2] + wire
    return out


def hidden(report: dict) -> tuple[float, float]:
    """(share of collective bytes issued asynchronously, share with a matmul in flight): a row's bytes count
    asynchronous in the proportion of its runs that are."""
    rows = [r for r in report["overlap"]["rows"] if r["bytes"] > 64 * r["runs"]]
    total = sum(r["bytes"] for r in rows) or 1
    async_bytes = sum(r["bytes"] * r["async_runs"] / r["runs"] for r in rows if r["runs"])
    return async_bytes / total, sum(r["overlapped_bytes"] for r in rows) / total


def overlapped(report: dict, key) -> dict[tuple, list]:
    """key(kind, axes) -> [bytes, bytes with a matmul in flight] over the overlap report's rows."""
    out: dict[tuple, list] = {}
    for o in report["overlap"]["rows"]:
        acc = out.setdefault(key(o["kind"], tuple(o["axes"])), [0, 0])
        acc[0], acc[1] = acc[0] + o["bytes"], acc[1] + o["overlapped_bytes"]
    return out


def gap(kind: str, axes: tuple, tpu: list | None, want: list | None, st, grads_equal: bool) -> str:
    """The TPU_GAPS entry that explains a (kind, axes) row where XLA:TPU's bytes differ from the `tpu`
    traits' by more than 1%, or '' when they agree."""
    got_b, want_b = (tpu or [0, 0])[1], (want or [0, 0])[1]
    if abs(got_b - want_b) <= 0.01 * max(got_b, want_b):
        return "" if (tpu or [0])[0] == (want or [0])[0] or kind == "all-gather" else "combine"
    if st.options.sequence_parallel and "tensor" in axes:
        return "sequence-parallel"
    if kind == "collective-permute":
        return "decomposed-collectives"
    if kind == "all-reduce" and st.size("pipeline") > 1:
        return "fold-pipeline"
    if kind in ("all-reduce", "reduce-scatter") and axes != ("tensor",) and grads_equal:
        return "rs-left-as-all-reduce"
    if kind == "all-gather" and want_b / 2 * 0.99 <= got_b <= want_b:
        return "gather-in-compute-dtype"
    if kind == "all-reduce" and axes == ("tensor",):
        return "label-sum"
    return "not named"


def grads_equal(tpu: dict, want: dict, axes: tuple) -> bool:
    """Whether a gradient reduction over `axes` moves the predicted bytes, reduce-scatter or all-reduce."""
    g = lambda s: sum(s.get((k, axes), [0, 0])[1] for k in ("reduce-scatter", "all-reduce"))
    return abs(g(tpu) - g(want)) <= 0.01 * max(g(want), 1)


# ---- part A: the same layout on XLA:CPU and XLA:TPU ---------------------------------------------

def compile_both(m, st, tc) -> dict:
    """One layout compiled by XLA:TPU for the v5e slice and by XLA:CPU on 8 simulated devices."""
    t0 = time.perf_counter()
    tpu = comm.analyze(Trainer(m, st, tc, target.mesh_order(target.topology(SLICE), st)), compiler_options=None)
    t1 = time.perf_counter()
    cpu = comm.analyze(Trainer(m, st, tc, jax.devices()[:8]))
    t2 = time.perf_counter()
    shape = step_shape(m, st, tc.batch, tc.seq)
    pred = {cc: cost_comm.collectives(m, st, shape, compiler=cc) for cc in ("cpu", "tpu")}
    mem = {p: program_memory.memory(m, st, tc.batch, tc.seq, program_kernel(st, p), p) for p in ("cpu", "tpu")}
    return {"st": st, "tpu": tpu, "cpu": cpu, "pred": pred, "mem": mem, "seconds": (t1 - t0, t2 - t1),
            "state": mem["tpu"].params + mem["tpu"].optimizer + memory.batch_bytes(st, tc.batch, tc.seq)}


def part_a_rows(r: dict) -> list[list]:
    """Per (kind, axes) of one layout: both compilers, both traits, the async share on TPU, the gap."""
    cpu, tpu = sums(r["cpu"]["collectives"]), sums(r["tpu"]["collectives"])
    pc, pt = sums(r["pred"]["cpu"]), sums(r["pred"]["tpu"])
    over = overlapped(r["tpu"], lambda kind, axes: (kind, axes))
    rows = []
    for key in sorted(cpu.keys() | tpu.keys() | pc.keys() | pt.keys()):
        kind, axes = key
        c, t, wc, wt = (s.get(key, [0, 0]) for s in (cpu, tpu, pc, pt))
        hid = over.get(key, [0, 0])
        rows.append([r["st"].name, kind, ",".join(axes), c[0], f"{c[1] / 1024:.1f}", f"{wc[1] / 1024:.1f}",
                     t[0], f"{t[1] / 1024:.1f}", f"{wt[1] / 1024:.1f}", pct(hid[1] / hid[0]) if hid[0] else "",
                     gap(kind, axes, tpu.get(key), pt.get(key), r["st"], grads_equal(tpu, pt, axes))])
    return rows


def part_a_summary(r: dict) -> list:
    tot = lambda s: sum(v[1] for v in s.values())
    cpu, tpu = tot(sums(r["cpu"]["collectives"])), tot(sums(r["tpu"]["collectives"]))
    pc, pt = tot(sums(r["pred"]["cpu"])), tot(sums(r["pred"]["tpu"]))
    rs = lambda rep: sum(c["bytes"] for c in rep["collectives"] if c["kind"] == "reduce-scatter")
    async_share, hid = hidden(r["tpu"])
    mc, mt = r["cpu"]["memory"], r["tpu"]["memory"]
    return [r["st"].name, f"{cpu / 1024:.1f}", f"{pc / cpu - 1:+.2%}", f"{tpu / 1024:.1f}", f"{pt / tpu - 1:+.2%}",
            f"{rs(r['cpu']) / 1024:.1f}", f"{rs(r['tpu']) / 1024:.1f}", pct(hidden(r["cpu"])[0]), pct(async_share),
            pct(hid), f"{r['state'] / MIB:.2f}", f"{mc['argument'] / MIB:.2f}", f"{mt['argument'] / MIB:.2f}",
            f"{r['mem']['cpu'].total / MIB:.1f}", f"{mc['peak'] / MIB:.1f}", f"{mt['peak'] / MIB:.1f}",
            f"{r['seconds'][1]:.1f}", f"{r['seconds'][0]:.1f}"]


# ---- part B: pod scale, XLA:TPU only -------------------------------------------------------------

def compile_pod(model: str, topo: str, mesh: str, hw: str) -> dict:
    m = parse_model(model)
    st = parse_inline(mesh).with_options(**POD_OPTIONS)
    tc = TrainConfig(batch=st.size("fsdp"), seq=POD_SEQ)
    t0 = time.perf_counter()
    report = comm.analyze_strategy(m, st, tc, target.topology(topo))
    seconds = time.perf_counter() - t0
    pred = cost_comm.collectives(m, st, step_shape(m, st, tc.batch, tc.seq), compiler="tpu")
    mem = program_memory.memory(m, st, tc.batch, tc.seq, program_kernel(st, "tpu"), "tpu")
    return {"model": model, "topo": topo, "st": st, "tc": tc, "report": report, "pred": pred, "mem": mem,
            "hbm": load_hardware(hw).hbm_bytes, "seconds": seconds}


def pod_axis_rows(r: dict) -> list[list]:
    """Per mesh axis group: XLA:TPU's bytes and wire bytes against the `tpu` traits', the kinds on each."""
    got, want = sums(r["report"]["collectives"]), sums(r["pred"])
    over = overlapped(r["report"], lambda kind, axes: axes)
    rows = []
    for axes in sorted({a for _, a in got.keys() | want.keys()}):
        g = [v for (k, a), v in got.items() if a == axes]
        w = [v for (k, a), v in want.items() if a == axes]
        gb, gw = sum(v[1] for v in g), sum(v[2] for v in g)
        wb, ww = sum(v[1] for v in w), sum(v[2] for v in w)
        if not w and gb < MIB:
            continue  # the norms' and the loss's small sums (scalar-sized at this scale)
        kinds = lambda s: " + ".join(sorted({k for k, a in s if a == axes}))
        err = gw / ww - 1 if ww else float("inf")
        hid = over.get(axes, [0, 0])
        rows.append([f"{r['model']} {r['topo']}", ",".join(axes), kinds(got), kinds(want), f"{gb / GIB:.2f}",
                     f"{wb / GIB:.2f}", f"{gw / GIB:.2f}", f"{ww / GIB:.2f}", f"{err:+.1%}",
                     "yes" if abs(err) > FLAG else "", pct(hid[1] / hid[0]) if hid[0] else ""])
    return rows


def pod_summary(r: dict) -> list:
    mem, report = r["report"]["memory"], r["report"]
    async_share, hid = hidden(report)
    permutes = sum(c["count"] for c in report["collectives"] if c["kind"] == "collective-permute")
    return [f"{r['model']} {r['topo']}", report["devices"], r["st"].name, f"{r['tc'].batch} x {r['tc'].seq:,}",
            permutes, pct(async_share), pct(hid), f"{mem['argument'] / GIB:.2f}", f"{mem['peak'] / GIB:.2f}",
            f"{r['mem'].total / GIB:.2f}", f"{r['mem'].total / mem['peak'] - 1:+.1%}", f"{r['hbm'] / GIB:.1f}",
            f"{r['seconds']:.0f}"]


# ---- conclusions, figure, main -------------------------------------------------------------------

def conclusions(part_a: list[dict], pods: list[dict]) -> list[str]:
    """What the CPU simulation tells and does not, each from the tables above (tests/test_experiments_study.py
    asserts them on the quick run)."""
    tot = lambda s: sum(v[1] for v in s.values())
    cpu_err = max(abs(tot(sums(r["pred"]["cpu"])) / tot(sums(r["cpu"]["collectives"])) - 1) for r in part_a)
    gaps = sorted({row[-1] for r in part_a for row in part_a_rows(r)} - {""})
    scatter = [r["st"].name for r in part_a if any(c["kind"] == "reduce-scatter" for c in r["tpu"]["collectives"])]
    state_err = max(abs(r["tpu"]["memory"]["argument"] / r["cpu"]["memory"]["argument"] - 1) for r in part_a)
    below = min(1 - r["tpu"]["memory"]["peak"] / r["cpu"]["memory"]["peak"] for r in part_a)
    found = [

        f"1. Collective bytes. XLA:CPU's equal the cost model's `cpu` traits on every layout (largest difference "
        f"{cpu_err:.2%}): the CPU simulation checks what the program asks for. XLA:TPU's differ from the `tpu` "
        f"traits only in rows that name a TPU_GAPS entry: {', '.join(gaps) or 'none'}"
        + ("" if "not named" not in gaps else " (and rows no gap names)") + ".",
        f"2. Compiler forms, not real differences: XLA:TPU forms reduce-scatters ({', '.join(scatter)}) where "
        "XLA:CPU all-reduces and slices (same bytes, half the wire bytes), moves the bf16 convert of a weight "
        "before its FSDP gather, combines gradient reductions inside the layer loop, and issues collectives "
        "asynchronously; XLA:CPU issues none asynchronously (0% on every layout), so the overlap the cost "
        "model assumes can be read only from a TPU (or GPU) compile.",
        f"3. State memory is the same program on both: the arguments XLA:TPU allocates equal XLA:CPU's within "
        f"{state_err:.2%} (widths that fill TPU tiles; llama-tiny's 64-wide arrays are padded to 8 x 128 tiles). "
        f"The peak is not: XLA:TPU's is at least {below:.0%} below XLA:CPU's on every layout (its fusions "
        "materialise fewer temporaries and its memory-space assignment keeps small buffers on chip, outside "
        "the HBM figure), so the CPU peak and the model bound a TPU's from above at this size.",
    ]
    if not pods:
        return found + ["4, 5. Pod scale: full mode only (minutes of XLA:TPU compiles)."]
    tensor = [row for r in pods for row in pod_axis_rows(r) if row[1] == "tensor"]
    tensor_err = max(abs(float(row[8].rstrip("%")) / 100) for row in tensor)
    flagged = sorted({f"{row[0]} over {row[1]}" for r in pods for row in pod_axis_rows(r) if row[9]})
    errors = sorted(float(row[8].rstrip("%")) / 100 for r in pods for row in pod_axis_rows(r) if row[9])
    mem_err = max(abs(r["mem"].total / r["report"]["memory"]["peak"] - 1) for r in pods)
    fits = all(r["report"]["memory"]["peak"] < r["hbm"] for r in pods)
    pod_hidden = min(hidden(r["report"])[1] for r in pods)
    sync = all(o["async_runs"] == 0 for r in pods for o in r["report"]["overlap"]["rows"]
               if o["kind"] != "collective-permute")
    above = all(r["mem"].total > r["report"]["memory"]["peak"] for r in pods)
    return found + [
        f"4. At pod scale the tensor-parallel all-reduces are the model's within {tensor_err:.2%} in wire bytes; "
        f"{', '.join(flagged) or 'no axis'} differ{'s' if len(flagged) == 1 else ''} by more than {FLAG:.0%}"
        + (f" ({errors[0]:+.1%} to {errors[-1]:+.1%})" if errors else "") + ": decomposed-collectives, XLA:TPU "
        "turns FSDP gathers and reduce-scatters around the big matmuls into collective-permute rings (windowed "
        "einsums) and moves fewer bytes than the traits' gathers and float32 reduce-scatters (which ring buffers "
        "it carries in bfloat16 is not separated here). No CPU compile shows these forms.",
        f"5. At pod scale XLA:TPU hides at least {pod_hidden:.1%} of the collective bytes behind matmuls"
        + (" (the permute rings; every other collective runs synchronously)" if sync else "")
        + f"; memory per chip is the model's within {mem_err:.1%}"
        + (" (the model above XLA:TPU's peak)" if above else "")
        + f" and {'fits' if fits else 'does not fit'} the chip's HBM on every slice.",
    ]


def figure(plt, part_a: list[dict], pods: list[dict]):
    fig, axes = plt.subplots(1, 2 if pods else 1, figsize=(11, 3.8) if pods else (7, 3.8), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2] if pods else [1]})
    ax = axes[0][0]
    tot = lambda s: sum(v[1] for v in s.values()) / 1024
    names = [r["st"].name for r in part_a]
    bars = {"XLA:CPU": [tot(sums(r["cpu"]["collectives"])) for r in part_a],
            "model, cpu traits": [tot(sums(r["pred"]["cpu"])) for r in part_a],
            "XLA:TPU": [tot(sums(r["tpu"]["collectives"])) for r in part_a],
            "model, tpu traits": [tot(sums(r["pred"]["tpu"])) for r in part_a]}
    for i, (label, vals) in enumerate(bars.items()):
        ax.bar([x + 0.2 * (i - 1.5) for x in range(len(names))], vals, 0.2, label=label)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set(ylabel="collective KiB per device per step", title="(A) each layout on both compilers, 8 devices")
    ax.legend(fontsize=7)
    if not pods:
        fig.tight_layout()
        return fig
    bx = axes[0][1]
    labels = [f"{r['model']}\n{r['topo']}" for r in pods]
    x = range(len(pods))
    bx.bar([i - 0.2 for i in x], [r["report"]["memory"]["peak"] / GIB for r in pods], 0.4, label="XLA:TPU peak")
    bx.bar([i + 0.2 for i in x], [r["mem"].total / GIB for r in pods], 0.4, label="cost model")
    bx.scatter(list(x), [r["hbm"] / GIB for r in pods], marker="_", s=400, color="black", label="HBM")
    bx.set_xticks(list(x), labels, fontsize=7)
    bx.set(ylabel="GiB per chip", title="(B) pod scale, XLA:TPU")
    bx.set_yscale("log")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def part_b(pods: list[dict]) -> list[str]:
    if not pods:
        return []
    return [f"## (B) pod scale, XLA:TPU only: bf16, remat full, one {POD_SEQ:,}-token sequence per fsdp rank", "",
            *md_table(["run", "axes", "TPU kinds", "model kinds", "TPU GiB", "model GiB", "TPU wire GiB",
                       "model wire GiB", "wire error", f"beyond {FLAG:.0%}", "TPU hidden"],
                      [row for r in pods for row in pod_axis_rows(r)]), "",
            *md_table(["slice", "chips", "mesh", "batch x seq", "collective-permutes/step", "async bytes",
                       "hidden bytes", "state GiB/chip (TPU)", "peak GiB/chip (TPU)", "peak GiB/chip (model)",
                       "model error", "HBM GiB", "compile s"], [pod_summary(r) for r in pods]), "",
            "Wire bytes: what each chip sends per step (module docstring); a collective-permute ring moves the "
            "wire bytes of the gather or reduce-scatter it replaces. Hidden: the share of the bytes XLA:TPU "
            "issues asynchronously with a matmul in flight. State: the arguments (float32 weights and Adam "
            "moments, the batch); peak as in (A).", ""]


def no_figure(plt):
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.text(0.5, 0.5, "libtpu is not installed: nothing compiled for TPU", ha="center", va="center")
    ax.set_axis_off()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(model=QUICK, layouts="dp2-fsdp2-tp2", pod="none"),
                     model=(str, SMALL, "part A's model (its widths fill TPU tiles: see conclusion 3)"),
                     layouts=(str, ",".join(LAYOUTS), "part A: catalogue layouts of 8 devices, comma-separated"),
                     pod=(str, "full", "part B: full (llama3-8b/70b on 64- and 256-chip slices) or none"))
    if importlib.util.find_spec("libtpu") is None:  # said, not hidden (tests/test_experiments_study.py)
        body = [f"libtpu is not installed (pip install 'jaxpar[tpu-aot]', or \"{target.LIBTPU}\"): no XLA:TPU to "
                "compile with, nothing measured."]
        print(body[0])
        finish(args, STEM, "Study (i): the TPU compile beside the CPU simulation", body, no_figure)
        return
    cat = {s.name: s for s in catalogue()}
    layouts, pod = args.layouts.split(","), POD if args.pod == "full" else ()
    m, tc = parse_model(args.model), TrainConfig(batch=BATCH, seq=SEQ)
    with progress(len(layouts) + len(pod), "compile") as bar:
        part_a = []
        for name in layouts:
            bar.set_description(f"{name} on XLA:TPU and XLA:CPU")
            part_a.append(compile_both(m, cat[name], tc))
            bar.update()
        pods = []
        for spec in pod:
            bar.set_description(f"{spec[0]} on {spec[1]}")
            pods.append(compile_pod(*spec))
            bar.update()
    body = [f"## (A) {args.model} on 8 devices: XLA:CPU (simulated) and XLA:TPU ({SLICE}), batch {BATCH} x {SEQ}, "
            "float32", "",
            *md_table(["layout", "kind", "axes", "CPU count", "CPU KiB", "model cpu KiB", "TPU count", "TPU KiB",
                       "model tpu KiB", "TPU hidden", "TPU gap"], [row for r in part_a for row in part_a_rows(r)]), "",
            "KiB: every collective's full buffer per device per step (the HLO tally), scalar sums left out. TPU "
            "hidden: the share of those bytes XLA:TPU issues asynchronously with a matmul scheduled between start "
            "and done. TPU gap: the TPU_GAPS entry (jaxpar/cost/compiler.py) where XLA:TPU's bytes differ from the "
            "`tpu` traits' by more than 1%, `combine` where only the count differs.", "",
            *md_table(["layout", "CPU KiB", "model cpu error", "TPU KiB", "model tpu error", "CPU reduce-scatter KiB",
                       "TPU reduce-scatter KiB", "CPU async", "TPU async", "TPU hidden", "state MiB (model)",
                       "state MiB (CPU)", "state MiB (TPU)", "peak MiB (model)", "peak MiB (CPU)", "peak MiB (TPU)",
                       "CPU compile s", "TPU compile s"], [part_a_summary(r) for r in part_a]), "",
            "State: the arguments XLA allocates (float32 weights, two Adam moments, the batch); peak: argument + "
            "output - alias + temp (jaxpar/analysis/comm.py). The model's peak is jaxpar/cost/program_memory.py's "
            "for jaxpar's program.", "",
            *part_b(pods), "## Conclusions", "", *conclusions(part_a, pods)]
    print("\n".join(body))
    finish(args, STEM, "Study (i): the TPU compile beside the CPU simulation", body,
           lambda plt: figure(plt, part_a, pods))


if __name__ == "__main__":
    main()
