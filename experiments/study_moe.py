"""Study (h, second half), MoE: expert parallelism or tensor parallelism for the experts inside a node?

    python experiments/study_moe.py            # Mixtral- and Qwen3-like on 64 and 512 H100 + 3 compiled layouts
    python experiments/study_moe.py --quick    # 64 H100 + ep8 and tp8 compiled (1 layer, backend optimisation off)

Question. A mixture-of-experts layer can split its experts over an `expert` axis (each device holds
whole experts; tokens travel to their experts' owners and back by all-to-all: expert parallelism, EP)
or split every expert's width over `tensor` (each device holds a slice of every expert; activations
are all-reduced / reduce-scattered as in any Megatron MLP: TP), or both. Inside one 8-GPU node, which
wins, what does each move, and what does it hold?

Method. (1) Modelled: for a Mixtral-8x7B-like model (8 experts of width 14,336, top-2) and a
Qwen3-30B-A3B-like one (128 experts of width 768, top-8, 4 KV heads) the best fitting layout (by
tokens/s, jaxpar.cost.estimate with software megatron-core) among those with EP e x TP t = 8 inside each
node (e in 8, 4, 2, 1) and data parallelism (DP, ZeRO-1 or FSDP) across nodes, no pipeline or context
(the search of experiments/_study.py: remat, accumulation, ZeRO stage); per layout its step time, MFU,
memory per GPU and bytes per GPU per step: the expert all-to-alls, the tensor-parallel collectives and
the rest. Global batch 512 x 4,096 tokens. (2) Compiled: moe-tiny (kv_heads 8 so that tensor=8 divides
them) on 8 simulated CPU devices under ep8, tp8 and ep4-tp2 (experiments/_bench.py: the HLO tally),
beside the cost model's bytes for the same step (XLA:CPU traits).

Assumptions. h100-sxm (8 GPUs per NVLink node). megatron-core overlaps tensor-parallel collectives with
the GEMMs but leaves the expert all-to-alls exposed (jaxpar/cost/software.py); dropless routing with
perfect balance (imbalance 1: a skewed router costs EP more). Qwen3's 4 KV heads forbid TP8
(jaxpar.core.validate: tensor must divide kv_heads), so its TP-only column is empty by construction.
Writes experiments/results/study_moe.md and .png.
"""
from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

from _bench import compiled_step  # noqa: E402
from _study import arguments, finish, layout, md_table, pct, progress, search  # noqa: E402

from jaxpar.cost import MEGATRON_CORE, load_hardware  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_strategy  # noqa: E402

STEM = "study_moe"
HW = load_hardware("h100-sxm")
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
INNER = ((8, 1), (4, 2), (2, 4), (1, 8))  # (expert, tensor) inside the node
BATCH, SEQ = 512, 4096
COMPILED = "moe-tiny:kv_heads=8"


def in_node(e: int, t: int):
    return lambda sizes: (sizes["expert"], sizes["tensor"]) == (e, t) and sizes["pipeline"] == sizes["context"] == 1


def modelled(name: str, devices: int) -> list[dict]:
    m, rows = parse_model(name), []
    for e, t in INNER:
        best = search(m, HW, devices, SEQ, BATCH, MEGATRON_CORE, keep=in_node(e, t))
        row = {"model": name, "devices": devices, "inner": f"EP{e} TP{t}", "e": e, "t": t,
               "valid": sum(best["valid"].values())}
        if 0 in best:
            est, st = best[0]
            cs = est.collectives
            a2a = sum(c.bytes for c in cs if c.kind == "all-to-all" and "expert" in c.axes)
            tensor = sum(c.bytes for c in cs if "tensor" in c.axes)
            row |= {"layout": layout(st), "remat": st.options.remat, "accum": st.options.grad_accum,
                    "step_s": est.step_time_s, "mfu": est.mfu, "gib": est.memory.total / 2**30,
                    "a2a": a2a, "tensor": tensor, "other": sum(c.bytes for c in cs) - a2a - tensor,
                    "expert_s": est.time.expert, "tensor_s": est.time.tensor,
                    "tokens_per_device": BATCH * SEQ * t / devices}
        rows.append(row)
    return rows


def compiled(meshes: list[str], model: str, batch: int, seq: int, bar) -> list[dict]:
    rows = []
    for mesh in meshes:
        bar.set_description(f"compile {mesh}")
        r = compiled_step(model, parse_strategy(mesh), batch, seq, steps=1)
        tally, pred = r["tally"], r["predicted"]

        def split(cs):
            a2a = sum(c.bytes for c in cs if c.kind == "all-to-all" and "expert" in c.axes)
            tensor = sum(c.bytes for c in cs if "tensor" in c.axes)
            return a2a, tensor, sum(c.bytes for c in cs)
        (a2a, tensor, total), (pa2a, ptensor, ptotal) = split(tally), split(pred)
        rows.append({"mesh": mesh, "a2a": a2a, "tensor": tensor, "total": total, "pa2a": pa2a, "ptensor": ptensor,
                     "ptotal": ptotal, "argument": r["memory"].argument_size_in_bytes})
        bar.update()
    return rows


def figure(plt, mod, comp):
    models = sorted({r["model"] for r in mod}, key=MODELS.index)
    devices = min(r["devices"] for r in mod)  # the headline case; larger counts in the table
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.2 * (len(models) + 1), 3.9))
    for ax, name in zip(axes, models):
        rows = [r for r in mod if r["model"] == name and r["devices"] == devices]
        x = range(len(rows))
        gib = 2**30
        parts = [("expert all-to-all", "a2a"), ("tensor collectives", "tensor"), ("other (data, ZeRO)", "other")]
        bottom = [0.0] * len(rows)
        for label, key in parts:
            vals = [r.get(key, 0) / gib for r in rows]
            ax.bar(x, vals, 0.6, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(rows):
            ax.text(i, bottom[i], f"{100 * r['mfu']:.1f}%" if "mfu" in r else "refused", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r["inner"] for r in rows])
        ax.set_ylim(0, 1.15 * max(bottom + [1]))
        ax.set(ylabel="GiB per GPU per step (model)", title=f"{name}, {devices} H100 (label: MFU)")
        ax.legend(fontsize=7)
    cx = axes[-1]
    x = range(len(comp))
    cx.bar([i - 0.2 for i in x], [r["ptotal"] / 2**20 for r in comp], 0.4, label="cost model")
    cx.bar([i + 0.2 for i in x], [r["total"] / 2**20 for r in comp], 0.4, label="compiled (HLO tally)")
    cx.set_xticks(list(x), [r["mesh"] for r in comp])
    cx.set(ylabel="collective MiB per device per step", title="moe-tiny, 8 simulated CPU devices")
    cx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(devices="64", meshes="ep8,tp8", model=COMPILED + ",layers=1", batch=8, seq=16),
                     devices=(str, "64,512", "H100 counts (comma-separated)"),
                     meshes=(str, "ep8,tp8,ep4-tp2", "compiled layouts"), model=(str, COMPILED, "compiled model"),
                     batch=(int, 16, "compiled global batch"), seq=(int, 32, "compiled sequence length"))
    cells = [(name, int(d)) for name in MODELS for d in args.devices.split(",")]
    meshes = args.meshes.split(",")
    mod = []
    with progress(len(cells) + len(meshes), "config") as bar:
        for name, d in cells:
            bar.set_description(f"{name} on {d}")
            mod += modelled(name, d)
            bar.update()
        comp = compiled(meshes, args.model, args.batch, args.seq, bar)
    gib, kib = 2**30, 2**10
    mrows = [[r["model"], f"{r['devices']:,}", r["inner"], r.get("layout", "refused" if not r["valid"] else "OOM"),
              r.get("remat", ""), r.get("accum", ""),
              *([f"{r['step_s']:.3f}", pct(r["mfu"]), f"{r['gib']:.1f}", f"{r['tokens_per_device']:,.0f}",
                 f"{r['a2a'] / gib:.1f}", f"{r['tensor'] / gib:.1f}", f"{r['other'] / gib:.1f}",
                 f"{r['expert_s']:.3f}", f"{r['tensor_s']:.3f}"] if "mfu" in r else [""] * 9)] for r in mod]
    winners = []
    for name, d in cells:
        fit = [r for r in mod if (r["model"], r["devices"]) == (name, d) and "mfu" in r]
        if fit:
            w = max(fit, key=lambda r: r["mfu"])
            winners.append(f"- {name} on {d:,} H100: best inside the node {w['inner']} ({w['layout']}, {pct(w['mfu'])} MFU)")
    body = [f"## (1) Expert vs tensor parallelism inside an 8-GPU H100 node, data parallelism across nodes "
            f"(model, megatron-core, batch {BATCH} x {SEQ}, bf16)", "",
            *md_table(["model", "GPUs", "inside node", "best layout", "remat", "accum", "step s", "MFU", "GiB/GPU",
                       "tokens routed/GPU/step", "expert all-to-all GiB/GPU", "tensor GiB/GPU", "other GiB/GPU",
                       "exposed expert s", "exposed tensor s"], mrows), "",
            "refused: no layout with that split is valid (Qwen3: tensor=8 does not divide 4 KV heads); OOM: none fits. "
            "Bytes: every collective's buffer per GPU per step (the model's records, as the HLO tally counts them); "
            "exposed: the seconds left on the critical path after the software's overlap. Tokens routed per GPU: the "
            "batch is split over every axis but tensor, so each tensor rank dispatches its group's tokens.", "",
            *winners, "",
            f"## (2) Compiled confirmation: {args.model} on 8 simulated CPU devices, batch {args.batch} x {args.seq}, float32",
            "",
            *md_table(["layout", "expert all-to-all KiB (compiled)", "expert all-to-all KiB (model)",
                       "tensor KiB (compiled)", "tensor KiB (model)", "total KiB (compiled)", "total KiB (model)",
                       "total error", "state+batch KiB/device"],
                      [[r["mesh"], f"{r['a2a'] / kib:.1f}", f"{r['pa2a'] / kib:.1f}", f"{r['tensor'] / kib:.1f}",
                        f"{r['ptensor'] / kib:.1f}", f"{r['total'] / kib:.1f}", f"{r['ptotal'] / kib:.1f}",
                        f"{r['ptotal'] / r['total'] - 1:+.2%}", f"{r['argument'] / kib:.1f}"] for r in comp])]
    print("\n".join(body))
    finish(args, STEM, "Study (h, MoE): expert vs tensor parallelism for the experts", body,
           lambda plt: figure(plt, mod, comp))


if __name__ == "__main__":
    main()
