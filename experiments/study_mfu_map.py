"""Study (f), where MFU is won: the layout that maximises predicted MFU per (devices, sequence length).

    python experiments/study_mfu_map.py            # full: 3 models x 4 device counts x 4 lengths, ~1 min
    python experiments/study_mfu_map.py --quick    # llama3.1-8b on 8 and 512 H100 at 4k and 128k, seconds

Question. For a dense transformer (Llama 3.1 8B and 70B), a state-space model (Mamba-2 2.7B) and a
mixture of experts (Mixtral 8x7B), which layout should one rent at each (cluster size, sequence
length), and what MFU does it reach?

Method. `jaxpar plan` itself (jaxpar.planning.planner.plan, top 1, ranked by tokens/s; its search space is in
its docstring: data, fsdp, pipeline, context, expert for MoE models, tensor inside a node, ZeRO 0/1/3,
remat, micro-batches, GPipe / 1F1B / interleaved) for every cell: devices in {8, 64, 512, 4,096} x sequence
length in {4k, 16k, 64k, 128k} (Mixtral's max_seq is 32k: its longest column is 32k), 16M tokens per
step (Llama 3's batch: global batch = 16M / seq sequences). Each cell shows the winner's MFU and
layout; an empty cell means nothing fits (or the batch has fewer sequences than any valid layout needs).

Assumptions. h100-sxm (calibrated on the Megatron-Core H100 rows), software megatron-core (fused
attention; TP, DP and PP communication overlapped). Mamba-2 2.7B with max_seq raised to 131,072 (the
checkpoint was trained at 2,048; the shapes do not depend on it). The planner's limits apply: no
pipeline x context (jaxpar.planning.planner.check_plannable), no pipeline with MoE layers, context parallelism by ring attention.
Writes experiments/results/study_mfu_map.md and .png.
"""
from __future__ import annotations

import time

from _study import arguments, finish, layout, md_table, pct, progress

from jaxpar.planning import planner
from jaxpar.cost import MEGATRON_CORE, load_hardware
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model

STEM = "study_mfu_map"
HW = load_hardware("h100-sxm")
MODELS = ("llama3.1-8b", "llama3.1-70b", "mamba2-2.7b:max_seq=131072", "mixtral-8x7b")
TOKENS = 16 * 2**20
QUICK = dict(models="llama3.1-8b", devices="8,512", seqs="4096,131072")


def cell(name: str, devices: int, seq: int) -> dict:
    m = parse_model(name)
    seq = min(seq, m.max_seq)
    try:
        results, considered, valid = planner.plan(m, HW, devices, seq, TOKENS // seq, top=1, software=MEGATRON_CORE)
    except ConfigError as e:
        return {"model": name, "devices": devices, "seq": seq, "why": str(e)}
    out = {"model": name, "devices": devices, "seq": seq, "considered": considered, "valid": valid}
    if results:
        est, st = results[0]
        out |= {"mfu": est.mfu, "layout": layout(st), "remat": st.options.remat, "gib": est.memory.total / 2**30,
                "tokens_per_s": est.tokens_per_s, "dominant": est.dominant}
    return out


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
        ax.set_xticks(range(len(seqs)), [f"{s // 1024}k" for s in seqs])
        ax.set_yticks(range(len(devices)), [f"{n:,}" for n in devices])
        ax.set(xlabel="sequence length (tokens)", ylabel="H100 GPUs", title=name.split(":")[0])
        ax.grid(False)
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.subplots_adjust(wspace=0.35, hspace=0.3)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="predicted MFU of the best layout (Z1: ZeRO-1)", shrink=0.7)
    fig.suptitle(f"Where MFU is won: jaxpar plan's best layout per cell ({TOKENS // 2**20}M tokens/step, "
                 "megatron-core, h100-sxm)", fontsize=10)
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
    rows = [[c["model"].split(":")[0], c["devices"], f"{c['seq']:,}", pct(c["mfu"]) if "mfu" in c else "-",
             c.get("layout", c.get("why", "nothing fits")), c.get("remat", ""), f"{c['gib']:.1f}" if "gib" in c else "",
             c.get("dominant", "")] for c in cells]
    body = [f"`jaxpar plan --software megatron-core --hardware h100-sxm --top 1` per cell, global batch = "
            f"{TOKENS:,} tokens / seq. `-`: nothing fits.", "",
            *md_table(["model", "devices", "seq", "MFU", "best layout", "remat", "GiB/device", "dominant term"], rows),
            "", f"{len(work)} cells in {time.perf_counter() - t0:.1f} s"]
    finish(args, STEM, "Study (f): where MFU is won", body, lambda plt: figure(plt, cells, models, devices))


if __name__ == "__main__":
    main()
