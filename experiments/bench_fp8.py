"""Float8 training on 8 devices: step time and collectives of bfloat16 against the float8 recipes, and
the loss curves of each recipe against bfloat16.

    python experiments/bench_fp8.py [--steps 3] [--curve-steps 200] [--out DIR]
    python experiments/bench_fp8.py --quick      # smoke test: llama-tiny, a few seconds

One model (a 33M llama: d_model 512, 8 layers, 8 heads of 64, MLP 1536, vocab 32000), batch 16 x seq 512,
one train step per precision (bfloat16; float8 tensorwise, rowwise, blockwise) under fsdp8 on 8 simulated
CPU devices: the fastest of --steps steps after a compile step, the compiled step's collectives (HLO
tally: all-gathers, and the all-reduces, whose count shows the scales' amax reductions) and its wire
bytes. CPU timings are of an emulation: XLA:CPU converts float8 to float32 for every dot,
so float8 costs more here, not less (an H100 runs these GEMMs at twice bf16's peak: `jaxpar estimate`).
The weights are gathered in the compute dtype under every recipe, and in float8 under tensorwise with
--fp8-gather (docs/fp8.md: XLA:CPU moves them as float16 against bfloat16's float32, half the bytes).

The loss curves: llama-tiny on one device, --curve-steps steps from the same parameters and batches, bfloat16
and each recipe, drawn to experiments/results/bench_fp8.png with the largest gap of the 20-step means
from step 50 on (DeepSeek-V3 section 3.3 reports its FP8 run within 0.25% of BF16).

--quick: llama-tiny under fsdp8, batch 16 x seq 64, 1 timed step, 30 curve steps, XLA's backend
optimisations off (quick timings mean nothing).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _bench import compiled_step  # noqa: E402 (experiments/_bench.py)
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.training.config import TrainConfig  # noqa: E402
from jaxpar.training.data import Synthetic  # noqa: E402
from jaxpar.training.trainer import Trainer  # noqa: E402

MODEL = "llama-tiny:d_model=512,layers=8,heads=8,kv_heads=8,head_dim=64,mlp_dim=1536,vocab=32000,max_seq=512"
PRECISIONS = (("bfloat16", None), ("float8", "tensorwise"), ("float8", "rowwise"), ("float8", "blockwise"))
GATHERED = ("float8", "tensorwise", True)   # the weights gathered in float8 (--fp8-gather)
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(model="llama-tiny", seq=64, steps=1, curve_steps=30)


def options(dtype: str, recipe: str | None, gather: bool = False) -> dict:
    return dict(dtype=dtype) if recipe is None else dict(dtype=dtype, fp8_recipe=recipe, fp8_gather=gather)


def label(dtype: str, recipe: str | None, gather: bool = False) -> str:
    return dtype if recipe is None else f"float8 {recipe}" + (" --fp8-gather" if gather else "")


def measure(model: str, precision: tuple, batch: int, seq: int, steps: int) -> dict:
    r = compiled_step(model, parse_strategy("fsdp=8").with_options(**options(*precision)), batch, seq, steps)
    tally = r["tally"]
    gathers = [c for c in tally if c.kind == "all-gather"]
    reduces = [c for c in tally if c.kind == "all-reduce"]
    return {"precision": label(*precision), "step_s": r["step_s"],
            "gathers": sum(c.count for c in gathers), "gather_mib": sum(c.bytes for c in gathers) / 2**20,
            "reduces": sum(c.count for c in reduces), "wire_mib": sum(c.wire_bytes for c in tally) / 2**20}


def curve(dtype: str, recipe: str | None, steps: int) -> np.ndarray:
    """llama-tiny's losses over `steps` steps on one device (the shared parameters and batches)."""
    tr = Trainer(parse_model("llama-tiny"), parse_strategy("data=1").with_options(**options(dtype, recipe)),
                 TrainConfig(batch=16, seq=32, steps=steps, lr=3e-3, warmup=10), devices=jax.devices()[:1])
    state, src, out = tr.init_state(), Synthetic(tr.model_cfg.vocab), []
    for i in range(steps):
        state, metrics = tr.step(state, tr.batch(src, i))
        out.append(float(metrics["loss"]))
    return np.array(out)


def means(loss: np.ndarray, window: int = 20) -> np.ndarray:
    return np.convolve(loss, np.ones(window) / window, mode="valid")


def curves(steps: int) -> tuple[dict, list[str]]:
    """Each precision's losses, and one line per recipe: its largest 20-step-mean gap to bfloat16 from
    step 50 on (from step 0 where the run is shorter than 70 steps)."""
    runs = {label(d, r): curve(d, r, steps) for d, r in PRECISIONS}
    base, start = means(runs["bfloat16"]), 50 if steps >= 70 else 0
    lines = []
    for name, loss in runs.items():
        if name != "bfloat16":
            gap = np.max(np.abs(means(loss) - base)[start:] / base[start:])
            lines.append(f"| {name} | {gap:.3%} |")
    return runs, lines


def draw(runs: dict, path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, loss in runs.items():
        ax.plot(np.arange(len(loss)), loss, label=name, lw=1.2)
    ax.set(xlabel="step", ylabel="loss", title="llama-tiny, one device: float8 recipes against bfloat16")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--model", default=MODEL, help="a dense model")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=512, help="sequence length")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per precision (the fastest counts)")
    ap.add_argument("--curve-steps", type=int, default=200, help="steps of each loss curve")
    ap.add_argument("--quick", action="store_true", help="smoke test: llama-tiny, a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_fp8.md goes")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    rows = [measure(args.model, p, args.batch, args.seq, args.steps) for p in PRECISIONS + (GATHERED,)]
    title = (f"{args.model}, batch {args.batch} x seq {args.seq}, fsdp=8 on 8 simulated CPU devices, fastest of "
             f"{args.steps} steps (float8 emulated: XLA:CPU converts it to float32 for every dot)")
    md = ["# Float8 training: bfloat16 against the float8 recipes (CPU)", "", title, "",
          "| precision | step s | all-gathers | gathered MiB | all-reduces | wire MiB |",
          "|---|---:|---:|---:|---:|---:|"]
    print(title)
    for r in rows:
        md.append(f"| {r['precision']} | {r['step_s']:.3f} | {r['gathers']} | {r['gather_mib']:.2f} | {r['reduces']} "
                  f"| {r['wire_mib']:.2f} |")
        print(md[-1])
    runs, gaps = curves(args.curve_steps)
    figure = args.out / "bench_fp8.png"
    draw(runs, figure)
    md += ["", f"## Loss curves: llama-tiny, one device, {args.curve_steps} steps", "",
           "| precision | largest gap of the 20-step means to bfloat16 |", "|---|---:|", *gaps, "",
           "![loss curves](bench_fp8.png)"]
    print("\n".join(md[-5:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fp8.md").write_text("\n".join(md) + "\n")
    print(f"\nwritten to {args.out / 'bench_fp8.md'} and {figure}")


if __name__ == "__main__":
    main()
