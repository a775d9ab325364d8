"""Study (c), long context: from 4k to 128k tokens, when does context parallelism (CP) become necessary?

    python experiments/study_long_context.py            # full: 4 models x 6 lengths on 64 H100, a minute or two
    python experiments/study_long_context.py --quick    # llama3.1-70b and mamba2-2.7b at 8k and 128k, seconds

Question. As the sequence grows from 4,096 to 131,072 tokens: (1) how does activation memory per
device grow, for attention (Llama 3.1) and for Mamba-2; (2) at which length does nothing fit without
CP, or CP win anyway; (3) on one 8-GPU node, how do CP (ring, all-gather; contiguous or zigzag token
layout), TP and TP + sequence parallelism (SP) compare for one long sequence per device?

Method. (1) the analytic model's activation bytes per device at the backward pass's peak
(jaxpar/cost/memory.py), one sequence on 8 devices: Llama under TP8 + SP, Mamba-2 2.7B (one B/C group,
ngroups = 1: tensor parallelism must divide the groups, so its mixer cannot be split) on one device's
share with no split; software megatron-core (fused attention: memory linear in the sequence). The
appendix adds jaxpar's own program with its dense kernel (the s x s scores in HBM), in (2) planned with
`attention_kernel = auto`, as `jaxpar plan` does.
(2) on 64 H100 (8 nodes), 8M tokens per step at every length (module constant TOKENS: the batch Llama 3's
pre-training ran at 8k sequences, Dubey et al. 2024 sec. 3.4.1; 64 sequences of 128k, so data
parallelism 64 stays possible at every length: the question is memory, not batch), the best fitting
layout without CP (context = 1) against the best with CP (context >= 2) (experiments/_study.py search
over the planner's candidates), the two compared within the cost model's error band; Mamba-2 2.7B as
published (ngroups = 1) and with 8 groups (which lets TP split it).
(3) one node's worth of each layout x FSDP8 across 8 nodes, seq 65,536, the same 8M tokens per step
(128 sequences, one per micro-batch), each layout's best fitting remat.

Assumptions. h100-sxm (calibrated), software megatron-core unless a row says jaxpar (the appendix). The
cost model prices ring and all-gather CP alike in bytes ((c-1)/c of K and V either way) and hides both
under the attention core; it spreads attention's causal half of the s x s scores evenly over the
context shards (a balanced layout), so the contiguous layout's causal imbalance is not in it: this
study adds it for a kernel that skips masked blocks, from the
closed form (device i of c computes i + 1/2 blocks of (s/c)^2 scores: the busiest c - 1/2 against a
balanced c/2, so contiguous attention takes (2c-1)/c of zigzag's), as bench_context_parallel.py measures.
Writes experiments/results/study_long_context.md and .png.
"""
from __future__ import annotations

from _study import OKABE_ITO, arguments, band, band_line, finish, layout, md_table, pct, progress, search, versus

from jaxpar.core import validate
from jaxpar.cost import JAXPAR, MEGATRON_CORE, estimate, load_hardware
from jaxpar.cost.flops import TRAIN_FACTOR, attention_core_flops
from jaxpar.cost.report import mfu_convention
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import parse_inline

STEM = "study_long_context"
HW = load_hardware("h100-sxm")
MODELS = ("llama3.1-8b", "llama3.1-70b", "mamba2-2.7b:max_seq=131072", "mamba2-2.7b:max_seq=131072,ngroups=8")
DEVICES, TOKENS = 64, 64 * 131072
QUICK = dict(seqs="8192,131072", models="llama3.1-70b;mamba2-2.7b:max_seq=131072", node_seq=65536)
BAND = band("h100-sxm", "megatron-core")
SOFTWARE = {"megatron-core": MEGATRON_CORE, "jaxpar": JAXPAR}
JAXPAR_TOO = "llama3.1-70b"  # part (2) also for jaxpar's own program (its auto kernel): the appendix


def label(name: str) -> str:
    """A model's name in the tables: 'mamba2-2.7b' (as published, one group) or 'mamba2-2.7b, 8 groups'."""
    m = parse_model(name)
    return name.split(":")[0] + (f", {m.ngroups} groups" if not m.has_attention and m.ngroups > 1 else "")


def activations(name: str, seq: int) -> dict[str, float]:
    """GiB of activations per device for one sequence: remat none / selective / full, two software."""
    m = parse_model(name)
    mesh = "tensor=8" if m.has_attention else "data=1"
    out = {}
    for software, sw in (("megatron-core", MEGATRON_CORE), ("jaxpar", JAXPAR)):
        for remat in ("dots_no_batch", "full"):
            st = parse_inline(mesh).with_options(dtype="bfloat16", remat=remat, sequence_parallel=m.has_attention)
            out[f"{software}, {remat}"] = estimate(m, st, HW, 1, seq, sw).memory.activations / 2**30
    return out


def with_and_without_cp(name: str, software: str, seq: int) -> dict:
    m = parse_model(name)
    found = search(m, HW, DEVICES, seq, TOKENS // seq, SOFTWARE[software], key=lambda st: st.sizes["context"] > 1,
                   keep=lambda s: s["data"] == 1 or s["fsdp"] == 1)
    return {"model": label(name), "software": software, "seq": seq, "no CP": found.get(False), "CP": found.get(True)}


def verdict(r: dict, share: float) -> str:
    """Is CP necessary (nothing fits without it), ahead, a tie or behind, by the error band `share`."""
    if not r["CP"] or not r["no CP"]:
        return "necessary" if r["CP"] else "nothing fits" if not r["no CP"] else "no CP layout fits"
    return "CP " + versus(r["CP"][0].tokens_per_s, r["no CP"][0].tokens_per_s, share)


# inside each 8-GPU node; FSDP8 across the 8 nodes shards parameters and optimizer state (jaxpar does not
# shard them over `context` or `tensor`-replicated copies, Megatron's distributed optimizer would)
NODE_LAYOUTS = (("FSDP64 (sequence unsplit)", "fsdp=64", {}), ("TP8", "fsdp=8,tensor=8", {}),
                ("TP8 + SP", "fsdp=8,tensor=8", dict(sequence_parallel=True)),
                ("CP8 ring", "fsdp=8,context=8", dict(attention="ring")),
                ("CP8 ring, zigzag", "fsdp=8,context=8", dict(attention="ring", cp_layout="zigzag")),
                ("CP8 all-gather", "fsdp=8,context=8", dict(attention="allgather")),
                ("TP4 + SP, CP2 ring", "fsdp=8,context=2,tensor=4", dict(attention="ring", sequence_parallel=True)),
                ("TP2 + SP, CP4 ring", "fsdp=8,context=4,tensor=2", dict(attention="ring", sequence_parallel=True)))
NODE_BATCH = TOKENS // 65536  # 8M tokens per step at the node table's 64k


def node_layouts(name: str, seq: int) -> list[list]:
    """64 H100, NODE_BATCH sequences: each in-node layout x FSDP8 across nodes (one sequence per micro-batch),
    its fastest fitting remat; contiguous vs zigzag causal imbalance from the closed form."""
    m, rows = parse_model(name), []
    for title, mesh, opts in NODE_LAYOUTS:
        if not m.has_attention and opts.get("attention") == "allgather":
            continue  # Mamba-2: no attention kernel to choose
        best, why = None, "OOM"
        for remat in ("none", "dots_no_batch", "full"):
            st = parse_inline(mesh).with_options(dtype="bfloat16", remat=remat, **opts)
            st = st.with_options(grad_accum=NODE_BATCH // (st.sizes["fsdp"] * st.sizes["data"]))
            try:
                validate.check(m, st, batch=NODE_BATCH, seq=seq, padded_zero=True)
            except ConfigError as e:
                why = "refused: tensor must divide ngroups" if "ngroups" in str(e) else "refused"
                break
            est = estimate(m, st, HW, NODE_BATCH, seq, MEGATRON_CORE)
            if est.fits and (best is None or est.step_time_s < best[0].step_time_s):
                best = (est, st)
        if best is None:
            rows.append([label(name), title, why, "", "", "", "", ""])
            continue
        est, st = best
        c = st.sizes["context"]
        step = est.step_time_s
        if m.has_attention and c > 1 and st.options.cp_layout == "contiguous":
            # causal imbalance: the busiest device's attention core takes (2c-1)/c of the balanced one's
            core = (attention_core_flops(m, NODE_BATCH, seq, True).matmul * m.attention_layers * TRAIN_FACTOR
                    / st.num_devices / (HW.peak_flops * HW.matmul_efficiency))
            step += core * ((2 * c - 1) / c - 1)
        rows.append([label(name), title, f"{NODE_BATCH * seq / step / st.num_devices:,.0f}", f"{step:.2f}",
                     f"{est.memory.total / 2**30:.1f}", f"{est.memory.activations / 2**30:.1f}",
                     f"{sum(c.wire_bytes for c in est.collectives) / 2**30:.1f}", st.options.remat])
    return rows


def figure(plt, seqs, acts, cp_rows):
    """(1) activations per device, fused attention (megatron-core); (2) the best layout's MFU without CP and
    with CP, OOM drawn inside a labelled 'nothing fits' band. jaxpar's dense kernel: the appendix table only."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 5.8))
    styles = {"megatron-core, dots_no_batch": ("-", "o"), "megatron-core, full": ("--", "s")}
    for i, name in enumerate(n for n in acts if "groups" not in label(n)):
        for key, (ls, mk) in styles.items():
            ax.plot(seqs, [acts[name][s][key] for s in seqs], ls=ls, marker=mk, color=OKABE_ITO[i], ms=4,
                    label=f"{label(name)}: {key.split(', ')[1].replace('dots_no_batch', 'selective')} recompute")
    ax.axhline(HW.hbm_bytes / 2**30, color="black", lw=0.8)
    ax.text(seqs[0], HW.hbm_bytes / 2**30 * 1.15, f"H100 HBM (80 GB = {HW.hbm_bytes / 2**30:.1f} GiB)", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation GiB per device",
           title="(1) activations for one sequence, fused attention\n(Llama: TP8 + SP; Mamba-2, 1 group: unsplit)")
    ax.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    ax.minorticks_off()
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    floor = 0.04
    bx.axhspan(0, floor, facecolor="0.9", edgecolor="0.6", hatch="///", lw=0)
    cases = [c for c in dict.fromkeys((r["model"], r["software"]) for r in cp_rows) if c[1] == "megatron-core"]
    for i, case in enumerate(cases):
        for key, ls, mk, what in (("no CP", "--", "s", "without CP (context = 1)"), ("CP", "-", "o", "with CP (context >= 2)")):
            mine = [r for r in cp_rows if (r["model"], r["software"]) == case]
            pts = [(r["seq"], r[key][0].mfu) for r in mine if r[key]]
            if pts:
                bx.plot(*zip(*pts), ls=ls, marker=mk, color=OKABE_ITO[i], ms=4, label=f"{case[0]}, {what}")
            lost = [r["seq"] for r in mine if not r[key]]
            bx.scatter(lost, [floor / 2] * len(lost), marker="x", color=OKABE_ITO[i], s=50, zorder=5)
    bx.text(seqs[0], floor * 1.25, "x in the hatched band: nothing fits 80 GB (that curve has no layout there)",
            fontsize=8)
    bx.set(xscale="log", xlabel="sequence length (tokens)", ylabel="best predicted MFU", ylim=(0, 0.6),
           title=f"(2) best layout on {DEVICES} H100, {TOKENS // 2**20}M tokens/step, megatron-core\n"
                 f"without CP vs with CP (closer than ±{BAND:.1%}: a tie)")
    bx.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    bx.minorticks_off()
    bx.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.suptitle("Long context (cost model, h100-sxm): with fused attention activations grow linearly; CP is necessary "
                 "only where nothing else fits", fontsize=10)
    fig.tight_layout()
    return fig


def cp_table(rows: list[dict], share: float, who: str = "software") -> list[str]:
    return md_table(["model", who, "seq", "best without CP", "MFU without CP", "best with CP", "MFU with CP",
                     "CP verdict"],
                    [[r["model"], r["software"], f"{r['seq']:,}",
                      layout(r["no CP"][1]) if r["no CP"] else "nothing fits", pct(r["no CP"][0].mfu) if r["no CP"] else "OOM",
                      layout(r["CP"][1]) if r["CP"] else "nothing fits", pct(r["CP"][0].mfu) if r["CP"] else "OOM",
                      verdict(r, share)] for r in rows])


def node_finding(rows: list[list]) -> list[str]:
    """Zigzag CP8 against TP8 + SP for llama3.1-8b, by the error band."""
    got = {(r[0], r[1]): r for r in rows}
    cp, tp = got.get(("llama3.1-8b", "CP8 ring, zigzag")), got.get(("llama3.1-8b", "TP8 + SP"))
    if not cp or not tp or not (cp[2][:1].isdigit() and tp[2][:1].isdigit()):
        return []
    a, b = (float(r[2].replace(",", "")) for r in (cp, tp))
    return [f"Finding: llama3.1-8b, CP8 zigzag against TP8 + SP: {a:,.0f} against {b:,.0f} tokens/s per GPU, "
            f"{versus(a, b, BAND)}; CP8 moves {cp[6]} GiB per device against TP8 + SP's {tp[6]}."]


def main() -> None:
    args = arguments(__doc__, QUICK, seqs=(str, "4096,8192,16384,32768,65536,131072", "sequence lengths"),
                     models=(str, ";".join(MODELS), "models (semicolon-separated: a model's overrides hold commas)"),
                     node_seq=(int, 65536, "sequence length of the one-node layout table (0: skip)"))
    seqs, models = [int(s) for s in args.seqs.split(",")], args.models.split(";")
    with progress(len(models) * len(seqs) * 2, "cell") as bar:
        acts = {}
        for name in models:
            acts[name] = {}
            for s in seqs:
                acts[name][s] = activations(name, s)
                bar.update()
        cp_rows = []
        cases = [(n, "megatron-core") for n in models] + [(n, "jaxpar") for n in models
                                                         if n == JAXPAR_TOO and not args.quick]  # appendix: full mode
        bar.total += len(seqs) * (len(cases) - len(models))
        for name, software in cases:
            for s in seqs:
                cp_rows.append(with_and_without_cp(name, software, s))
                bar.update()
    mine = [r for r in cp_rows if r["software"] == "megatron-core"]
    example = next(r[k][0] for r in mine for k in ("no CP", "CP") if r[k])
    body = [band_line("h100-sxm", "megatron-core"), "",
            f"Tokens per step: {TOKENS:,} (8M) at every length: the batch Llama 3's pre-training ran at 8k sequences "
            "(Dubey et al. 2024, sec. 3.4.1: 4M, then 8M, then 16M tokens); 64 sequences of 128k, so data "
            "parallelism 64 stays possible at every length and the question is memory, not batch.", "",
            f"MFU convention: {mfu_convention(example)}.", "",
            "## (1) Activation GiB per device, one sequence, fused attention (Llama: TP8 + SP on 8 devices; "
            "Mamba-2: unsplit)", "",
            *md_table(["model", "seq", "megatron-core, selective", "megatron-core, full"],
                      [[label(n), f"{s:,}", *(f"{acts[n][s][f'megatron-core, {k}']:.2f}" for k in ("dots_no_batch", "full"))]
                       for n in models for s in seqs]),
            "", f"## (2) Best layout on {DEVICES} H100, {TOKENS:,} tokens per step, without and with CP (megatron-core)", "",
            "CP verdict: necessary where nothing fits without CP; otherwise the best with CP against the best "
            f"without, a tie inside ±{BAND:.1%}. Mamba-2 2.7B as published has one B/C group (ngroups = 1): "
            "tensor parallelism must divide the groups, so only CP (or FSDP) splits it; with 8 groups TP8 can.", "",
            *cp_table(mine, BAND)]
    if args.node_seq:
        rows = [row for n in ("llama3.1-8b", "mamba2-2.7b:max_seq=131072", "mamba2-2.7b:max_seq=131072,ngroups=8")
                for row in node_layouts(n, args.node_seq)]
        body += ["", f"## (3) Inside a node: CP vs TP vs SP, seq {args.node_seq:,}, 64 H100 (FSDP8 across the 8 nodes), "
                 f"{NODE_BATCH} sequences per step, one per micro-batch", "",
                 "Contiguous CP rows include the causal imbalance (module docstring); zigzag rows are balanced. "
                 "Mamba-2 rows: no causal imbalance (a scan does the same work per token); TP only where tensor "
                 "divides ngroups (jaxpar.core.validate).", "",
                 *md_table(["model", "layout", "tokens/s/GPU", "step s", "GiB/device", "activation GiB",
                            "comm GiB/device", "remat"], rows), "", *node_finding(rows)]
    ours = [r for r in cp_rows if r["software"] == "jaxpar"]
    body += ["", "## APPENDIX: jaxpar's own program (its dense attention kernel), not hardware guidance", "",
             "Activation GiB per device for one sequence when the s x s scores sit in HBM (jaxpar's dense kernel; "
             "no GPU training stack runs attention this way), same layouts as (1):", "",
             *md_table(["model", "seq", "jaxpar dense, selective", "jaxpar dense, full"],
                       [[label(n), f"{s:,}", *(f"{acts[n][s][f'jaxpar, {k}']:.2f}" for k in ("dots_no_batch", "full"))]
                        for n in models if parse_model(n).has_attention for s in seqs])]
    if ours:
        body += ["", "jaxpar's program planned as `jaxpar plan` plans it (attention_kernel = auto); no published jaxpar "
                 "run calibrates it, so no band applies:", "", *cp_table(ours, 0.0, "program")]
    finish(args, STEM, "Study (c): long context", body, lambda plt: figure(plt, seqs, acts, cp_rows))


if __name__ == "__main__":
    main()
