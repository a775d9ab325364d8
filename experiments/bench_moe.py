"""Mixture of experts on 8 devices: expert parallelism vs replicated experts vs experts over tensor.

    python experiments/bench_moe.py [--steps 3] [--batch 32] [--seq 128] [--out DIR]
    python experiments/bench_moe.py --quick      # smoke test: a few seconds

One MoE model (moe-tiny widened: d_model 128, 8 experts of width 256, top-2, dropless), one train
step per layout on 8 simulated CPU devices:
    ep8              experts split over `expert` (one per device), tokens dispatched by all_to_all
    dp8              experts replicated: every device runs all 8 on its own tokens
    dp2-tp4          each expert's width split over `tensor` (and attention heads), no all_to_all
    ep4-tp2          both: 2 experts per device group, each split over 2 tensor ranks
For each: step time (fastest of --steps, after a compile step), the compiled step's wire bytes per
token (all collectives, and the expert all-to-alls alone, from the HLO tally), the cost model's
wire bytes for the same step (jaxpar.cost.comm, XLA:CPU traits), and XLA's memory per device
(parameters + optimizer state: `argument`; peak). Prints the table, writes it to
experiments/results/bench_moe.md (or --out DIR) and a bar chart of bytes per token and parameter
memory per device to bench_moe.png. CPU figures: simulated devices share this host's cores, so
the step times track the total work of all 8, not what a GPU interconnect would show; the bytes
and memory are the layouts' own.

--quick: moe-tiny itself, ep8 and dp8 only, batch 16 x seq 32, 1 timed step, XLA's backend
optimisations off (quick timings mean nothing). Options given explicitly still win.
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

from _bench import compiled_step  # noqa: E402 (experiments/_bench.py)
from jaxpar.cost.params import total_params  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_strategy  # noqa: E402

MODEL = "moe-tiny:d_model=128,expert_mlp_dim=256,heads=8,kv_heads=4,head_dim=16"
LAYOUTS = ("ep8", "dp8", "dp2-tp4", "ep4-tp2")
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(model="moe-tiny", batch=16, seq=32, steps=1, layouts=["ep8", "dp8"])


def measure(model: str, mesh: str, batch: int, seq: int, steps: int) -> dict:
    r = compiled_step(model, parse_strategy(mesh), batch, seq, steps)
    tally, mem, tokens = r["tally"], r["memory"], r["tokens"]
    return {"mesh": mesh, "step_s": r["step_s"], "tokens_per_s": tokens / r["step_s"],
            "wire": sum(c.wire_bytes for c in tally) / tokens,
            "a2a": sum(c.wire_bytes for c in tally if c.kind == "all-to-all" and c.axes == ("expert",)) / tokens,
            "predicted": sum(c.wire_bytes for c in r["predicted"]) / tokens,
            "argument": mem.argument_size_in_bytes,
            "peak": mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """PNG: wire bytes per token (expert all-to-all vs the rest) and parameter+optimizer memory per device."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["mesh"] for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a2a = [r["a2a"] / 1024 for r in rows]
    other = [(r["wire"] - r["a2a"]) / 1024 for r in rows]
    ax1.bar(x, a2a, color="#0072B2", label="expert all-to-all")
    ax1.bar(x, other, bottom=a2a, color="#E69F00", label="other collectives")
    ax1.set_xticks(x, names)
    ax1.set_ylabel("wire KiB per token (compiled step)")
    ax1.set_ylim(0, 1.15 * max(a + o for a, o in zip(a2a, other)))
    ax1.legend()
    ax2.bar(x, [r["argument"] / 2**20 for r in rows], color="#009E73")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("parameters + optimizer MiB / device")
    ax2.set_ylim(0, 1.15 * max(r["argument"] / 2**20 for r in rows))
    fig.suptitle("MoE on 8 devices: expert parallelism moves tokens, replication moves gradients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--model", default=MODEL, help="an MoE model (pattern with E)")
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout (the fastest counts)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="mesh_configs names (8 devices)")
    ap.add_argument("--quick", action="store_true", help="smoke test: moe-tiny, a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_moe.md and .png go")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    rows = [measure(args.model, mesh, args.batch, args.seq, args.steps)
            for mesh in tqdm(args.layouts, unit="layout", disable=not sys.stdout.isatty(), leave=False)]
    m = parse_model(args.model)
    title = (f"{args.model} ({total_params(m):,} parameters, {m.experts} experts, top-{m.top_k}), "
             f"batch {args.batch} x seq {args.seq}, 8 simulated CPU devices, fastest of {args.steps} steps")
    head = ("| layout | step s | tokens/s | wire B / token | expert all-to-all B / token | predicted wire B / token "
            "| params+optimizer MiB / device | peak MiB / device |")
    md = ["# Mixture of experts: expert parallelism vs replicated experts vs experts over tensor", "", title, "",
          head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    print(title)
    print(f"{'layout':<10}{'step s':>9}{'tokens/s':>11}{'wire B/tok':>12}{'a2a B/tok':>11}{'model B/tok':>13}"
          f"{'state MiB':>11}{'peak MiB':>10}")
    for r in rows:
        print(f"{r['mesh']:<10}{r['step_s']:>9.3f}{r['tokens_per_s']:>11,.0f}{r['wire']:>12,.0f}{r['a2a']:>11,.0f}"
              f"{r['predicted']:>13,.0f}{r['argument'] / 2**20:>11.2f}{r['peak'] / 2**20:>10.2f}")
        md.append(f"| {r['mesh']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['wire']:,.0f} | {r['a2a']:,.0f} "
                  f"| {r['predicted']:,.0f} | {r['argument'] / 2**20:.2f} | {r['peak'] / 2**20:.2f} |")
    note = ("(wire bytes: what one device sends under the ring model, from the compiled HLO; predicted: the "
            "cost model for the same step. CPU step times: simulated devices share this host's cores.)")
    print(note)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_moe.md").write_text("\n".join(md + ["", note]) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_moe.md'}; no figure: matplotlib is not installed")
    else:
        plot(rows, args.out / "bench_moe.png")
        print(f"\nwritten to {args.out / 'bench_moe.md'} and bench_moe.png")


if __name__ == "__main__":
    main()
