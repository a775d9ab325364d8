"""Inference: measured decode on 8 simulated CPU devices per layout, and the cost model on one H100 node.

    python experiments/bench_inference.py [--new 32] [--out DIR]
    python experiments/bench_inference.py --quick      # smoke test: a few seconds

(a) `jaxpar.serving.generate` on 8 simulated CPU devices: llama-tiny, 8 prompts of 32 tokens, --new greedy
    tokens per layout; time to first token, per-token latency and decode tokens/s (CPU figures: the
    simulated devices share this host's cores), and whether every layout generated the same tokens
    (greedy decoding is exact under every layout: tests/test_inference.py).
(b) The analytic model (jaxpar/cost/inference.py, software megatron-core: bf16 weights) for llama3-8b
    and llama3-70b on one H100 node (8 GPUs): per layout and batch, time to first token (the prefill
    of the batch), the decode step at a full cache, decode tokens/s, what bounds the step, memory per
    device and the critical batch where decode turns compute-bound. Not calibrated on published
    serving runs: read the shape of the table (which layout, which batch), not its third digit.
Writes both tables to experiments/results/bench_inference.md (or --out DIR) and decode tokens/s
against batch per layout to bench_inference.png.

--quick: layouts data=8 and tensor=8 only, 4 new tokens, the model table at batch 1 and 64, XLA's
backend optimisations off (quick timings mean nothing). Options given explicitly still win.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxpar.cost import MEGATRON_CORE  # noqa: E402
from jaxpar.cost.inference import Request, inference_estimate  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
CPU_LAYOUTS = ["data=8", "data=2,tensor=4", "data=4,tensor=2", "tensor=8"]
NODE_LAYOUTS = ["tensor=8", "data=2,tensor=4", "data=4,tensor=2", "data=8"]
QUICK = dict(new=4, layouts=["data=8", "tensor=8"], batches=[1, 64])


def measured(layouts: list[str], new: int, bar) -> list[dict]:
    import jax  # noqa: PLC0415
    from jaxpar.serving.generate import Generator  # noqa: PLC0415
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, size=(8, 32)).tolist()
    rows = []
    for mesh in layouts:
        bar.set_description(f"generate {mesh}")
        gen = Generator(parse_model("llama-tiny"), parse_inline(mesh), prompts, new, devices=jax.devices()[:8])
        result = gen.generate(gen.init_params(0), prompts)
        rows.append({"layout": mesh, "ttft": result.time_to_first_token_s,
                     "latency": result.per_token_latency_s if new > 1 else float("nan"),
                     "tokens_per_s": result.decode_tokens_per_s if new > 1 else float("nan"),
                     "tokens": result.tokens, "compile": gen.compile_s})
        bar.update()
    return rows


def modelled(batches: list[int], prompt: int, new: int) -> list[dict]:
    rows = []
    for name in ("llama3-8b", "llama3-70b"):
        m = parse_model(name)
        for mesh in NODE_LAYOUTS:
            st = parse_inline(mesh).with_options(dtype="bfloat16")
            for b in batches:
                try:
                    from jaxpar.core.validate import check_generation  # noqa: PLC0415
                    check_generation(m, st, b, prompt, new)
                except ConfigError:
                    continue
                pre = inference_estimate(m, st, "h100-sxm", Request("prefill", b, prompt, new), MEGATRON_CORE)
                dec = inference_estimate(m, st, "h100-sxm", Request("decode", b, prompt, new), MEGATRON_CORE)
                rows.append({"model": name, "layout": mesh, "batch": b, "ttft_ms": pre.step_s * 1e3,
                             "step_ms": dec.step_s * 1e3, "tokens_per_s": dec.tokens_per_s, "bound": dec.bound,
                             "mem_gib": dec.memory_total / 2**30, "fits": dec.fits,
                             "critical": dec.critical_batch})
    return rows


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    colours = ["#0072B2", "#E69F00", "#009E73", "#CC79A7"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    for ax, name in zip(axes, ("llama3-8b", "llama3-70b")):
        for colour, mesh in zip(colours, NODE_LAYOUTS):
            pts = [(r["batch"], r["tokens_per_s"]) for r in rows if r["model"] == name and r["layout"] == mesh and r["fits"]]
            if pts:
                ax.plot(*zip(*pts), "o-", color=colour, label=mesh)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences decoding together)")
        ax.set_ylabel("decode tokens/s (model, one H100 node)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt on the CPU devices")
    ap.add_argument("--layouts", nargs="+", default=CPU_LAYOUTS, help="8-device layouts to generate with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512], help="batches of the model table")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens in the model table")
    ap.add_argument("--gen", type=int, default=512, help="new tokens per sequence in the model table")
    ap.add_argument("--quick", action="store_true", help="smoke test: two layouts, a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_inference.md and .png go")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    with tqdm(total=len(args.layouts), unit="layout", disable=not sys.stdout.isatty(), leave=False) as bar:
        cpu = measured(args.layouts, args.new, bar)
    same = all(np.array_equal(r["tokens"], cpu[0]["tokens"]) for r in cpu)
    md = ["# Inference", "", f"## (a) llama-tiny on 8 simulated CPU devices, 8 prompts x 32 tokens, {args.new} new "
          "tokens (greedy; CPU figures)", "", "| layout | time to first token ms | per-token latency ms | "
          "decode tokens/s | compile s |", "|---|---:|---:|---:|---:|"]
    print(md[2])
    for r in cpu:
        line = (f"| {r['layout']} | {r['ttft'] * 1e3:.1f} | {r['latency'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} "
                f"| {r['compile']:.1f} |")
        md.append(line)
        print(line)
    verdict = f"same tokens under every layout: {'yes' if same else 'NO'}"
    md += ["", verdict]
    print(verdict)
    model_rows = modelled(args.batches, args.prompt, args.gen)
    md += ["", f"## (b) the cost model on one H100 node (8 GPUs), prompt {args.prompt}, {args.gen} new tokens, "
           "megatron-core software (bf16 weights); decode at a full cache", "",
           "| model | layout | batch | time to first token ms | decode step ms | decode tokens/s | bound "
           "| memory GiB / device | fits | critical batch |", "|---|---|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in model_rows:
        crit = f"{r['critical']:,.0f}" if r["critical"] else "never"
        md.append(f"| {r['model']} | {r['layout']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['step_ms']:.2f} "
                  f"| {r['tokens_per_s']:,.0f} | {r['bound']} | {r['mem_gib']:.1f} | {'yes' if r['fits'] else 'no'} "
                  f"| {crit} |")
    print("\n".join(md[-len(model_rows) - 4:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_inference.md").write_text("\n".join(md) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_inference.md'}; no figure: matplotlib is not installed")
    else:
        plot(model_rows, args.out / "bench_inference.png")
        print(f"\nwritten to {args.out / 'bench_inference.md'} and bench_inference.png")


if __name__ == "__main__":
    main()
