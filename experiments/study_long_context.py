"""Study (c), long context: from 4k to 128k tokens, when does context parallelism (CP) become necessary?

    python experiments/study_long_context.py            # full: 3 models x 6 lengths on 64 H100, ~20 s
    python experiments/study_long_context.py --quick    # llama3.1-70b and mamba2-2.7b at 8k and 128k, seconds

Question. As the sequence grows from 4,096 to 131,072 tokens: (1) how does activation memory per
device grow, for attention (Llama 3.1) and for Mamba-2; (2) at which length does nothing fit without
CP, or CP win anyway; (3) on one 8-GPU node, how do CP (ring, all-gather; contiguous or zigzag token
layout), TP and TP + sequence parallelism (SP) compare for one long sequence per device?

Method. (1) the analytic model's activation bytes per device at the backward pass's peak
(jaxpar/cost/memory.py), one sequence on 8 devices: Llama under TP8 + SP, Mamba-2 (whose heads cannot
be split: ngroups = 1) on one device's share with no split; software megatron-core (fused attention:
memory linear in the sequence) and, for contrast, jaxpar's program with its dense kernel (the s x s scores
in HBM). In (2) jaxpar plans with `attention_kernel = auto`, the kernel a run picks on an H100 (cuDNN's
fused kernel), as `jaxpar plan` does.
(2) on 64 H100 (8 nodes), 8M tokens per step (64 x 131,072 tokens, so data parallelism 64 stays
possible at every length: the question is memory, not batch), the best fitting layout with context = 1
against the best with context > 1 (experiments/_study.py search over the planner's candidates).
(3) one node, seq 65,536, 8 sequences per step, each layout's best fitting remat.

Assumptions. h100-sxm (calibrated), software megatron-core unless a row says jaxpar. Pipeline x context
is refused by jaxpar.core.validate ("not supported yet"), so CP layouts here never pipeline. The cost model
prices ring and all-gather CP alike in bytes ((c-1)/c of K and V either way) and hides both under the
attention core; it counts attention as the full s x s (Megatron's formula), so the contiguous layout's
causal imbalance is not in it: this study adds it for a kernel that skips masked blocks, from the
closed form (device i of c computes i + 1/2 blocks of (s/c)^2 scores: the busiest c - 1/2 against a
balanced c/2, so contiguous attention takes (2c-1)/c of zigzag's), as bench_context_parallel.py measures.
Writes experiments/results/study_long_context.md and .png.
"""
from __future__ import annotations

import dataclasses

from _study import OKABE_ITO, arguments, finish, layout, md_table, pct, progress, search

from jaxpar.core import validate
from jaxpar.cost import JAXPAR, MEGATRON_CORE, estimate, load_hardware
from jaxpar.cost.flops import TRAIN_FACTOR, attention_core_flops
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import parse_inline

STEM = "study_long_context"
HW = load_hardware("h100-sxm")
MODELS = ("llama3.1-8b", "llama3.1-70b", "mamba2-2.7b:max_seq=131072")
DEVICES, TOKENS = 64, 64 * 131072
QUICK = dict(seqs="8192,131072", models="llama3.1-70b,mamba2-2.7b:max_seq=131072", node_seq=0)
SOFTWARE = {"megatron-core": MEGATRON_CORE, "jaxpar": JAXPAR}
JAXPAR_TOO = "llama3.1-70b"  # part (2) also for jaxpar's own program (its auto kernel)


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
    return {"model": name.split(":")[0], "software": software, "seq": seq, "no CP": found.get(False), "CP": found.get(True)}


# inside each 8-GPU node; FSDP8 across the 8 nodes shards parameters and optimizer state (jaxpar does not
# shard them over `context` or `tensor`-replicated copies, Megatron's distributed optimizer would)
NODE_LAYOUTS = (("FSDP64 (sequence unsplit)", "fsdp=64", {}), ("TP8", "fsdp=8,tensor=8", {}),
                ("TP8 + SP", "fsdp=8,tensor=8", dict(sequence_parallel=True)),
                ("CP8 ring", "fsdp=8,context=8", dict(attention="ring")),
                ("CP8 ring, zigzag", "fsdp=8,context=8", dict(attention="ring", cp_layout="zigzag")),
                ("CP8 all-gather", "fsdp=8,context=8", dict(attention="allgather")),
                ("TP4 + SP, CP2 ring", "fsdp=8,context=2,tensor=4", dict(attention="ring", sequence_parallel=True)),
                ("TP2 + SP, CP4 ring", "fsdp=8,context=4,tensor=2", dict(attention="ring", sequence_parallel=True)))
NODE_BATCH = 64


def node_layouts(name: str, seq: int) -> list[list]:
    """64 H100, 64 sequences: each in-node layout x FSDP8 across nodes (one sequence per micro-batch),
    its fastest fitting remat; contiguous vs zigzag causal imbalance from the closed form."""
    m, rows = parse_model(name), []
    for label, mesh, opts in NODE_LAYOUTS:
        if not m.has_attention and (opts.get("attention") == "allgather" or "tensor" in mesh):
            continue  # Mamba-2: no attention kernel to choose; no TP (ngroups = 1, see the table note)
        best, why = None, "OOM"
        for remat in ("none", "dots_no_batch", "full"):
            st = parse_inline(mesh).with_options(dtype="bfloat16", remat=remat, **opts)
            st = st.with_options(grad_accum=NODE_BATCH // (st.sizes["fsdp"] * st.sizes["data"]))
            try:
                validate.check(m, st, batch=NODE_BATCH, seq=seq, padded_zero=True)
            except ConfigError as e:
                why = f"refused: {e}"
                break
            est = estimate(m, st, HW, NODE_BATCH, seq, MEGATRON_CORE)
            if est.fits and (best is None or est.step_time_s < best[0].step_time_s):
                best = (est, st)
        if best is None:
            rows.append([name.split(":")[0], label, why, "", "", "", "", ""])
            continue
        est, st = best
        c = st.sizes["context"]
        step = est.step_time_s
        if m.has_attention and c > 1 and st.options.cp_layout == "contiguous":
            # causal imbalance: the busiest device's attention core takes (2c-1)/c of the balanced one's
            core = (attention_core_flops(m, NODE_BATCH, seq, True).matmul * m.attention_layers * TRAIN_FACTOR
                    / st.num_devices / (HW.peak_flops * HW.matmul_efficiency))
            step += core * ((2 * c - 1) / c - 1)
        rows.append([name.split(":")[0], label, f"{NODE_BATCH * seq / step / st.num_devices:,.0f}", f"{step:.2f}",
                     f"{est.memory.total / 2**30:.1f}", f"{est.memory.activations / 2**30:.1f}",
                     f"{sum(c.wire_bytes for c in est.collectives) / 2**30:.1f}", st.options.remat])
    return rows


def figure(plt, seqs, acts, cp_rows):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 5.6))
    styles = {"megatron-core, dots_no_batch": ("-", "o"), "megatron-core, full": ("--", "s"), "jaxpar, full": (":", "v")}
    for i, name in enumerate(acts):
        for key, (ls, mk) in styles.items():
            ax.plot(seqs, [acts[name][s][key] for s in seqs], ls=ls, marker=mk, color=OKABE_ITO[i], ms=4,
                    label=f"{name.split(':')[0]}: {key.replace('dots_no_batch', 'selective')}")
    ax.axhline(HW.hbm_bytes / 2**30, color="black", lw=0.8)
    ax.text(seqs[0], HW.hbm_bytes / 2**30 * 1.15, "H100 HBM (80 GB)", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation GiB per device",
           title="(1) activations for one sequence (Llama: TP8 + SP; Mamba-2: unsplit)")
    ax.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    ax.minorticks_off()
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    for i, case in enumerate(dict.fromkeys((r["model"], r["software"]) for r in cp_rows)):
        colour = OKABE_ITO[i if case[1] == "megatron-core" else 4]
        for key, ls, mk in (("no CP", "--", "s"), ("CP", "-", "o")):
            pts = [(r["seq"], r[key][0].mfu) for r in cp_rows if (r["model"], r["software"]) == case and r[key]]
            if pts:
                bx.plot(*zip(*pts), ls=ls, marker=mk, color=colour, ms=4, label=f"{case[0]} ({case[1]}), "
                        + ("context = 1" if key == "no CP" else "context > 1 allowed"))
            for r in cp_rows:
                if (r["model"], r["software"]) == case and not r[key]:
                    bx.scatter([r["seq"]], [0.02 + 0.025 * i], marker="x", color=colour, s=40)
    bx.text(seqs[0], 0.13, "x: nothing fits with context = 1", fontsize=8)
    bx.set(xscale="log", xlabel="sequence length (tokens)", ylabel="best predicted MFU", ylim=(0, 0.6),
           title=f"(2) best layout on {DEVICES} H100, {TOKENS // 2**20}M tokens/step: with and without CP")
    bx.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    bx.minorticks_off()
    bx.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.suptitle("Long context: activations grow linearly with fused attention (quadratically without); "
                 "CP takes over where nothing else fits (h100-sxm)", fontsize=10)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, QUICK, seqs=(str, "4096,8192,16384,32768,65536,131072", "sequence lengths"),
                     models=(str, ",".join(MODELS), "models (comma-separated)"),
                     node_seq=(int, 65536, "sequence length of the one-node layout table (0: skip)"))
    seqs, models = [int(s) for s in args.seqs.split(",")], args.models.split(",")
    with progress(len(models) * len(seqs) * 2, "cell") as bar:
        acts = {}
        for name in models:
            acts[name] = {}
            for s in seqs:
                acts[name][s] = activations(name, s)
                bar.update()
        cp_rows = []
        cases = [(n, "megatron-core") for n in models] + [(n, "jaxpar") for n in models if n == JAXPAR_TOO]
        bar.total += len(seqs) * (len(cases) - len(models))
        for name, software in cases:
            for s in seqs:
                cp_rows.append(with_and_without_cp(name, software, s))
                bar.update()
    keys = list(next(iter(next(iter(acts.values())).values())))
    body = ["## (1) Activation GiB per device, one sequence (Llama: TP8 + SP on 8 devices; Mamba-2: unsplit)", "",
            *md_table(["model", "seq", *[k.replace("dots_no_batch", "selective") for k in keys]],
                      [[n.split(":")[0], f"{s:,}", *(f"{acts[n][s][k]:.2f}" for k in keys)] for n in models for s in seqs]),
            "", f"## (2) Best layout on {DEVICES} H100, {TOKENS:,} tokens per step, with and without CP", "",
            *md_table(["model", "software", "seq", "best without CP", "MFU without CP", "best with CP", "MFU with CP", "CP needed"],
                      [[r["model"], r["software"], f"{r['seq']:,}",
                        layout(r["no CP"][1]) if r["no CP"] else "nothing fits", pct(r["no CP"][0].mfu) if r["no CP"] else "OOM",
                        layout(r["CP"][1]) if r["CP"] else "nothing fits", pct(r["CP"][0].mfu) if r["CP"] else "OOM",
                        "yes" if r["CP"] and not r["no CP"] else "wins" if r["CP"] and r["CP"][0].tokens_per_s
                        > r["no CP"][0].tokens_per_s else "no"] for r in cp_rows])]
    if args.node_seq:
        rows = [row for n in ("llama3.1-8b", "mamba2-2.7b:max_seq=131072") for row in node_layouts(n, args.node_seq)]
        body += ["", f"## (3) Inside a node: CP vs TP vs SP, seq {args.node_seq:,}, 64 H100 (FSDP8 across the 8 nodes), "
                 f"{NODE_BATCH} sequences per step, one per micro-batch", "",
                 "Contiguous CP rows include the causal imbalance (module docstring); zigzag rows are balanced. "
                 "Mamba-2 rows: no causal imbalance (a scan does the same work per token), and no TP: tensor must "
                 "divide ngroups = 1 (jaxpar.core.validate).", "",
                 *md_table(["model", "layout", "tokens/s/GPU", "step s", "GiB/device", "activation GiB",
                            "comm GiB/device", "remat"], rows)]
    finish(args, STEM, "Study (c): long context", body, lambda plt: figure(plt, seqs, acts, cp_rows))


if __name__ == "__main__":
    main()
