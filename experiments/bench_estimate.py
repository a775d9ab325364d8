"""How fast is the analytic cost model? Prints the latency of one estimate and configurations per second.

    python experiments/bench_estimate.py [--n 20000] [--out DIR]
    python experiments/bench_estimate.py --quick      # smoke test: --n 500, well under a second

The planner calls `estimate` once per candidate strategy, so it must stay arithmetic (goal: >= 10,000
configurations/s on one core). On a shared machine read the best block, as timeit does. Candidates: every
factorisation of 512 devices over data x fsdp x pipeline x tensor with a few option variants, for a
transformer and a Mamba-2 model. "Single configuration, cold" is the first estimate of a model the cost
model has not seen (its per-model memos empty): what `jaxpar estimate` pays once; a planner pays it once
per model and then the warm per-estimate figure for every candidate. Beside them, a whole `jaxpar estimate`
process's wall time (`jaxpar --help`'s: experiments/bench_startup.py). Writes the figures to
experiments/results/bench_estimate.md (or --out DIR).

--quick: the same path with --n 500 (10 blocks of 50 estimates, 500 with to_json()) and 5 cold
models instead of 20; --n given explicitly still wins.
"""
from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxpar.cost import estimate, load_hardware  # noqa: E402
from jaxpar.models.config import from_preset, parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
QUICK = dict(n=500, cold=5)


def candidates(devices: int = 512):
    pows = [2 ** i for i in range(10) if 2 ** i <= devices]
    for d, f, p, t in itertools.product(pows, pows, [1, 2, 4, 8], [1, 2, 4, 8]):
        if d * f * p * t != devices:
            continue
        base = parse_inline(f"data={d},fsdp={f},pipeline={p},tensor={t}")
        for remat, sp in (("full", True), ("dots_no_batch", False)):
            yield base.with_options(remat=remat, sequence_parallel=sp, dtype="bfloat16",
                                    microbatches=8 if p > 1 else 1)


def python_speed() -> float:
    """Microseconds for sum(range(1000)): ~10 us on an idle modern core with CPython 3.12. A loaded
    or slow machine shows here too, so the figures below can be compared across machines."""
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(200):
            sum(range(1000))
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
    return best


START_UP = (("jaxpar estimate (llama3-8b, fsdp8, h100-sxm)", ["estimate", "--model", "llama3-8b", "--mesh", "fsdp8",
                                                               "--hardware", "h100-sxm"]),)


def start_up(tries: int = 3) -> list[str]:
    """The wall time of a whole `jaxpar estimate` process (best of `tries`): its imports, which load no JAX
    (tests/test_console.py), and the answer."""
    rows = ["", "| process (best of %d) | wall s |" % tries, "|---|---:|"]
    for name, argv in START_UP:
        walls = []
        for _ in range(tries):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *argv], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            walls.append(time.perf_counter() - t0)
        print(f"{name}: {min(walls):.2f} s wall (best of {tries})")
        rows.append(f"| {name} | {min(walls):.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="estimates to time")
    ap.add_argument("--cold", type=int, default=20, help="fresh models to time the cold estimate on")
    ap.add_argument("--quick", action="store_true", help="smoke test: --n 500")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_estimate.md goes")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    hw = load_hardware("h100-sxm")
    models = [from_preset("llama3-70b"), from_preset("mamba2-2.7b")]
    cands = list(candidates())
    work = [(m, s) for m in models for s in cands]
    ref = python_speed()
    colds = []
    for layers in range(40, 40 + args.cold):  # a config object never seen before: every memo misses
        fresh = parse_model(f"llama3-70b:layers={layers}")
        t0 = time.perf_counter()
        estimate(fresh, cands[0], hw, 1024, 4096)
        colds.append(time.perf_counter() - t0)
    estimate(*work[0], hw, 1024, 4096)  # warm
    blocks, size = 10, max(1, args.n // 10)
    times = []
    for b in range(blocks):  # like timeit: the best block is the least disturbed by other processes
        t0 = time.perf_counter()
        for i in range(b * size, (b + 1) * size):
            m, s = work[i % len(work)]
            estimate(m, s, hw, 1024, 4096)
        times.append((time.perf_counter() - t0) / size)
    best, median = min(times), sorted(times)[blocks // 2]
    n_json = min(args.n, 5000)
    t0 = time.perf_counter()
    for i in range(n_json):
        m, s = work[i % len(work)]
        estimate(m, s, hw, 1024, 4096).to_json()
    with_json = (time.perf_counter() - t0) / n_json
    cold = min(colds)
    print(f"single configuration, cold: {cold * 1e6:.0f} us (best of {len(colds)} fresh models)")
    print(f"{len(work)} distinct configurations, {blocks} blocks of {size} estimates")
    print(f"best block:   {best * 1e6:.1f} us per estimate, {1 / best:,.0f} configurations/s")
    print(f"median block: {median * 1e6:.1f} us per estimate, {1 / median:,.0f} configurations/s")
    print(f"machine speed: sum(range(1000)) = {ref:.1f} us (about 10 us on an idle core)")
    print(f"with to_json(): {with_json * 1e6:.1f} us per estimate")

    lines = ["# Analytic cost model: estimates per second", "",
             f"{len(work)} distinct configurations (every factorisation of 512 devices over data x fsdp x pipeline "
             f"x tensor, 2 option variants, {len(models)} models), {blocks} blocks of {size} estimates; "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; machine speed: sum(range(1000)) = "
             f"{ref:.1f} us (about 10 us on an idle core). Goal: >= 10,000 configurations/s.", "",
             "| measure | us per estimate | configurations/s |", "|---|---:|---:|"]
    for name, secs in ((f"single configuration, cold (best of {len(colds)} fresh models)", cold),
                       ("best block", best), ("median block", median),
                       (f"with to_json() ({n_json} estimates)", with_json)):
        lines.append(f"| {name} | {secs * 1e6:.1f} | {1 / secs:,.0f} |")
    lines += start_up()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_estimate.md").write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out / 'bench_estimate.md'}")


if __name__ == "__main__":
    main()
