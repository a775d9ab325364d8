"""How fast is the analytic cost model? Prints the latency of one estimate and configurations per second.

    python experiments/bench_estimate.py [--n 20000]

The planner calls `estimate` once per candidate strategy, so it must stay arithmetic (goal: >= 10,000
configurations/s on one core). On a shared machine read the best block, as timeit does. Candidates: every
factorisation of 512 devices over data x fsdp x pipeline x tensor with a few option variants, for a
transformer and a Mamba-2 model. "Single configuration, cold" is the first estimate of a model the cost
model has not seen (its per-model memos empty): what `jaxpar estimate` pays once; a planner pays it once
per model and then the warm per-estimate figure for every candidate.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpar.cost import estimate, load_hardware  # noqa: E402
from jaxpar.strategy import parse_inline  # noqa: E402
from jaxpar.models.config import from_preset, parse_model  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="estimates to time")
    args = ap.parse_args()
    hw = load_hardware("h100-sxm")
    models = [from_preset("llama3-70b"), from_preset("mamba2-2.7b")]
    cands = list(candidates())
    work = [(m, s) for m in models for s in cands]
    ref = python_speed()
    colds = []
    for layers in range(40, 60):  # a config object never seen before: every memo misses
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
    print(f"single configuration, cold: {min(colds) * 1e6:.0f} us (best of {len(colds)} fresh models)")
    print(f"{len(work)} distinct configurations, {blocks} blocks of {size} estimates")
    print(f"best block:   {best * 1e6:.1f} us per estimate, {1 / best:,.0f} configurations/s")
    print(f"median block: {median * 1e6:.1f} us per estimate, {1 / median:,.0f} configurations/s")
    print(f"machine speed: sum(range(1000)) = {ref:.1f} us (about 10 us on an idle core)")
    t0 = time.perf_counter()
    for i in range(min(args.n, 5000)):
        m, s = work[i % len(work)]
        estimate(m, s, hw, 1024, 4096).to_json()
    dt = time.perf_counter() - t0
    print(f"with to_json(): {dt / min(args.n, 5000) * 1e6:.1f} us per estimate")


if __name__ == "__main__":
    main()
