"""Pipeline parallelism: step time against the number of micro-batches, beside the ideal bubble.

    python experiments/bench_pipeline.py [--batch 64] [--seq 64] [--repeats 5] [--out DIR]
    python experiments/bench_pipeline.py --quick       # smoke test: a few seconds

llama-tiny:layers=8 on 8 simulated CPU devices, pipeline=4 x data=2, GPipe, circular (v=2) and 1F1B
schedules, and interleaved 1F1B (v=2), with M = 4, 8, 16, 32 micro-batches, and the same batch without a
pipeline (data=8).
(jaxpar's 1F1B runs M + 2(S-1) lockstep ticks, S-1 forwards only, M forward-and-backward, S-1 backwards
only: GPipe's work and bubble (S-1)/(M+S-1), its backward recomputing each chunk, jaxpar/pipeline/one_f_one_b.py.)

Memory: the compiled loss-and-gradients program's temp bytes per device (XLA's memory analysis) for
GPipe and 1F1B side by side at M = 4, 8, 16 with the micro-batch held fixed (one row per data shard
and micro-batch, batch = 2M): GPipe keeps all M micro-batches' activations for its backward, 1F1B at
most 2S-1 stashed stage inputs, so its figure stays flat while GPipe's grows.

Every stage computes in every one of the T = v*M + S - 1 iterations, bubbles included, and the
simulated devices share this host's cores, so a step's time tracks the total work: T iterations of
S stage chunks on B/M rows each, i.e. 1 / (1 - bubble) times the work of the batch itself, where
bubble = (S-1) / (v*M + S-1). On real accelerators the bubble is idle time instead of extra work;
the ratio is the same. The `predicted` column is that ratio (1F1B's times 4/3: its backward reruns each
chunk's forward, (F + F + B) / (F + B) with B = 2F); `measured` is the step time over the
data=8 step time, each the fastest of --repeats steps taken round robin over the cases (so all see
the same contention on a shared host). On a CPU host the step time also tracks memory traffic: the
schedules with small working sets (1F1B: a few MiB of temp per device against GPipe's tens) run
faster than their work predicts, so read the measured column for the trend in M, not as a GPU ranking. Writes experiments/results/bench_pipeline.md (+ .png when
matplotlib is installed), or into --out DIR.

--quick: the same path with M = 4 only (timing GPipe and circular; memory GPipe, 1F1B, interleaved), batch 8 x
seq 16, 1 repeat, and
XLA's backend optimisations off (compiles faster, runs slower: quick timings mean nothing).
Options given explicitly still win.
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
simulate_cpu_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxpar.core.schedule import schedule_of  # noqa: E402
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: E402
from jaxpar.training.data import Synthetic  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402

MODEL = "llama-tiny:layers=8"
RESULTS = ROOT / "experiments" / "results"
RECOMPUTE = 4 / 3   # 1F1B reruns each chunk's forward in its backward: (F + F + B) / (F + B), B = 2F
QUICK = dict(batch=8, seq=16, repeats=1, microbatches=[4], schedules=["gpipe", "circular"], memory_microbatches=[4])


def host_params(trainer: Trainer):
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: (0.02 * rng.normal(size=a.shape)).astype(a.dtype), trainer.abstract_params)


class Case:
    """One strategy, compiled, with its state and batch ready to step."""

    def __init__(self, mesh: str, options: dict, tc: TrainConfig):
        tr = Trainer(parse_model(MODEL), parse_strategy(mesh).with_options(**options), tc, devices=jax.devices()[:8])
        t0 = time.perf_counter()
        self.compiled = tr.lower_step().compile()
        self.compile_s = time.perf_counter() - t0
        self.state = tr.state_from_params(host_params(tr))
        self.batch = tr.batch(Synthetic(tr.model_cfg.vocab), 0)
        self.times: list[float] = []
        self.step()  # warm up
        self.times.clear()
        sched = schedule_of(tr.strategy, tr.model_cfg.run_units)
        piped = sched.stages > 1
        kind = sched.kind + (f" v={sched.repeats}" if sched.kind == "1f1b" and sched.repeats > 1 else "")
        self.row = {"mesh": mesh, "schedule": kind if piped else "-", "M": sched.microbatches,
                    "T": sched.iterations if piped else 1, "bubble": sched.bubble if piped else 0.0,
                    "temp_mib": self.compiled.memory_analysis().temp_size_in_bytes / 2**20}

    def step(self) -> None:
        t = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(metrics)
        self.times.append(time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "circular", "1f1b", "1f1b-interleaved"])
    parser.add_argument("--memory-microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--quick", action="store_true", help="smoke test: M=4 only, small batch, a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_pipeline.md and .png go")
    args = parser.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    tc = TrainConfig(batch=args.batch, seq=args.seq)

    specs = [("data=8", {}, "data=8")]
    for schedule in args.schedules:
        extra = {"pp_repeats": 2} if schedule in ("circular", "1f1b-interleaved") else {}
        for m in args.microbatches:
            options = dict(microbatches=m, pp_schedule=schedule.removesuffix("-interleaved"), **extra)
            specs.append(("pipeline=4,data=2", options, f"{schedule} M={m}"))
    cases = []
    bar = tqdm(specs, unit="case", disable=not sys.stdout.isatty(), dynamic_ncols=True, leave=False)
    for mesh, options, label in bar:
        bar.set_description(f"compile {label}")
        cases.append(Case(mesh, options, tc))
        bar.write(f"  compiled {label} in {cases[-1].compile_s:.1f} s", file=sys.stdout)
    for _ in tqdm(range(args.repeats), desc="steps", unit="round", disable=not sys.stdout.isatty(), leave=False):
        for case in cases:  # round robin: every case sees the same contention on a shared host
            case.step()
    rows = [case.row | {"step_s": min(case.times), "compile_s": case.compile_s} for case in cases]
    base = rows[0]["step_s"]
    header = ("| mesh | schedule | M | T | ideal bubble | predicted time / no-pipeline | measured | step ms "
              "| temp MiB/device | compile s |")
    lines = [f"{MODEL}, batch={args.batch}, seq={args.seq}, float32, 8 simulated CPU devices "
             f"(fastest of {args.repeats} steps)", "", header, "|" + "---|" * 10]
    for r in rows:
        predicted = 1 / (1 - r["bubble"]) * (RECOMPUTE if r["schedule"].startswith("1f1b") else 1.0)
        lines.append(f"| {r['mesh']} | {r['schedule']} | {r['M']} | {r['T']} | {r['bubble']:.1%} | {predicted:.2f} "
                     f"| {r['step_s'] / base:.2f} | {r['step_s'] * 1e3:.0f} | {r['temp_mib']:.1f} "
                     f"| {r['compile_s']:.1f} |")
    lines += ["", memory_table(args.seq, args.memory_microbatches)]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_pipeline.md").write_text("# Pipeline: step time vs micro-batches\n\n" + text + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_pipeline.md'}; no figure: matplotlib is not installed")
    else:
        plot(rows, args.out / "bench_pipeline.png")
        print(f"\nwritten to {args.out / 'bench_pipeline.md'} and bench_pipeline.png")


def temp_bytes(schedule: str, microbatches: int, seq: int, repeats: int = 1) -> int:
    """Compiled temp bytes per device of loss + gradients, pipeline=4 x data=2, one row per data shard and
    micro-batch (the micro-batch fixed, the batch 2M)."""
    import jax.numpy as jnp  # noqa: PLC0415
    strategy = parse_strategy("pipeline=4,data=2").with_options(microbatches=microbatches, pp_schedule=schedule,
                                                                pp_repeats=repeats)
    tc = TrainConfig(batch=2 * microbatches, seq=seq)
    tr = Trainer(parse_model(MODEL), strategy, tc, devices=jax.devices()[:8])
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tr.abstract_params,
                          tr.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((tc.batch, tc.seq), jnp.int32, sharding=tr.batch_sharding)
             for k in ("inputs", "labels", "positions")}
    return tr.stored_loss_and_grads.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def memory_table(seq: int, microbatches: list[int]) -> str:
    """GPipe vs 1F1B (and interleaved 1F1B, v = 2) compiled temp memory at M = 4, 8, 16 (S = 4), fixed
    micro-batch."""
    lines = [f"Compiled temp memory per device, loss + gradients, pipeline=4 x data=2, seq={seq}, one row per "
             "data shard and micro-batch (batch = 2M)", "",
             "| M | GPipe bytes | 1F1B bytes | GPipe / 1F1B | interleaved 1F1B v=2 bytes |", "|---|---|---|---|---|"]
    for m in microbatches:
        g, f, i = temp_bytes("gpipe", m, seq), temp_bytes("1f1b", m, seq), temp_bytes("1f1b", m, seq, 2)
        lines.append(f"| {m} | {g} | {f} | {g / f:.1f} | {i} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """PNG: measured step time over the data=8 step time against M, beside 1 / (1 - bubble)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    base = rows[0]["step_s"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for schedule in dict.fromkeys(r["schedule"] for r in rows[1:]):
        sel = [r for r in rows if r["schedule"] == schedule]
        ms = [r["M"] for r in sel]
        line, = ax.plot(ms, [r["step_s"] / base for r in sel], "o-", label=f"{schedule}: measured")
        extra = RECOMPUTE if schedule.startswith("1f1b") else 1.0
        ax.plot(ms, [extra / (1 - r["bubble"]) for r in sel], "x--", color=line.get_color(),
                label=f"{schedule}: predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("step time / data=8 step time")
    ax.set_title(f"pipeline=4 x data=2, {MODEL}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
