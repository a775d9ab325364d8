"""Study (b), TP vs PP at a fixed model-parallel size of 64: where does tensor parallelism stop paying?

    python experiments/study_tp_vs_pp.py            # full: 7 splits x 3 batch sizes + the published rows
    python experiments/study_tp_vs_pp.py --quick    # TP8 x PP8 vs TP16 x PP4 at one batch size

Question (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", figure 13 and takeaway #1): with 64 GPUs given to one model replica, how should they be
split between tensor (TP) and pipeline (PP) parallelism, TP x PP in {1x64, 2x32, ..., 64x1}?

Method. A GPT-3 175B-class model (96 layers, d_model 12,288, GeLU MLP, vocab 51,200) with 128 heads of
96 (GPT-3 has 96 of 128) so that every TP size up to 64 divides the heads, on 64 H100 (8 per node,
data parallelism 1), seq 2,048, global batch 32, 128 and 512 sequences. For each split the best
fitting options (remat, micro-batches, GPipe or interleaved schedule; experiments/_study.py) by the
analytic model's tokens/s. Bytes per link tier: each predicted collective's ring traffic per device
split as jaxpar/cost/time.py prices it: a group with k members per node over m nodes moves
(k-1)/k of its buffer over NVLink and (m-1)/(m k) over InfiniBand (twice both for an all-reduce); a
permute crosses one tier. Published overlay: the Megatron-Core H100 rows
(jaxpar/cost/published/: published_runs_h100) at their own TP x PP, each beside the other splits of its
model-parallel size, mapped as tests/test_cost_published.py maps them (GPT, untied embeddings,
distributed optimizer, SP, no recompute, micro-batch 1, interleaved with one layer per chunk, MFU by
Megatron's formula).

Assumptions. Software megatron-core: TP communication overlapped with the GEMMs inside a node only
(Transformer Engine's userbuffers need peer-to-peer device memory, so the share of a tensor group's
seconds spent across InfiniBand waits: jaxpar/cost/overlap.py inside_nodes); h100-sxm calibrated on
those rows. Tokens per step: 128 sequences of 2,048 (262,144 tokens), the larger of the two batches of
Narayanan et al.'s figure 13 (32 and 128); 32 and 512 are shown as a sensitivity. Every comparison
uses the cost model's out-of-sample error band for megatron-core on H100 (experiments/_study.py band):
splits closer than it are ties. Splits jaxpar.core.validate refuses are listed as such; splits that
fit no option, and published-row splits the model says overflow HBM, are marked in the figure.
Writes experiments/results/study_tp_vs_pp.md and .png.
"""
from __future__ import annotations

import pathlib

from _study import OKABE_ITO, ROOT, arguments, band, band_line, finish, md_table, pct, progress, search, versus

from jaxpar.core import validate
from jaxpar.cost import MEGATRON, MEGATRON_CORE, estimate, load_hardware, published
from jaxpar.cost.report import mfu_convention
from jaxpar.cost.time import axis_span
from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.core.strategy import AXES, parse_inline

STEM = "study_tp_vs_pp"
HW = load_hardware("h100-sxm")
MODEL = ModelConfig(name="gpt-175b-h128", layers=96, d_model=12288, heads=128, kv_heads=128, head_dim=96,
                    mlp_dim=49152, mlp_type="gelu", vocab=51200, max_seq=2048, tie_embeddings=True)
SEQ, MP = 2048, 64
QUICK = dict(tensor="8,16,32", batches="128")
FOCUS = 128  # sequences per step the findings and panel (2) use (module docstring)
BAND = band("h100-sxm", "megatron-core")
# Megatron-LM as Narayanan et al. ran it (no TP overlap) and Megatron-Core (TP traffic overlapped with the GEMMs)
SOFTWARE = {"megatron-lm": MEGATRON, "megatron-core": MEGATRON_CORE}


def link_bytes(est, st) -> dict[tuple[str, str], float]:
    """Bytes one device sends per step, by (class, tier): class tensor / pipeline / data, tier NVLink / IB."""
    out = {}
    for c in est.collectives:
        cls = "tensor" if "tensor" in c.axes else "pipeline" if "pipeline" in c.axes else "data"
        k, m = axis_span(tuple(c.axes), st, HW.devices_per_node)
        if c.kind == "collective-permute":
            split = {"IB" if m > 1 else "NVLink": c.bytes}
        else:
            f = 2.0 if c.kind == "all-reduce" else 1.0
            split = {"NVLink": f * (k - 1) / k * c.bytes, "IB": f * (m - 1) / (m * k) * c.bytes}
        for tier, b in split.items():
            out[(cls, tier)] = out.get((cls, tier), 0.0) + b
    return out


def sweep(tensors: list[int], batches: list[int], bar) -> list[dict]:
    rows = []
    for software, batch in [(s, b) for s in SOFTWARE for b in batches]:
        for tp in tensors:
            sizes = {a: 1 for a in AXES} | {"tensor": tp, "pipeline": MP // tp}
            found = search(MODEL, HW, MP, SEQ, batch, SOFTWARE[software], keep=lambda s, z=sizes: s == z, max_tensor=MP)
            row = {"software": software, "batch": batch, "tp": tp, "pp": MP // tp,
                   "status": "OOM" if found["valid"] else "refused"}
            if 0 in found:
                est, st = found[0]
                row |= {"status": "ok", "est": est, "st": st, "bytes": link_bytes(est, st)}
            rows.append(row)
            bar.update()
    return rows


def published_rows() -> list[dict]:
    """Each Megatron-Core H100 row at every TP x PP of its model-parallel size (TP dividing the heads);
    the rows as they arrived in published_runs_h100.toml (jaxpar/cost/published/)."""
    src = published.source("megatron_core_h100")
    out = []
    for raw in src["rows"]:
        r = dict(zip(src["columns"], raw))
        a, h, l, gpus, batch = r["heads"], r["hidden"], r["layers"], r["gpus"], r["global_batch"]
        m = ModelConfig(name=f"MC {r['params_b']}B", layers=l, d_model=h, heads=a, kv_heads=a, head_dim=h // a,
                        mlp_dim=4 * h, mlp_type="gelu", vocab=src["vocab"], max_seq=src["seq"], tie_embeddings=False)
        mp = r["tp"] * r["pp"]
        for tp in (t for t in (1, 2, 4, 8, 16, 32, 64) if mp % t == 0 and a % t == 0):
            pp, dp = mp // tp, gpus // mp
            opts = dict(remat="none", sequence_parallel=tp > 1, dtype="bfloat16", zero=1)
            opts |= (dict(microbatches=batch // dp, pp_schedule="circular", pp_repeats=max(1, l // pp)) if pp > 1
                     else dict(grad_accum=batch // dp))
            row = {"model": m.name, "tp": tp, "pp": pp, "published": r["mfu_pct"] / 100 if tp == r["tp"] else None}
            try:
                st = parse_inline(f"data={dp},pipeline={pp},tensor={tp}").with_options(**opts)
                validate.check(m, st, batch=batch, seq=src["seq"], padded_zero=True)
            except ConfigError:
                out.append(row | {"mfu": None})
                continue
            est = estimate(m, st, HW, batch, src["seq"], MEGATRON_CORE)
            flops = 72 * batch * src["seq"] * l * h * h * (1 + src["seq"] / (6 * h)) + 6 * batch * src["seq"] * h * src["vocab"]
            out.append(row | {"mfu": flops / (est.step_time_s * gpus * HW.peak_flops), "fits": est.fits,
                              "gib": est.memory.total / 2**30})
    return out


def findings(rows) -> list[str]:
    """Hardware guidance at the study's batch: neighbouring TP sizes against TP=8, each called a tie or a
    lead by the error band (experiments/_study.py versus)."""
    at = {(r["software"], r["tp"]): r for r in rows if r["batch"] == FOCUS and r["status"] == "ok"}
    out = []
    for sw in SOFTWARE:
        for tp in (4, 16, 32):
            if (sw, tp) in at and (sw, 8) in at:
                a, b = at[(sw, tp)], at[(sw, 8)]
                out.append([sw, f"{tp}x{MP // tp}", pct(a["est"].mfu), pct(b["est"].mfu),
                            f"{a['est'].tokens_per_s / b['est'].tokens_per_s - 1:+.1%}",
                            versus(a["est"].tokens_per_s, b["est"].tokens_per_s, BAND)])
    if not out:
        return []
    return [f"## Findings (hardware guidance): each split against TP8 x PP8, batch {FOCUS}", "",
            *md_table(["software", "TP x PP", "MFU", "MFU of 8x8", "tokens/s vs 8x8", "verdict"], out)]


def figure(plt, rows, pub, batches):
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(14, 4.8))
    focus = FOCUS if FOCUS in batches else batches[-1]
    for j, sw in enumerate(SOFTWARE):
        for i, batch in enumerate(batches):
            mine = [r for r in rows if (r["software"], r["batch"]) == (sw, batch)]
            pts = [(r["tp"], r["est"].mfu * HW.peak_flops / 1e12) for r in mine if r["status"] == "ok"]
            ax.plot(*zip(*pts), marker="os"[j], ls=("-", "--")[j], color=OKABE_ITO[i], label=f"{sw}, batch {batch}")
            if (sw, batch) == ("megatron-core", focus):
                x, y = zip(*pts)
                ax.fill_between(x, [v * (1 - BAND) for v in y], [v * (1 + BAND) for v in y], color=OKABE_ITO[i],
                                alpha=0.2, lw=0, label=f"±{BAND:.1%} error band (ties inside)")
    oom = sorted({r["tp"] for r in rows if r["status"] == "OOM"})
    if oom:
        ax.scatter(oom, [8] * len(oom), marker="x", color="black", s=40, zorder=5, label="no option fits 80 GB")
    ax.axvspan(8.5, 80, color="0.85", zorder=0)
    ax.text(11, 40, "TP crosses the\nnode boundary", fontsize=8)
    ax.set(xscale="log", xlabel="TP x PP (64 GPUs, one replica)", ylabel="predicted model TFLOP/s per GPU",
           title=f"(1) {MODEL.name} on 64 H100, seq {SEQ:,}")
    first = [r for r in rows if (r["software"], r["batch"]) == ("megatron-lm", batches[0])]
    ax.set_xticks([r["tp"] for r in first], [f"{r['tp']}x{r['pp']}" for r in first])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6.5, loc="lower left")
    # (2) where the tensor-parallel bytes go, at the study's batch (software does not change the bytes)
    big = [r for r in rows if (r["software"], r["batch"]) == ("megatron-core", focus) and r["status"] == "ok"]
    x = list(range(len(big)))
    for j, (tier, colour) in enumerate((("NVLink", OKABE_ITO[3]), ("IB", OKABE_ITO[4]))):
        vals = [r["bytes"].get(("tensor", tier), 0.0) / 2**30 for r in big]
        bx.bar([i + (j - 0.5) * 0.4 for i in x], [max(v, 1e-9) for v in vals], 0.4, color=colour,
               hatch="//" if tier == "IB" else None, label=f"tensor-parallel bytes over {tier}")
        for i, v in zip(x, vals):
            if v == 0:
                bx.text(i + (j - 0.5) * 0.4, 12, "0", ha="center", fontsize=8, color=colour)
    bx.set_xticks(x, [f"{r['tp']}x{r['pp']}" for r in big])
    bx.set(yscale="log", ylim=(10, None), xlabel="TP x PP", ylabel="GiB sent per device per step",
           title=f"(2) TP bytes per link tier, batch {focus}")
    bx.legend(fontsize=8, loc="upper left")
    # (3) the published Megatron-Core H100 rows beside the other splits of their model-parallel size
    for i, name in enumerate(dict.fromkeys(p["model"] for p in pub)):
        colour = OKABE_ITO[(0, 2, 3, 5)[i]]
        mine = [p for p in pub if p["model"] == name and p["mfu"] is not None]
        mp = next(p["tp"] * p["pp"] for p in pub if p["model"] == name)
        cx.plot([p["tp"] for p in mine], [p["mfu"] for p in mine], color=colour, label=f"{name}, TP x PP = {mp}")
        for p in mine:
            cx.scatter([p["tp"]], [p["mfu"]], marker="o", s=28, zorder=4,
                       facecolor=colour if p["fits"] else "white", edgecolor=colour, linewidth=1.3)
        for p in pub:
            if p["model"] == name and p["published"]:
                cx.scatter([p["tp"]], [p["published"]], marker="*", s=180, color=colour, edgecolor="black", zorder=5)
    cx.scatter([], [], marker="*", s=120, color="white", edgecolor="black", label="published (Megatron-Core README)")
    cx.scatter([], [], marker="o", s=28, facecolor="white", edgecolor="black",
               label="hollow: the model says it does not fit 80 GB")
    cx.axvspan(8.5, 20, color="0.85", zorder=0)
    cx.set(xscale="log", xlabel="tensor-parallel size TP (same TP x PP)", ylabel="MFU (Megatron's formula)",
           title="(3) published H100 rows vs their other splits")
    cx.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    cx.minorticks_off()
    cx.set_ylim(0, 0.6)
    cx.legend(fontsize=6.5, loc="lower left")
    fig.suptitle("TP vs PP on H100 (cost model): TP's bytes stay on NVLink up to TP=8 and cross InfiniBand beyond, "
                 "where megatron-core's TP overlap\ndoes not reach (the model hides TP only inside a node): beyond TP=8 "
                 "MFU falls, whether the collectives are exposed (megatron-lm) or overlapped (megatron-core)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, QUICK, tensor=(str, "1,2,4,8,16,32,64", "TP sizes (PP = 64 / TP)"),
                     batches=(str, "32,128,512", "global batch sizes, sequences"))
    tensors, batches = [int(t) for t in args.tensor.split(",")], [int(b) for b in args.batches.split(",")]
    with progress(len(SOFTWARE) * len(tensors) * len(batches), "split") as bar:
        rows = sweep(tensors, batches, bar)
    pub = published_rows()
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["software"], r["batch"], f"{r['tp']}x{r['pp']}", r["status"], *["-"] * 10])
            continue
        est, st, b = r["est"], r["st"], r["bytes"]
        t = est.time.terms()
        table.append([r["software"], r["batch"], f"{r['tp']}x{r['pp']}", f"{est.mfu * HW.peak_flops / 1e12:.0f}", pct(est.mfu),
                      f"{b.get(('tensor', 'NVLink'), 0) / 2**30:.1f}", f"{b.get(('tensor', 'IB'), 0) / 2**30:.1f}",
                      f"{(b.get(('pipeline', 'NVLink'), 0) + b.get(('pipeline', 'IB'), 0)) / 2**30:.2f}",
                      *(f"{t[k]:.2f}" for k in ("compute", "bubble", "tensor comm", "pipeline comm")),
                      f"{st.options.remat}, M={st.options.microbatches}, v={st.options.pp_repeats}",
                      f"{est.memory.total / 2**30:.1f}"])
    best = {(sw, b): max((r for r in rows if (r["software"], r["batch"]) == (sw, b) and r["status"] == "ok"),
                         key=lambda r: r["est"].tokens_per_s) for sw in SOFTWARE for b in batches}
    conventions = {sw: mfu_convention(next(r["est"] for r in rows if r["status"] == "ok" and r["software"] == sw))
                   for sw in SOFTWARE}
    body = [band_line("h100-sxm", "megatron-core"), "",
            f"Tokens per step: {FOCUS} sequences of {SEQ:,} ({FOCUS * SEQ:,} tokens), the larger batch of Narayanan et "
            "al. 2021's figure 13 (32 and 128 sequences), which this study reproduces; 32 and 512 sequences are a "
            "sensitivity check only.", "",
            *(f"MFU convention, {sw} rows: {text}." for sw, text in conventions.items()),
            "(At seq 2,048 and d_model 12,288 the scores are 2.7% of the model FLOPs counted in full, 1.4% counted causal.) Panel (3) "
            "uses Megatron's own formula for the published rows (72 B s L h^2 (1 + s/6h) + 6 B s h V: the full s x s "
            "scores), as their README does.", "",
            f"{MODEL.name} (96 layers, d_model 12,288, 128 heads x 96) on {MP} H100 (8 per node), data parallelism 1, "
            f"seq {SEQ:,}; software megatron-lm (2021: TP collectives exposed, as in Narayanan et al.) and megatron-core "
            "(TP collectives overlapped with the GEMMs inside a node only: the share of a tensor group's seconds spent "
            "across InfiniBand waits, jaxpar/cost/overlap.py). Bytes: what one device sends per step, by link tier. "
            "Times: seconds per step left after overlap.", "",
            *md_table(["software", "batch", "TP x PP", "TFLOP/s/GPU", "MFU", "tensor GiB NVLink", "tensor GiB IB", "pipeline GiB",
                       "compute s", "bubble s", "tensor comm s", "pipeline comm s", "options", "GiB/device"], table), "",
            "## Best split per batch", "",
            f"Ties: the splits whose tokens/s is within ±{BAND:.1%} of the best (the error band).", "",
            *md_table(["software", "batch", "best TP x PP", "MFU", "ties with the best"],
                      [[sw, b, f"{r['tp']}x{r['pp']}", pct(r["est"].mfu),
                        ", ".join(f"{o['tp']}x{o['pp']}" for o in rows if (o["software"], o["batch"]) == (sw, b)
                                  and o["status"] == "ok" and o is not r
                                  and o["est"].tokens_per_s >= (1 - BAND) * r["est"].tokens_per_s) or "none"]
                       for (sw, b), r in best.items()]), "",
            *findings(rows), "",
            "## Published Megatron-Core H100 rows beside the other splits of their TP x PP", "",
            *md_table(["row", "TP x PP", "predicted MFU", "published MFU", "error", "fits", "GiB/device"],
                      [[p["model"], f"{p['tp']}x{p['pp']}", "refused" if p["mfu"] is None else pct(p["mfu"]),
                        pct(p["published"]) if p["published"] else "",
                        f"{p['mfu'] / p['published'] - 1:+.1%}" if p["published"] and p["mfu"] else "",
                        "" if p["mfu"] is None else
                        ("yes" if p["fits"] else "no"), "" if p["mfu"] is None else f"{p['gib']:.1f}"] for p in pub])]
    finish(args, STEM, "Study (b): TP vs PP at model-parallel size 64", body, lambda plt: figure(plt, rows, pub, batches))


if __name__ == "__main__":
    main()
