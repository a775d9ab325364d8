"""Study (h, MoE): expert or tensor parallelism for the experts, and expert parallelism across nodes.

    python experiments/study_moe.py            # Mixtral on 64 H100, DeepSeek-V3-like on 2,048 + 3 compiled layouts
    python experiments/study_moe.py --quick    # the same analytic tables + ep8 and tp8 compiled (1 layer)

Question. A mixture-of-experts layer can split its experts over an `expert` axis (each GPU holds whole
experts; tokens travel to their experts' owners and back by all-to-all: expert parallelism, EP) or
split every expert's width over `tensor` (each GPU holds a slice of every expert; activations are
all-gathered and reduce-scattered as in any Megatron MLP: TP), or both. Inside an 8-GPU node, which
wins when the two are compared like with like, what does each need to fit, and how far across nodes
does expert parallelism go?

Method (the cost model: jaxpar.cost.estimate, software megatron-core, h100-sxm). (1) Mixtral-8x7B
on 64 H100: each split EP e x TP t = 8 inside the node with the SAME data parallelism across nodes
(DP8), the same ZeRO (1: Megatron's distributed optimizer) and the same recompute policy (Megatron-Core's:
none, selective (the attention core), `dots` (--recompute-modules layernorm moe_act: every matmul output
kept), full), the micro-batch the fastest that fits; each under three overlap
assumptions: megatron-core as calibrated (tensor collectives inside a node hidden under the GEMMs,
all-to-alls exposed), the tensor collectives exposed (tp_overlap 0), and the all-to-alls hidden
(Software.ep_overlap 1). (2) What each split needs to fit, over every mesh with that split inside the
node (FSDP, PP allowed), beside NVIDIA's Mixtral recipe (NeMo's mixtral_8x7b pretrain recipe and the
Megatron-LM Mixtral example: TP1 PP4 EP8, virtual pipeline 8, on 64 GPUs). (3) EP across nodes: a
DeepSeek-V3-like model (jaxpar's deepseek-v3-moe: 61 MoE layers of 256 experts, top-8, one shared
expert; standard attention in place of MLA) on 2,048 H100 with PP16 as DeepSeek-V3 trained, EP 8, 16,
32, 64 (EP64 spans 8 nodes, DeepSeek-V3's choice), data parallelism the rest, with and without the
all-to-all overlap. (4) jaxpar's own program: moe-tiny compiled on 8 simulated CPU devices under ep8,
tp8 and ep4-tp2 (experiments/_bench.py: the HLO tally) beside the cost model's bytes (XLA:CPU traits).

Tokens per step: each model at the batch of its published recipe: Mixtral 512 x 8,192 (NeMo's
mixtral_8x7b pretrain recipe, global_batch_size 512, seq_length 8192); DeepSeek-V3 15,360 x 4,096
(DeepSeek-AI 2024, arXiv 2412.19437 sec. 4.2: the batch size ramps to 15,360 sequences of 4K tokens).
Routing perfectly balanced (imbalance 1: Megatron-Bridge's MoE benchmarks force-balance too).
Writes experiments/results/study_moe.md and .png.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

from _bench import compiled_step  # noqa: E402
from _study import (arguments, band, band_line, finish, layout, md_table, pct, progress, search,  # noqa: E402
                    versus)

from jaxpar.cost import MEGATRON_CORE, estimate, load_hardware  # noqa: E402
from jaxpar.cost.report import mfu_convention  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import AXES, Options, Strategy, parse_strategy  # noqa: E402

STEM = "study_moe"
HW = load_hardware("h100-sxm")
BAND = band("h100-sxm", "megatron-core")
VARIANTS = {"as calibrated": MEGATRON_CORE,
            "TP exposed": dataclasses.replace(MEGATRON_CORE, tp_overlap=0.0, async_tp=False),
            "all-to-all hidden": dataclasses.replace(MEGATRON_CORE, ep_overlap=1.0)}
INNER = ((8, 1), (4, 2), (2, 4), (1, 8))  # (expert, tensor) inside the node
REMATS = MEGATRON_CORE.remats   # what Megatron-Core runs
MIXTRAL, MIX_GPUS, MIX_BATCH, MIX_SEQ = "mixtral-8x7b", 64, 512, 8192
DEEPSEEK, DS_GPUS, DS_BATCH, DS_SEQ, DS_STAGES = "deepseek-v3-moe", 2048, 15360, 4096, 16
COMPILED = "moe-tiny:kv_heads=8"


def traffic(est) -> dict:
    """Bytes per GPU per step: expert all-to-alls, tensor collectives, the rest; and the exposed seconds."""
    cs = est.collectives
    a2a = sum(c.bytes for c in cs if c.kind == "all-to-all" and "expert" in c.axes)
    tensor = sum(c.bytes for c in cs if "tensor" in c.axes)
    return {"a2a": a2a, "tensor": tensor, "other": sum(c.bytes for c in cs) - a2a - tensor,
            "expert_s": est.time.expert, "tensor_s": est.time.tensor, "step_s": est.step_time_s, "mfu": est.mfu,
            "gib": est.memory.total / 2**30}


def like_with_like(m) -> list[dict]:
    """Section (1): every split x recompute policy at DP8 and ZeRO-1, under each overlap assumption."""
    rows = []
    for e, t in INNER:
        keep = (lambda sz, e=e, t=t: (sz["expert"], sz["tensor"]) == (e, t) and sz["data"] == MIX_GPUS // 8
                and sz["pipeline"] == sz["context"] == sz["fsdp"] == 1)
        found = {name: search(m, HW, MIX_GPUS, MIX_SEQ, MIX_BATCH, sw, keep=keep,
                              key=lambda st: (st.options.remat, st.zero)) for name, sw in VARIANTS.items()}
        for remat in REMATS:
            row = {"inner": f"EP{e} TP{t}", "e": e, "t": t, "remat": remat}
            for name in VARIANTS:
                if (remat, 1) in found[name]:
                    est, st = found[name][(remat, 1)]
                    row[name] = traffic(est) | {"accum": st.options.grad_accum, "layout": layout(st)}
            rows.append(row)
    return rows


def to_fit(m) -> list[dict]:
    """Section (2): the best layout with each split inside the node over every mesh (FSDP and PP allowed),
    under each overlap assumption."""
    rows = []
    for e, t in INNER:
        keep = lambda sz, e=e, t=t: (sz["expert"], sz["tensor"]) == (e, t) and sz["context"] == 1
        row = {"inner": f"EP{e} TP{t}", "recipe": False}
        for name, sw in VARIANTS.items():
            best = search(m, HW, MIX_GPUS, MIX_SEQ, MIX_BATCH, sw, keep=keep)
            if 0 in best:
                est, st = best[0]
                row[name] = traffic(est) | {"layout": layout(st), "remat": st.options.remat, "schedule": schedule(st)}
        rows.append(row)
    return rows


def schedule(st: Strategy) -> str:
    o = st.options
    if st.sizes["pipeline"] == 1:
        return ""
    return f"{o.pp_schedule} M={o.microbatches}" + (f" v={o.pp_repeats}" if o.pp_repeats > 1 else "")


def mesh(**sizes) -> tuple:
    return tuple((a, sizes.get(a, 1)) for a in AXES)


def recipe(m, remat: str) -> dict:
    """NVIDIA's Mixtral 8x7B layout (NeMo mixtral_8x7b.py trainer(): TP1 PP4 VP8 EP8, sequence parallel,
    no recompute; Megatron-LM examples/mixtral: 'TP1EP8PP4' for training) on 64 GPUs: interleaved 1F1B
    with one layer per virtual stage, one sequence per micro-batch (micro_batch_size 1)."""
    micro = MIX_BATCH // (2 * 8)
    st = Strategy(name="recipe", mesh=mesh(data=2, pipeline=4, expert=8),
                  options=Options(zero=1, remat=remat, dtype="bfloat16", microbatches=micro, pp_schedule="1f1b",
                                  pp_repeats=8))
    row = {"inner": "EP8 TP1", "recipe": True}
    for name, sw in VARIANTS.items():
        est = estimate(m, st, HW, MIX_BATCH, MIX_SEQ, sw)
        row[name] = traffic(est) | {"layout": layout(st) + " (recipe)", "remat": remat, "schedule": schedule(st),
                                    "fits": est.fits}
    return row


def across_nodes(m) -> list[dict]:
    """Section (3): PP16, TP1, EP 8 ... 64, data parallelism the rest; best fitting options per variant."""
    rows = []
    for e in (8, 16, 32, 64):
        keep = (lambda sz, e=e: sz["expert"] == e and sz["tensor"] == 1 and sz["pipeline"] == DS_STAGES
                and sz["context"] == sz["fsdp"] == 1)
        row = {"ep": e, "nodes": max(1, e // HW.devices_per_node)}
        for name in ("as calibrated", "all-to-all hidden"):
            best = search(m, HW, DS_GPUS, DS_SEQ, DS_BATCH, VARIANTS[name], keep=keep)
            if 0 in best:
                est, st = best[0]
                row[name] = traffic(est) | {"layout": layout(st), "remat": st.options.remat, "schedule": schedule(st)}
        rows.append(row)
    return rows


def compiled(meshes: list[str], model: str, batch: int, seq: int, bar) -> list[dict]:
    rows = []
    for name in meshes:
        bar.set_description(f"compile {name}")
        r = compiled_step(model, parse_strategy(name), batch, seq, steps=1)
        tally, pred = r["tally"], r["predicted"]

        def split(cs):
            a2a = sum(c.bytes for c in cs if c.kind == "all-to-all" and "expert" in c.axes)
            tensor = sum(c.bytes for c in cs if "tensor" in c.axes)
            return a2a, tensor, sum(c.bytes for c in cs)
        (a2a, tensor, total), (pa2a, ptensor, ptotal) = split(tally), split(pred)
        rows.append({"mesh": name, "a2a": a2a, "tensor": tensor, "total": total, "pa2a": pa2a, "ptensor": ptensor,
                     "ptotal": ptotal, "argument": r["memory"].argument_size_in_bytes})
        bar.update()
    return rows


def figure(plt, like, across):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    full = [r for r in like if r["remat"] == "full"]
    width = 0.26
    for i, name in enumerate(VARIANTS):
        xs = [j + (i - 1) * width for j, r in enumerate(full) if name in r]
        ys = [100 * r[name]["mfu"] for r in full if name in r]
        ax.bar(xs, ys, width, yerr=[BAND * y for y in ys], capsize=2, label=name)
    ax.set_xticks(range(len(full)), [r["inner"] for r in full])
    ax.set(ylabel="MFU % (model; bars: the ±band)", ylim=(0, 45),
           title=f"Mixtral 8x7B, {MIX_GPUS} H100: DP8, ZeRO-1, full recompute")
    ax.legend(fontsize=7, title="overlap", title_fontsize=7, loc="lower right")
    bx = axes[1]
    for name, marker in (("as calibrated", "o"), ("all-to-all hidden", "s")):
        pts = [r for r in across if name in r]
        bx.errorbar([r["ep"] for r in pts], [100 * r[name]["mfu"] for r in pts],
                    yerr=[100 * BAND * r[name]["mfu"] for r in pts], marker=marker, capsize=2,
                    label="all-to-alls exposed (megatron-core)" if name == "as calibrated" else name + " (DualPipe-like)")
    bx.set_xscale("log", base=2)
    bx.set_xticks([r["ep"] for r in across], [f"EP{r['ep']}\n{r['nodes']} node{'s' * (r['nodes'] > 1)}" for r in across])
    bx.set(ylabel="MFU % (model)", ylim=(0, 35),
           title=f"DeepSeek-V3-like, {DS_GPUS:,} H100, PP{DS_STAGES}: EP across nodes")
    bx.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(meshes="ep8,tp8", model=COMPILED + ",layers=1", batch=8, seq=16),
                     meshes=(str, "ep8,tp8,ep4-tp2", "compiled layouts"), model=(str, COMPILED, "compiled model"),
                     batch=(int, 16, "compiled global batch"), seq=(int, 32, "compiled sequence length"))
    meshes = args.meshes.split(",")
    with progress(3 + len(meshes), "part") as bar:
        mix = parse_model(MIXTRAL)
        like = like_with_like(mix)
        bar.update()
        fit = to_fit(mix) + [recipe(mix, "none"), recipe(mix, "dots")]
        bar.update()
        across = across_nodes(parse_model(DEEPSEEK))
        bar.update()
        comp = compiled(meshes, args.model, args.batch, args.seq, bar)
    body = report(args, like, fit, across, comp)
    print("\n".join(body))
    finish(args, STEM, "Study (h, MoE): expert or tensor parallelism for the experts, and EP across nodes", body,
           lambda plt: figure(plt, like, across))


def cells(r: dict | None, tp8: dict | None) -> list[str]:
    if r is None:
        return ["OOM", "", "", ""]
    vs = versus(r["mfu"], tp8["mfu"], BAND) if tp8 and r is not tp8 else ""
    return [pct(r["mfu"]), vs, f"{r['gib']:.1f}", str(r["accum"])]


def report(args, like, fit, across, comp) -> list[str]:
    gib, kib = 2**30, 2**10
    head = [band_line("h100-sxm", "megatron-core"), "",
            f"{mfu_convention_text()}", "",
            f"Tokens per step: each model at its published recipe's batch: Mixtral {MIX_BATCH} x {MIX_SEQ:,} "
            f"(NeMo mixtral_8x7b pretrain recipe), DeepSeek-V3 {DS_BATCH:,} x {DS_SEQ:,} (DeepSeek-V3 technical "
            "report, arXiv 2412.19437 sec. 4.2). Routing perfectly balanced; bf16 with float32 master weights "
            "and Adam moments (Megatron's distributed optimizer).", ""]
    tp8 = {(r["remat"], n): r.get(n) for r in like if r["inner"] == "EP1 TP8" for n in VARIANTS}
    rows1 = []
    for r in like:
        out = [r["inner"], r["remat"]]
        for n in VARIANTS:
            out += cells(r.get(n), tp8[(r["remat"], n)])
        c = r.get("as calibrated")
        out += ([f"{c['a2a'] / gib:.1f}", f"{c['tensor'] / gib:.1f}", f"{c['expert_s']:.3f}",
                 f"{r['TP exposed']['tensor_s']:.3f}"] if c else [""] * 4)
        rows1.append(out)
    sec1 = [f"## (1) Like with like: Mixtral 8x7B on {MIX_GPUS} H100, each split inside the node, DP8 across nodes, "
            f"ZeRO-1, the same recompute (model, megatron-core, batch {MIX_BATCH} x {MIX_SEQ}, bf16)", "",
            *md_table(["inside node", "remat", *(f"{h} ({n})" for n in VARIANTS
                                                  for h in ("MFU", "vs EP1 TP8", "GiB/GPU", "accum")),
                       "expert all-to-all GiB/GPU", "tensor GiB/GPU", "exposed expert s (as calibrated)",
                       "exposed tensor s (TP exposed)"], rows1), "",
            "as calibrated: megatron-core's preset (tensor collectives inside a node hidden under the GEMMs: "
            "Transformer Engine's TP overlap, fitted on dense models; expert all-to-alls exposed). TP exposed: no "
            "tensor overlap. Transformer Engine overlaps the tensor collectives inside its linear layers; the "
            "experts' tokens cross the tensor group in Megatron-Core's token dispatcher, around the grouped GEMM, "
            "where no published run shows them hidden, so the two columns bracket the MoE layers. all-to-all "
            "hidden: Software.ep_overlap = 1 "
            "(DeepSeek-V3's DualPipe; Megatron-Core --overlap-moe-expert-parallel-comm). OOM: that split with "
            "that recompute policy fits no micro-batch at DP8 and ZeRO-1. vs EP1 TP8: against TP8 at the same "
            "recompute and overlap, ties inside the band.", ""]
    return head + sec1 + fit_section(fit) + across_section(across) + compiled_section(args, comp, kib)


def mfu_convention_text() -> str:
    m = parse_model(MIXTRAL)
    st = Strategy(name="ep8", mesh=mesh(data=8, expert=8), options=Options(zero=1, remat="full", dtype="bfloat16"))
    return mfu_convention(estimate(m, st, HW, MIX_BATCH, MIX_SEQ, MEGATRON_CORE)) + " (parameters: the active ones)."


def fit_section(fit) -> list[str]:
    gib = 2**30
    tp8 = next(r for r in fit if r["inner"] == "EP1 TP8" and not r["recipe"])
    rows = []
    for r in fit:
        c = r["as calibrated"]
        out = [r["inner"], c["layout"], c["remat"], c["schedule"], f"{c['gib']:.1f}", "yes" if c.get("fits", True) else "no"]
        for n in VARIANTS:
            out += [pct(r[n]["mfu"]), "" if r is tp8 else versus(r[n]["mfu"], tp8[n]["mfu"], BAND)]
        rows.append(out + [f"{c['a2a'] / gib:.1f}", f"{c['tensor'] / gib:.1f}"])
    return [f"## (2) What each split needs to fit: the best layout over every mesh with that split inside the node "
            f"(FSDP and PP allowed), and NVIDIA's recipe (Mixtral 8x7B, {MIX_GPUS} H100)", "",
            *md_table(["inside node", "layout (best as calibrated)", "remat", "pipeline schedule", "GiB/GPU", "fits",
                       *(f"{h} ({n})" for n in VARIANTS for h in ("MFU", "vs best EP1 TP8")),
                       "expert all-to-all GiB/GPU", "tensor GiB/GPU"], rows), "",
            "Each variant's MFU is its own best layout with that split (the layout column: the calibrated "
            "one's). recipe: NeMo's mixtral_8x7b pretrain recipe (trainer(): tensor 1, pipeline 4, virtual "
            "pipeline 8, expert 8, sequence parallel, 8 nodes x 8 GPUs; data: global batch 512, micro-batch 1, "
            "seq 8192; no recompute) and Megatron-LM's examples/mixtral ('the recommended model parallel config "
            "is TP1EP8PP4'); the second recipe row adds Megatron-Core's selective recompute of the norms and activations (dots), which the model needs "
            "to fit it. No published throughput for the recipe is in the references, so it is predicted, not "
            "scored.", ""]


def across_section(across) -> list[str]:
    gib = 2**30
    rows = []
    ep8 = across[0].get("as calibrated")
    for r in across:
        c, h = r.get("as calibrated"), r.get("all-to-all hidden")
        rows.append([f"EP{r['ep']}", r["nodes"], c["layout"] if c else "OOM", c["remat"] if c else "",
                     c["schedule"] if c else "", pct(c["mfu"]) if c else "", versus(c["mfu"], ep8["mfu"], BAND) if c and c is not ep8 else "",
                     f"{c['gib']:.1f}" if c else "", f"{c['a2a'] / gib:.1f}" if c else "", f"{c['expert_s']:.3f}" if c else "",
                     pct(h["mfu"]) if h else "", versus(h["mfu"], c["mfu"], BAND) if h and c else ""])
    return [f"## (3) EP across nodes: DeepSeek-V3-like on {DS_GPUS:,} H100, PP{DS_STAGES}, TP1, data parallelism the "
            f"rest (model, megatron-core, batch {DS_BATCH:,} x {DS_SEQ:,}, bf16)", "",
            *md_table(["EP", "nodes per expert group", "best layout", "remat", "pipeline schedule", "MFU (exposed)",
                       "vs EP8 (exposed)", "GiB/GPU", "expert all-to-all GiB/GPU", "exposed expert s",
                       "MFU (all-to-all hidden)", "hidden vs exposed"], rows), "",
            "exposed: megatron-core as calibrated; hidden: Software.ep_overlap = 1, the all-to-alls under the other "
            "micro-batch's compute as DeepSeek-V3's DualPipe schedules them (arXiv 2412.19437 sec. 3.2.1). "
            "DeepSeek-V3 trained with PP16 and EP64 over 8 nodes, ZeRO-1 data parallelism, no TP, on 2,048 H800 "
            "(NVLink 400 GB/s) in FP8 with MLA; it reports 180K H800 GPU hours per trillion tokens. That run is "
            "outside what the model is calibrated on (FP8, MLA, H800), so it is not scored here. Megatron-Bridge's "
            "DeepSeek-V3 recipe (deepseek_v3_pretrain_config) uses TP2 PP16 EP64 with expert TP 1.", ""]


def compiled_section(args, comp, kib) -> list[str]:
    return [f"## (4) jaxpar's own program: {args.model} compiled on 8 simulated CPU devices, batch {args.batch} x "
            f"{args.seq}, float32", "",
            "Not hardware guidance: what jaxpar's program sends, counted in the HLO XLA:CPU compiles, beside the "
            "cost model's count for the same step.", "",
            *md_table(["layout", "expert all-to-all KiB (compiled)", "expert all-to-all KiB (model)",
                       "tensor KiB (compiled)", "tensor KiB (model)", "total KiB (compiled)", "total KiB (model)",
                       "total error", "state+batch KiB/device"],
                      [[r["mesh"], f"{r['a2a'] / kib:.1f}", f"{r['pa2a'] / kib:.1f}", f"{r['tensor'] / kib:.1f}",
                        f"{r['ptensor'] / kib:.1f}", f"{r['total'] / kib:.1f}", f"{r['ptotal'] / kib:.1f}",
                        f"{r['ptotal'] / r['total'] - 1:+.2%}", f"{r['argument'] / kib:.1f}"] for r in comp])]


if __name__ == "__main__":
    main()
