"""Study (h), inference: latency against throughput per serving layout, the critical batch, the KV cache.

    python experiments/study_inference.py            # full: batches 1 ... 512, contexts 1k ... 128k
    python experiments/study_inference.py --quick    # batches 1, 16, 256 and three contexts

Question. Serving llama3-70b on one 8-GPU H100 node or llama3-8b on a TPU v5e-8 slice, should the
devices form one tensor-parallel group (tensor=8) or several replicas (data=2 x tensor=4)? At which
batch does decoding stop being bound by HBM bandwidth, and how much context does the KV cache leave room for?

Method. The model only (jaxpar/cost/inference.py, `jaxpar estimate --phase prefill|decode`; accelerator
defaults as the command fills them: bf16): per layout and decode batch, the step time (the latency of
each new token), the node's new tokens per second, the memory per device and whether it fits; the
prefill of one prompt (time to first token); the critical batch (where a decode step's matmul time
reaches its HBM time); the KV cache per sequence as the context grows. Prompts of 2,048 tokens, 256
generated. Decoding is a roofline: max(matmul, HBM) + collectives (not overlapped); jaxpar keeps no
paged or quantised cache, so the figures are for a plain bf16 cache.
Writes experiments/results/study_inference.md and .png.
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from _study import arguments, finish, md_table, progress  # noqa: E402

from jaxpar.cost.defaults import accelerator_defaults  # noqa: E402
from jaxpar.cost.hardware import load_hardware  # noqa: E402
from jaxpar.cost.inference import cache_bytes, inference_estimate  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402

STEM = "study_inference"
SETUPS = {("llama3-70b", "h100-sxm"): ("tensor=8", "data=2,tensor=4"),
          ("llama3-8b", "tpu-v5e"): ("tensor=8", "data=2,tensor=4", "data=4,tensor=2")}
PROMPT, GENERATE = 2048, 256


def strategy(mesh: str, batch: int):
    st, _ = accelerator_defaults(parse_inline(mesh), batch, set())
    return st


def sweep(batches: list[int], bar) -> list[dict]:
    rows = []
    for (model, hw), layouts in SETUPS.items():
        m = parse_model(model)
        for mesh in layouts:
            for batch in batches:
                bar.update()
                try:
                    st = strategy(mesh, batch)
                    dec = inference_estimate(m, st, hw, batch, PROMPT, GENERATE, "decode")
                    pre = inference_estimate(m, st, hw, batch, PROMPT, GENERATE, "prefill")
                except ConfigError:
                    continue  # e.g. a batch that the replicas do not divide
                rows.append({"model": model, "hardware": hw, "layout": mesh, "batch": batch,
                             "latency_ms": 1e3 * dec.step_s, "tokens_s": dec.tokens_per_s, "bound": dec.bound,
                             "ttft_ms": 1e3 * pre.step_s, "memory_gib": dec.memory_total / 2**30,
                             "fits": dec.fits, "critical": dec.critical_batch, "comm_ms": 1e3 * dec.comm_s})
    return rows


def kv_cache(contexts: list[int]) -> list[dict]:
    """KV cache per sequence and device under tensor=8, and the sequences that fit beside the weights."""
    rows = []
    for (model, hw), _ in SETUPS.items():
        m, st, hbm = parse_model(model), strategy("tensor=8", 1), load_hardware(hw).hbm_bytes
        base = inference_estimate(m, st, hw, 1, PROMPT, GENERATE, "decode")
        for ctx in contexts:
            per_seq = cache_bytes(m, st, 1, ctx)
            rows.append({"model": model, "hardware": hw, "context": ctx, "cache_gib": per_seq / 2**30,
                         "weights_gib": base.weights_bytes / 2**30,
                         "sequences": int((hbm - base.weights_bytes) // per_seq)})
    return rows


def figure(plt, rows, kv):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (model, hw) in zip(axes, SETUPS):
        for mesh in SETUPS[(model, hw)]:
            pts = [r for r in rows if (r["model"], r["layout"]) == (model, mesh) and r["fits"]]
            line, = ax.plot([r["tokens_s"] for r in pts], [r["latency_ms"] for r in pts], marker="o", label=mesh)
            for r in pts:
                if r["batch"] in (1, 16, 256):
                    ax.annotate(f"b={r['batch']}", (r["tokens_s"], r["latency_ms"]), fontsize=6,
                                xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set(xlabel="throughput, new tokens/s per node (log)", ylabel="latency per new token, ms",
               title=f"{model} on 8 x {hw} (decode, model)")
        ax.legend(fontsize=7, title="layout", title_fontsize=7)
    cx = axes[2]
    for model, hw in SETUPS:
        pts = [r for r in kv if r["model"] == model]
        cx.plot([r["context"] for r in pts], [r["cache_gib"] for r in pts], marker="s", label=f"{model} ({hw}), tensor=8")
        cx.axhline(load_hardware(hw).hbm_bytes / 2**30 - pts[0]["weights_gib"], linestyle="--", linewidth=1,
                   color=cx.lines[-1].get_color())
    cx.set_xscale("log", base=2)
    cx.set_yscale("log")
    cx.set(xlabel="context, tokens", ylabel="KV cache per sequence per device, GiB",
           title="KV cache vs HBM left beside the weights (dashed)")
    cx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(batches="1,16,256", contexts="4096,32768,131072"),
                     batches=(str, "1,2,4,8,16,32,64,128,256,512", "decode batches"),
                     contexts=(str, "1024,4096,8192,16384,32768,65536,131072", "contexts for the KV cache"))
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with progress(sum(len(v) for v in SETUPS.values()) * len(batches), "estimate") as bar:
        rows = sweep(batches, bar)
    kv = kv_cache(contexts)
    crit = {(r["model"], r["layout"]): r["critical"] for r in rows}
    body = [f"## (1) Decode and prefill per layout (model): prompts of {PROMPT:,} tokens, {GENERATE} generated, bf16", "",
            *md_table(["model", "hardware", "layout", "batch", "latency ms/token", "tokens/s", "bound",
                       "time to first token ms", "memory GiB/device", "fits", "comm ms"],
                      [[r["model"], r["hardware"], r["layout"], r["batch"], f"{r['latency_ms']:.2f}",
                        f"{r['tokens_s']:,.0f}", r["bound"], f"{r['ttft_ms']:.1f}", f"{r['memory_gib']:.1f}",
                        "yes" if r["fits"] else "no", f"{r['comm_ms']:.3f}"] for r in rows]), "",
            "Latency: one decode step (every sequence gets one token); tokens/s: the node's new tokens per "
            "second; time to first token: the prefill of the whole batch.", "",
            "## (2) Critical batch (model): where a decode step turns compute bound", "",
            *md_table(["model", "layout", "critical batch"],
                      [[m, lay, f"{c:,.0f}" if c else "never"] for (m, lay), c in crit.items()]), "",
            "## (3) KV cache per sequence and device under tensor=8 (model, bf16)", "",
            *md_table(["model", "hardware", "context", "KV cache GiB/sequence", "weights GiB/device",
                       "sequences that fit"],
                      [[r["model"], r["hardware"], f"{r['context']:,}", f"{r['cache_gib']:.3f}",
                        f"{r['weights_gib']:.1f}", f"{r['sequences']:,}"] for r in kv])]
    print("\n".join(body))
    finish(args, STEM, "Study (h): inference", body, lambda plt: figure(plt, rows, kv))


if __name__ == "__main__":
    main()
