"""Mamba-2 vs attention: tokens/s at about equal parameter count, and step time as seq grows.

    python experiments/bench_mamba.py [--steps 4]

Prints (no assertions) tokens/s of mamba2-tiny and a llama-tiny sized to the same parameter count,
on 1 and 8 simulated CPU devices, and the forward+backward step time from seq 1k to 16k on one
device: Mamba's chunked scan should grow linearly, attention's score matrix quadratically.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from jaxpar.cost.params import total_params  # noqa: E402
from jaxpar.data import Synthetic  # noqa: E402
from jaxpar.strategy import parse_strategy  # noqa: E402
from jaxpar.train import TrainConfig, Trainer  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402

MAMBA = "mamba2-tiny:max_seq=16384"
LLAMA = "llama-tiny:max_seq=16384,mlp_dim=64"    # about mamba2-tiny's parameter count


def step_time(model: str, mesh: str, devices: int, batch: int, seq: int, steps: int) -> float:
    tr = Trainer(parse_model(model), parse_strategy(mesh), TrainConfig(batch=batch, seq=seq, steps=steps),
                 devices=jax.devices()[:devices])
    state = tr.init_state()
    src = Synthetic(tr.model_cfg.vocab)
    times = []
    for step in range(steps + 1):
        b = tr.batch(src, step)
        t0 = time.perf_counter()
        state, m = tr.step(state, b)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    return min(times[1:])  # the first step compiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-attention-seq", type=int, default=4096,
                    help="longest sequence for dense attention on one CPU device (memory and time)")
    args = ap.parse_args()
    for m in (MAMBA, LLAMA):
        print(f"{m}: {total_params(parse_model(m)):,} parameters")
    print("\ntokens/s, batch 16 x seq 256:")
    print(f"{'model':<40} {'1 device':>12} {'dp8':>12}")
    for m in (MAMBA, LLAMA):
        one = 16 * 256 / step_time(m, "data=1", 1, 16, 256, args.steps)
        eight = 16 * 256 / step_time(m, "data=8", 8, 16, 256, args.steps)
        print(f"{m:<40} {one:>12,.0f} {eight:>12,.0f}")
    print("\nstep time (s) on 1 device, batch 1, vs seq (growth relative to seq 1024):")
    print(f"{'seq':>6} {'mamba':>10} {'x':>6} {'attention':>10} {'x':>6}")
    base = {}
    for seq in (1024, 2048, 4096, 8192, 16384):
        row = [f"{seq:>6}"]
        for m in (MAMBA, LLAMA):
            if m == LLAMA and seq > args.max_attention_seq:
                # dense scores alone are heads * seq^2 * 4 bytes (17 GB at 16k): use ring attention
                row.append(f"{'skipped':>10} {'':>6}")
                continue
            t = step_time(m, "data=1", 1, 1, seq, args.steps)
            base.setdefault(m, t)
            row.append(f"{t:>10.3f} {t / base[m]:>6.1f}")
        print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
