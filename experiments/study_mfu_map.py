"""Study (f), where MFU is won: the layout `jaxpar plan` picks per (devices, sequence length), and its MFU.

    python experiments/study_mfu_map.py            # full: 4 models x 4 device counts x 4 lengths, minutes
    python experiments/study_mfu_map.py --quick    # llama3.1-8b on 8 and 16 H100 at 4k and 128k, seconds

Question. For a dense transformer (Llama 3.1 8B and 70B), a state-space model (Mamba-2 2.7B) and a
mixture of experts (Mixtral 8x7B), which layout should one rent at each (cluster size, sequence
length), and what MFU does it reach?

Method. `jaxpar plan` itself (jaxpar.planning.planner.plan, fastest first, plans within the cost model's
band marked as ties; its search space is in its docstring: data, fsdp, pipeline,
context, expert for MoE models, tensor inside a node, ZeRO 0/1/3, remat, micro-batches, GPipe / 1F1B /
interleaved) for every cell: devices in {8, 64, 512, 4,096} x sequence length in {4k, 16k, 64k, 128k}
(Mixtral's max_seq is 32k: its longest column is 32k). Each cell shows plan's first layout (the fastest) and its MFU, and how the cell compares with the smallest cluster where that sequence
fits (`versus`, within the band: a tie, or a gap). An empty cell means nothing fits (or the batch has
fewer sequences than any valid layout needs).

Conventions. 16M tokens per step (global batch = 16M / seq sequences), Llama 3's published batch (Dubey
et al. 2024, table 4), so the cells compare at one optimiser-step size; MFU as jaxpar.cost.report's
mfu_convention prints it (causal attention); band: megatron-core on the H100 family, out of sample
(jaxpar/cost/bands.toml).

Assumptions. h100-sxm, software megatron-core (fused attention; TP, DP and PP communication
overlapped). Mamba-2 2.7B with max_seq raised to 131,072 (the checkpoint was trained at 2,048; the
shapes do not depend on it). What the cost model prices at scale: per collective a latency of
alpha x steps as NCCL's tuning model counts them (all-gathers and reduce-scatters a ring through every rank,
all-reduces a tree across nodes: jaxpar/cost/time.py) and the bytes over each link tier; megatron-core's overlap hides the data-parallel, tensor and pipeline collectives under compute
(jaxpar/cost/software.py). It does not price stragglers, failures and restarts, congestion between jobs
or across the fabric's tiers, or the data loader. Writes experiments/results/study_mfu_map.md and .png.
"""
from __future__ import annotations

import time

from _study import arguments, band, band_line, finish, layout, md_table, pct, progress, versus

from jaxpar.planning import planner
from jaxpar.cost import MEGATRON_CORE, load_hardware
from jaxpar.cost.report import mfu_convention
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model

STEM = "study_mfu_map"
HW = load_hardware("h100-sxm")
MODELS = ("llama3.1-8b", "llama3.1-70b", "mamba2-2.7b:max_seq=131072", "mixtral-8x7b")
TOKENS = 16 * 2**20
BAND = band("h100-sxm", "megatron-core")
QUICK = dict(models="llama3.1-8b", devices="8,16", seqs="4096,131072")
# Dubey et al. 2024, table 4: Llama 3 405B at seq 8,192, TFLOP/s per GPU on 8,192 and on 16,384 H100
PUBLISHED_SCALING = ((8192, 430), (16384, 400))


def cell(name: str, devices: int, seq: int) -> dict:
    """plan's first layout (the fastest) and its MFU; where the step's time goes: the exposed communication share and the data-parallel
    collectives' hidden share."""
    m = parse_model(name)
    seq = min(seq, m.max_seq)
    try:
        results, considered, valid = planner.plan(m, HW, devices, seq, TOKENS // seq, top=50, software=MEGATRON_CORE)
    except ConfigError as e:
        return {"model": name, "devices": devices, "seq": seq, "why": str(e)}
    out = {"model": name, "devices": devices, "seq": seq, "considered": considered, "valid": valid}
    if results:
        est, st = results[0]
        t = est.time
        exposed = t.tensor + t.context + t.pipeline + t.expert + t.data
        out |= {"mfu": est.mfu, "layout": layout(st), "remat": st.options.remat, "gib": est.memory.total / 2**30,
                "tokens_per_s": est.tokens_per_s, "dominant": est.dominant, "exposed": exposed / t.total,
                "dp_hidden": 1 - t.data / t.data_total if t.data_total else None, "est": est}
    return out


def compare(cells: list[dict]) -> None:
    """Each fitting cell against the smallest cluster where the same model fits at that sequence length
    (`base`, `versus`: a tie within the band, or the gap)."""
    for c in cells:
        base = min((b for b in cells if (b["model"], b["seq"]) == (c["model"], c["seq"]) and "mfu" in b),
                   key=lambda b: b["devices"], default=None)
        if "mfu" in c and base is not None:
            c["base"], c["versus"] = base["devices"], versus(c["mfu"], base["mfu"], BAND)
            c["tie"] = c["versus"].startswith("a tie")


def figure(plt, cells, models, devices):
    cols = 2 if len(models) > 1 else 1
    rows_ = -(-len(models) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.6 * cols, 4.2 * rows_ + 0.6), squeeze=False)
    cmap = plt.get_cmap("cividis")  # perceptually uniform and readable with colour-vision deficiencies
    for ax, name in zip(axes.flat, models):
        seqs = sorted({c["seq"] for c in cells if c["model"] == name})
        at = {(c["devices"], c["seq"]): c for c in cells if c["model"] == name}
        data = [[at.get((n, s), {}).get("mfu", float("nan")) for s in seqs] for n in devices]
        im = ax.imshow(data, cmap=cmap, vmin=0.15, vmax=0.5, origin="lower", aspect="auto")
        for i, n in enumerate(devices):
            for j, s in enumerate(seqs):
                c = at.get((n, s), {})
                if "mfu" not in c:
                    ax.text(j, i, "nothing fits", ha="center", va="center", fontsize=7, color="0.3")
                    continue
                words = c["layout"].replace("ZeRO-1", "Z1").split()
                text = pct(c["mfu"]) + "\n" + " ".join(words[:2]) + ("\n" + " ".join(words[2:]) if words[2:] else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black" if c["mfu"] > 0.33 else "white")
                if not c.get("tie", True):   # outside the band of the column's smallest fitting cluster
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", ec="0.55", lw=0))
        ax.set_xticks(range(len(seqs)), [f"{s // 1024}k" for s in seqs])
        ax.set_yticks(range(len(devices)), [f"{n:,}" for n in devices])
        ax.set(xlabel="sequence length (tokens)", ylabel="H100 GPUs", title=name.split(":")[0])
        ax.grid(False)
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.subplots_adjust(wspace=0.35, hspace=0.3, top=0.84 if rows_ > 1 else 0.8)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="predicted MFU of plan's layout (Z1: ZeRO-1)", shrink=0.7)
    fig.suptitle(f"Where MFU is won: jaxpar plan's layout per cell\n({TOKENS // 2**20}M tokens/step, megatron-core, "
                 f"h100-sxm; hatched: outside the band ±{BAND:.1%}\nof the smallest cluster that fits that length)",
                 fontsize=9)
    return fig


def main() -> None:
    args = arguments(__doc__, QUICK, models=(str, ",".join(MODELS), "models (comma-separated)"),
                     devices=(str, "8,64,512,4096", "device counts"),
                     seqs=(str, "4096,16384,65536,131072", "lengths (clipped to each model's max_seq)"))
    models, devices = args.models.split(","), [int(d) for d in args.devices.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    work = [(m, n, s) for m in models for n in devices for s in seqs
            if s <= parse_model(m).max_seq or s == min(x for x in seqs if x >= parse_model(m).max_seq)]
    t0, cells = time.perf_counter(), []
    with progress(len(work), "cell") as bar:
        for m, n, s in work:
            bar.set_description(f"{m.split(':')[0]} {n} x {s}")
            cells.append(cell(m, n, s))
            bar.update()
    compare(cells)
    body = head(cells) + [*md_table(["model", "devices", "seq", "MFU", "plan's layout", "remat", "GiB/device",
                                     "vs smallest cluster", "exposed comm", "DP comm hidden",
                                     "dominant term"], [row(c) for c in cells]),
                          "", f"{len(work)} cells in {time.perf_counter() - t0:.1f} s"]
    finish(args, STEM, "Study (f): where MFU is won", body, lambda plt: figure(plt, cells, models, devices))


def row(c: dict) -> list:
    if "mfu" not in c:
        return [c["model"].split(":")[0], c["devices"], f"{c['seq']:,}", "-", c.get("why", "nothing fits"),
                *[""] * 6]
    hidden = "-" if c["dp_hidden"] is None else pct(c["dp_hidden"])
    return [c["model"].split(":")[0], c["devices"], f"{c['seq']:,}", pct(c["mfu"]), c["layout"], c["remat"],
            f"{c['gib']:.1f}", "-" if c["base"] == c["devices"] else f"{c['versus']} vs {c['base']:,}",
            pct(c["exposed"]), hidden, c["dominant"]]


def head(cells: list[dict]) -> list[str]:
    """The results file's conventions and the published scaling it is read against."""
    est = next(c["est"] for c in cells if "est" in c)
    (n0, tf0), (n1, tf1) = PUBLISHED_SCALING
    return [band_line("h100-sxm", "megatron-core"), "",
            f"Tokens per step: {TOKENS // 2**20}M ({TOKENS:,}; global batch = {TOKENS:,} / seq sequences), Llama 3's "
            "published batch (Dubey et al. 2024, table 4), one optimiser-step size for every cell.", "",
            mfu_convention(est) + ".", "",
            f"`jaxpar plan --software megatron-core --hardware h100-sxm` per cell: `plan's layout` is its first, the "
            "fastest; `vs smallest cluster`: the cell against the smallest cluster where the model fits at that length, "
            "a tie within the band or the gap; `exposed comm`: collective time not hidden under compute, share of the "
            "step; `DP comm hidden`: share of the data-parallel collectives hidden. `-`: nothing fits.", "",
            f"What the model prices at scale (h100-sxm): per collective {HW.alpha_intra * 1e6:.1f} µs per step over "
            f"NVLink and {HW.alpha_inter * 1e6:.0f} µs per step across nodes (NCCL's ring latencies), all-gathers and "
            "reduce-scatters a ring through every rank, all-reduces a tree across nodes (log2 of the nodes), the bytes "
            "over NVLink and InfiniBand; megatron-core hides the data-parallel, tensor and pipeline collectives under "
            "compute. Not priced: stragglers, failures and restarts, congestion across the fabric, the data loader.", "",
            f"Published, for comparison: Llama 3 405B at seq 8,192 ran {tf0} TFLOP/s per GPU on {n0:,} H100 and "
            f"{tf1} on {n1:,} (Dubey et al. 2024, table 4): {versus(tf1, tf0, BAND)} (different layouts: DP64 and "
            "DP128, 32 and 16 sequences per data-parallel rank).", ""]


if __name__ == "__main__":
    main()
