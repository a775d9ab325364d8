"""Mamba-2 vs attention: tokens/s at about equal parameter count, and step time as seq grows.

    python experiments/bench_mamba.py [--steps 3] [--out DIR]
    python experiments/bench_mamba.py --quick        # smoke test: a few seconds

Prints (no assertions) tokens/s of mamba2-tiny and a llama-tiny sized to the same parameter count,
on 1 and 8 simulated CPU devices, and the forward+backward step time from seq 1k to 16k on one
device: Mamba's chunked scan should grow linearly, attention's score matrix quadratically. Writes
both tables to experiments/results/bench_mamba.md (or --out DIR) and the step time against seq to
bench_mamba.png. Parameters are random host arrays put in their shards (the step time does not
depend on their values, and XLA:CPU compiles the random initialiser slowly).

--quick: the same path on 1-layer models, batch 8 x seq 64 for tokens/s, batch 8 at seqs 64 and
128 for the growth table (attention skipped above 64, as it is above --max-attention-seq
normally; seq 64 reuses the tokens/s case), 1 timed step, and XLA's backend optimisations off
(compiles faster, runs slower: quick timings mean nothing). Options given explicitly still win.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import jax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from _bench import host_params  # noqa: E402 (experiments/_bench.py)
from jaxpar.cost.params import total_params  # noqa: E402
from jaxpar.training.data import Synthetic  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: E402

MAMBA = "mamba2-tiny:max_seq=16384"
LLAMA = "llama-tiny:max_seq=16384,mlp_dim=64"    # about mamba2-tiny's parameter count
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(steps=1, batch=8, seq=64, seqs=[64, 128], growth_batch=8, max_attention_seq=64,
             mamba=MAMBA + ",layers=1", llama=LLAMA + ",layers=1")


def step_time(model: str, mesh: str, devices: int, batch: int, seq: int, steps: int) -> float:
    tr = Trainer(parse_model(model), parse_strategy(mesh), TrainConfig(batch=batch, seq=seq, steps=steps),
                 devices=jax.devices()[:devices])
    state = tr.state_from_params(host_params(tr))
    src = Synthetic(tr.model_cfg.vocab)
    times = []
    for step in range(steps + 1):
        b = tr.batch(src, step)
        t0 = time.perf_counter()
        state, m = tr.step(state, b)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    return min(times[1:])  # the first step compiles


def plot(growth: dict[str, dict[int, float]], batch: int, path: pathlib.Path) -> None:
    """PNG: step time against seq on log-log axes, with linear and quadratic guides."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, times in growth.items():
        seqs = sorted(times)
        ax.plot(seqs, [times[s] for s in seqs], "o-", label=m.split(":")[0])
    seqs = sorted({s for times in growth.values() for s in times})
    t0 = min(min(times.values()) for times in growth.values() if times)
    ax.plot(seqs, [t0 * s / seqs[0] for s in seqs], ":", color="grey", label="linear")
    ax.plot(seqs, [t0 * (s / seqs[0]) ** 2 for s in seqs], "--", color="grey", label="quadratic")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence length (batch {batch}, 1 device)")
    ax.set_ylabel("forward+backward step time (s)")
    ax.set_title("Mamba-2 vs attention at about equal parameter count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (the fastest counts)")
    ap.add_argument("--batch", type=int, default=16, help="batch of the tokens/s table")
    ap.add_argument("--seq", type=int, default=256, help="sequence length of the tokens/s table")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                    help="sequence lengths of the growth table (1 device)")
    ap.add_argument("--growth-batch", type=int, default=1, help="batch of the growth table")
    ap.add_argument("--mamba", default=MAMBA, help="the Mamba-2 model")
    ap.add_argument("--llama", default=LLAMA, help="the attention model (about the Mamba model's size)")
    ap.add_argument("--max-attention-seq", type=int, default=4096,
                    help="longest sequence for dense attention on one CPU device (memory and time)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small sizes, a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_mamba.md and .png go")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    models = (args.mamba, args.llama)

    def attention_skipped(m: str, seq: int) -> bool:
        # dense scores alone are heads * seq^2 * 4 bytes (17 GB at 16k): use ring attention
        return m == args.llama and seq > args.max_attention_seq

    # every (model, mesh, devices, batch, seq) case once: the growth table may repeat a tokens/s case
    cases = [(m, mesh, n, args.batch, args.seq) for m in models for mesh, n in (("data=1", 1), ("data=8", 8))]
    cases += [(m, "data=1", 1, args.growth_batch, seq) for seq in args.seqs for m in models
              if not attention_skipped(m, seq)]
    cases = list(dict.fromkeys(cases))
    times: dict[tuple, float] = {}
    for case in tqdm(cases, unit="case", disable=not sys.stdout.isatty(), dynamic_ncols=True, leave=False):
        times[case] = step_time(*case, args.steps)

    md = ["# Mamba-2 vs attention", "", "| model | parameters |", "|---|---:|"]
    for m in models:
        print(f"{m}: {total_params(parse_model(m)):,} parameters")
        md.append(f"| {m} | {total_params(parse_model(m)):,} |")
    tokens = args.batch * args.seq
    print(f"\ntokens/s, batch {args.batch} x seq {args.seq} (fastest of {args.steps} steps):")
    print(f"{'model':<48} {'1 device':>12} {'dp8':>12}")
    md += ["", f"## tokens/s, batch {args.batch} x seq {args.seq} (fastest of {args.steps} steps)", "",
           "| model | 1 device | dp8 |", "|---|---:|---:|"]
    for m in models:
        one, eight = (tokens / times[m, mesh, n, args.batch, args.seq] for mesh, n in (("data=1", 1), ("data=8", 8)))
        print(f"{m:<48} {one:>12,.0f} {eight:>12,.0f}")
        md.append(f"| {m} | {one:,.0f} | {eight:,.0f} |")

    title = f"step time (s) on 1 device, batch {args.growth_batch}, vs seq (growth relative to seq {args.seqs[0]})"
    print(f"\n{title}:")
    print(f"{'seq':>6} {'mamba':>10} {'x':>6} {'attention':>10} {'x':>6}")
    md += ["", f"## {title}", "", "| seq | mamba s | x | attention s | x |", "|---:|---:|---:|---:|---:|"]
    growth: dict[str, dict[int, float]] = {m: {} for m in models}
    for seq in args.seqs:
        row, md_row = [f"{seq:>6}"], [str(seq)]
        for m in models:
            if attention_skipped(m, seq):
                row.append(f"{'skipped':>10} {'':>6}")
                md_row += ["skipped", ""]
                continue
            t = growth[m][seq] = times[m, "data=1", 1, args.growth_batch, seq]
            base = growth[m][min(growth[m])]
            row.append(f"{t:>10.3f} {t / base:>6.1f}")
            md_row += [f"{t:.3f}", f"{t / base:.1f}"]
        print(" ".join(row))
        md.append("| " + " | ".join(md_row) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mamba.md").write_text("\n".join(md) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_mamba.md'}; no figure: matplotlib is not installed")
    else:
        plot(growth, args.growth_batch, args.out / "bench_mamba.png")
        print(f"\nwritten to {args.out / 'bench_mamba.md'} and bench_mamba.png")


if __name__ == "__main__":
    main()
