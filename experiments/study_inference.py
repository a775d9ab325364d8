"""Study (h), inference: latency against throughput per serving layout, the critical batch, the KV cache,
and the model beside TensorRT-LLM's published throughput.

    python experiments/study_inference.py            # full: batches 1 ... 512 and the largest that fits
    python experiments/study_inference.py --quick    # batches 1, 16, 256 and three contexts

Question. Serving llama3-70b on one 8-GPU H100 node or llama3-8b on a TPU v5e-8 slice, should the
devices form one tensor-parallel group (tensor=8) or several replicas (data=2 x tensor=4)? At which
batch does decoding stop being bound by HBM bandwidth, and how much context does the KV cache leave room for?

Method. The cost model only (jaxpar/cost/inference.py, `jaxpar estimate --phase prefill|decode`), for a
stack that stores bf16 weights (2 bytes per parameter: the megatron-core preset's serve_weight_bytes on
H100, MaxText's on TPU): per layout and decode batch, the step time (the latency of each new token),
the node's new tokens per second, the memory per device and whether it fits; the prefill of the batch
(time to first token); the critical batch (where a decode step's matmul time reaches its HBM time); the
KV cache per sequence as the context grows. Decoding is a roofline: max(matmul, HBM) + collectives (not
overlapped), a plain bf16 cache (no paging, no quantisation). Against TensorRT-LLM's published
throughput (v0.14 perf overview: FP16 weights, maximum load, in-flight batching): each row predicted at
the largest batch that fits its full cache, as batch x new tokens / (the batch's prefill + new tokens x
one decode step at the mean cache, prompt + half the new tokens).
Requests: 2,048 prompt tokens (TensorRT-LLM's longer published input length) and 256 new tokens;
the TensorRT-LLM rows at their own lengths.
Writes experiments/results/study_inference.md and .png.
"""
from __future__ import annotations

import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from _study import ROOT, arguments, band_line, finish, md_table, progress  # noqa: E402

from jaxpar.cost import published  # noqa: E402
from jaxpar.cost.defaults import accelerator_defaults  # noqa: E402
from jaxpar.cost.hardware import load_hardware  # noqa: E402
from jaxpar.cost.inference import Request, cache_bytes, inference_estimate  # noqa: E402
from jaxpar.cost.software import JAXPAR, MAXTEXT, MEGATRON_CORE  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402

STEM = "study_inference"
SETUPS = {("llama3-70b", "h100-sxm"): ("tensor=8", "data=2,tensor=4"),
          ("llama3-8b", "tpu-v5e"): ("tensor=8", "data=2,tensor=4", "data=4,tensor=2")}
SOFTWARE = {"h100-sxm": MEGATRON_CORE, "tpu-v5e": MAXTEXT}
PROMPT, GENERATE = 2048, 256
TRTLLM = "trtllm_v0_14_perf_overview"
NAMES = {"llama3_1_8b": "llama3-8b", "llama3_1_70b": "llama3-70b"}  # Llama 3.1 has Llama 3's shapes


def strategy(mesh: str, batch: int, dtype: str = "bfloat16"):
    st, _ = accelerator_defaults(parse_inline(mesh), batch, set())
    return st.with_options(dtype=dtype)


def row(m, mesh: str, hw: str, batch: int, software=None, dtype: str = "bfloat16") -> dict:
    software = software or SOFTWARE[hw]
    st = strategy(mesh, batch, dtype)
    dec = inference_estimate(m, st, hw, Request("decode", batch, PROMPT, GENERATE), software)
    pre = inference_estimate(m, st, hw, Request("prefill", batch, PROMPT, GENERATE), software)
    return {"model": m.name, "hardware": hw, "layout": mesh, "batch": batch, "latency_ms": 1e3 * dec.step_s,
            "tokens_s": dec.tokens_per_s, "bound": dec.bound, "ttft_ms": 1e3 * pre.step_s,
            "memory_gib": dec.memory_total / 2**30, "weights_gib": dec.weights_bytes / 2**30, "fits": dec.fits,
            "critical": dec.critical_batch, "comm_ms": 1e3 * dec.comm_s, "hbm_ms": 1e3 * dec.memory_s}


def largest_fitting(m, mesh: str, hw: str, prompt: int, generate: int, software, step: int = 1) -> int:
    """The largest batch (a multiple of `step`, the replicas) whose decode at the full cache fits; 0: none."""
    def fits(b):
        try:
            return inference_estimate(m, strategy(mesh, b), hw, Request("decode", b, prompt, generate), software).fits
        except ConfigError:
            return False
    if not fits(step):
        return 0
    hi = step
    while fits(2 * hi) and hi < 2**16:
        hi *= 2
    lo, width = hi, hi // 2
    while width >= step:
        if fits(lo + width):
            lo += width
        width //= 2
    return lo


def sweep(batches: list[int], bar) -> list[dict]:
    rows = []
    for (model, hw), layouts in SETUPS.items():
        m = parse_model(model)
        for mesh in layouts:
            replicas = parse_inline(mesh).sizes["data"]
            top = largest_fitting(m, mesh, hw, PROMPT, GENERATE, SOFTWARE[hw], replicas)
            for batch in sorted(set(batches) | ({top} if top else set())):
                bar.update()
                try:
                    rows.append(row(m, mesh, hw, batch) | {"largest": batch == top})
                except ConfigError:
                    continue  # a batch that the replicas do not divide
    return rows


def kv_cache(contexts: list[int]) -> list[dict]:
    """KV cache per sequence and device under tensor=8, and the sequences that fit beside the weights."""
    rows = []
    for (model, hw), _ in SETUPS.items():
        m, st, hbm = parse_model(model), strategy("tensor=8", 1), load_hardware(hw).hbm_bytes
        base = inference_estimate(m, st, hw, Request("decode", 1, PROMPT, GENERATE), SOFTWARE[hw])
        for ctx in contexts:
            per_seq = cache_bytes(m, st, 1, ctx)
            rows.append({"model": model, "hardware": hw, "context": ctx, "cache_gib": per_seq / 2**30,
                         "weights_gib": base.weights_bytes / 2**30,
                         "sequences": int((hbm - base.weights_bytes) // per_seq)})
    return rows


def published_rows() -> list[dict]:
    """TensorRT-LLM's rows (jaxpar/cost/published/, as they arrived in published_runs_stacks.toml)."""
    src = published.source(TRTLLM)
    return [dict(zip(src["columns"], r)) for r in src["rows"]]


def versus_trtllm() -> list[dict]:
    """Each published row predicted at the largest batch that fits (module docstring)."""
    out = []
    for r in published_rows():
        m, isl, osl = parse_model(NAMES[r["model"]]), r["isl"], r["osl"]
        mesh = f"tensor={r['tp']}" if r["tp"] > 1 else "data=1"
        b = largest_fitting(m, mesh, "h100-sxm", isl, osl, MEGATRON_CORE)
        st = strategy(mesh, b)
        pre = inference_estimate(m, st, "h100-sxm", Request("prefill", b, isl, osl), MEGATRON_CORE)
        dec = inference_estimate(m, st, "h100-sxm", Request("decode", b, isl, osl // 2 + 1), MEGATRON_CORE)
        tokens_s = b * osl / (pre.step_s + osl * dec.step_s)
        out.append({"model": r["model"], "tp": r["tp"], "isl": isl, "osl": osl, "batch": b, "bound": dec.bound,
                    "predicted": tokens_s, "published": r["output_tokens_per_s"],
                    "error": tokens_s / r["output_tokens_per_s"] - 1, "prefill_s": pre.step_s,
                    "decode_ms": 1e3 * dec.step_s})
    return out


def own_program() -> list[dict]:
    """jaxpar's own generate serving in float32 (`--dtype float32`: it stores the weights in the serving
    dtype) beside bfloat16: llama3-70b, tensor=8, on H100."""
    m = parse_model("llama3-70b")
    return [row(m, "tensor=8", "h100-sxm", b, JAXPAR, dtype) for dtype in ("float32", "bfloat16") for b in (1, 256)]


def figure(plt, rows, trt, kv):
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (model, hw) in zip(axes[0], SETUPS):
        missing = []
        for mesh in SETUPS[(model, hw)]:
            pts = [r for r in rows if (r["model"], r["layout"]) == (model, mesh) and r["fits"]]
            if not pts:
                missing.append(mesh)
                continue
            ax.plot([r["tokens_s"] for r in pts], [r["latency_ms"] for r in pts], marker="o", label=mesh)
            for r in pts:
                if r["batch"] in (1, 16, 256) or r["largest"]:
                    ax.annotate(f"b={r['batch']}", (r["tokens_s"], r["latency_ms"]), fontsize=6,
                                xytext=(3, 3), textcoords="offset points")
        if missing:
            ax.text(0.98, 0.02, "fits at no batch: " + ", ".join(missing), transform=ax.transAxes, fontsize=7, ha="right")
        ax.set_xscale("log")
        ax.set(xlabel="throughput, new tokens/s per node (log)", ylabel="latency per new token, ms",
               title=f"{model} on 8 x {hw} (decode, model, bf16)")
        ax.legend(fontsize=7, title="layout", title_fontsize=7, loc="upper left")
    bx = axes[1][0]
    if trt:
        x = range(len(trt))
        bx.bar([i - 0.2 for i in x], [r["published"] for r in trt], 0.4, label="TensorRT-LLM v0.14 (published)")
        bx.bar([i + 0.2 for i in x], [r["predicted"] for r in trt], 0.4, label="model, largest batch that fits")
        bx.set_xticks(list(x), [f"{NAMES[r['model']]}\nTP{r['tp']} {r['isl']}/{r['osl']}" for r in trt], fontsize=7)
        bx.set(ylabel="output tokens/s per TP group", title="maximum-load throughput, H100 (no band: uncalibrated)")
        bx.legend(fontsize=7)
    else:
        bx.text(0.5, 0.5, "published runs not found", ha="center", transform=bx.transAxes)
    cx = axes[1][1]
    for model, hw in SETUPS:
        pts = [r for r in kv if r["model"] == model]
        cx.plot([r["context"] for r in pts], [r["cache_gib"] for r in pts], marker="s", label=f"{model} ({hw}), tensor=8")
        cx.axhline(load_hardware(hw).hbm_bytes / 2**30 - pts[0]["weights_gib"], linestyle="--", linewidth=1,
                   color=cx.lines[-1].get_color())
    cx.set_xscale("log", base=2)
    cx.set_yscale("log")
    cx.set(xlabel="context, tokens", ylabel="KV cache per sequence per device, GiB",
           title="KV cache vs HBM left beside the bf16 weights (dashed)")
    cx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(batches="1,16,256", contexts="4096,32768,131072"),
                     batches=(str, "1,2,4,8,16,32,64,128,256,512", "decode batches"),
                     contexts=(str, "1024,4096,8192,16384,32768,65536,131072", "contexts for the KV cache"))
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with progress(sum(len(v) for v in SETUPS.values()) * (len(batches) + 1), "estimate") as bar:
        rows = sweep(batches, bar)
    kv, trt, own = kv_cache(contexts), versus_trtllm(), own_program()
    body = report(rows, kv, trt, own)
    print("\n".join(body))
    finish(args, STEM, "Study (h): inference", body, lambda plt: figure(plt, rows, trt, kv))


def report(rows, kv, trt, own) -> list[str]:
    h100 = load_hardware("h100-sxm")
    crit = {(r["model"], r["hardware"], r["layout"]): r["critical"] for r in rows}
    head = [band_line("h100-sxm", "tensorrt-llm") + " The cost model is calibrated on training runs only; "
            "section (3) shows how far its serving figures are from TensorRT-LLM's published ones.", "",
            f"Requests: {PROMPT:,} prompt tokens (TensorRT-LLM's longer published input length) and {GENERATE} new "
            "tokens; a decode step is costed at its full cache (its slowest). Weights, activations and KV cache "
            "in bf16 (2 bytes), as Megatron-style serving and TensorRT-LLM's FP16 engines store them.", ""]
    sec1 = [f"## (1) Decode and prefill per layout (model): prompts of {PROMPT:,} tokens, {GENERATE} generated, bf16 weights",
            "", *md_table(["model", "hardware", "layout", "batch", "latency ms/token", "tokens/s", "bound",
                           "time to first token ms", "memory GiB/device", "fits", "HBM ms", "comm ms"],
                          [[r["model"], r["hardware"], r["layout"], f"{r['batch']}" + (" (largest)" if r["largest"] else ""),
                            f"{r['latency_ms']:.2f}", f"{r['tokens_s']:,.0f}", r["bound"], f"{r['ttft_ms']:.1f}",
                            f"{r['memory_gib']:.1f}", "yes" if r["fits"] else "no", f"{r['hbm_ms']:.2f}",
                            f"{r['comm_ms']:.3f}"] for r in rows]), "",
            "Latency: one decode step (every sequence gets one token); tokens/s: the node's new tokens per "
            "second; time to first token: the prefill of the whole batch; (largest): the largest batch that fits "
            "(a multiple of the replicas). comm: the tensor-parallel all-reduces, at NCCL's latency per ring step "
            f"({h100.alpha_intra * 1e6:.1f} us over NVLink on H100, its tuning model's; not fitted), which sets most "
            "of the batch-1 latency.", ""]
    roofline = h100.peak_flops / h100.hbm_bw
    sec2 = ["## (2) Critical batch (model): where a decode step turns compute bound", "",
            *md_table(["model", "hardware", "layout", "critical batch"],
                      [[m, hw, lay, f"{c:,.0f}" if c else "never"] for (m, hw, lay), c in crit.items()]), "",
            f"The weights-only roofline of one H100 (bf16: peak / HBM bandwidth x 2 bytes / 2 FLOPs per parameter "
            f"per token) is {roofline:,.0f} sequences per tensor group; the model's critical batch is larger because "
            "each sequence also reads its own KV cache and the matmuls run at the calibrated efficiency.", ""]
    return head + sec1 + sec2 + trt_section(trt) + kv_section(kv) + own_section(own)


def trt_section(trt) -> list[str]:
    errs = [abs(r["error"]) for r in trt]
    return ["## (3) Against TensorRT-LLM's published maximum-load throughput (H100 SXM, FP16 engines, v0.14)", "",
            *md_table(["model", "TP", "input/output tokens", "largest batch that fits (model)", "bound",
                       "prefill s", "decode ms/step", "output tokens/s (model)", "output tokens/s (published)", "error"],
                      [[r["model"], r["tp"], f"{r['isl']}/{r['osl']}", f"{r['batch']:,}", r["bound"],
                        f"{r['prefill_s']:.2f}", f"{r['decode_ms']:.2f}", f"{r['predicted']:,.0f}",
                        f"{r['published']:,.0f}", f"{r['error']:+.1%}"] for r in trt]), "",
            f"Median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(trt)} rows "
            f"(source {TRTLLM}: 'All data ... generated using version 0.14.0'; output tokens/s of the whole TP group). "
            "Short requests (128/128) are compute bound at thousands of sequences and land near the published "
            "figures; long ones (2048/2048) are bound by the KV cache, where the model overestimates: it gives the "
            "whole HBM beside the weights to the cache and streams it at the datasheet bandwidth, while "
            "TensorRT-LLM keeps a share of memory back (its KV cache takes a fraction of the free memory) and "
            "schedules prefills between decode steps.", ""]


def kv_section(kv) -> list[str]:
    return ["## (4) KV cache per sequence and device under tensor=8 (model, bf16)", "",
            *md_table(["model", "hardware", "context", "KV cache GiB/sequence", "weights GiB/device",
                       "sequences that fit"],
                      [[r["model"], r["hardware"], f"{r['context']:,}", f"{r['cache_gib']:.3f}",
                        f"{r['weights_gib']:.1f}", f"{r['sequences']:,}"] for r in kv]), ""]


def own_section(own) -> list[str]:
    return ["## (5) jaxpar's own program: its generate in float32 or bfloat16 (llama3-70b, tensor=8, H100, model)", "",
            "Not hardware guidance: jaxpar's generate stores the weights in its strategy's dtype "
            "(jaxpar/serving/generate.py), so `--dtype float32` serves the float32 master weights and reads twice "
            "the bytes per token.", "",
            *md_table(["dtype", "batch", "latency ms/token", "tokens/s", "weights GiB/device", "critical batch"],
                      [[("float32" if r["weights_gib"] > 20 else "bfloat16"), r["batch"], f"{r['latency_ms']:.2f}",
                        f"{r['tokens_s']:,.0f}", f"{r['weights_gib']:.1f}",
                        f"{r['critical']:,.0f}" if r["critical"] else "never"] for r in own])]


if __name__ == "__main__":
    main()
