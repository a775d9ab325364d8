"""Attention kernels on CPU: memory against the sequence, and step time of a 33M llama, dense vs blockwise.

    python experiments/bench_attention.py [--steps 2] [--out DIR]
    python experiments/bench_attention.py --quick      # smoke test: seconds

Memory. llama-tiny's training step on one CPU device compiled (from shapes, nothing runs) at 2k, 4k and
8k tokens, one sequence, under `attention_kernel` dense and blockwise: XLA's memory analysis (temp bytes).
Dense keeps every layer's [heads, s, s] float32 scores, exponentials and probabilities for the backward
pass, so its temporaries grow as s^2; blockwise keeps q, k, v, the output and a logsumexp per query row
and recomputes the score blocks backward (jaxpar/ops/blockwise_attention.py), so its grow as s. Beside
each, the cost model's activation bytes for the same step (jaxpar/cost/program_memory.py, the kernel's
inventory).

Step time. A 33.0M-parameter llama (d_model 512, 8 layers, 8 heads of 64, SwiGLU MLP 1536, vocabulary
5,632: MODEL), batch 16 x seq 512 in bfloat16, on 8 simulated CPU devices under fsdp8 and fsdp4 x tp2, each
kernel: the fastest of --steps timed steps after a compile step. At seq 512 the blockwise kernel runs
one 512 x 512 block pair per (batch, head), the same matmuls as dense, so the times should agree within
the machine's noise (about 5% on a shared 2-core host): the kernel costs nothing where it is not needed.
Simulated devices share the host's cores: these are CPU figures, not a GPU's (experiments/gpu_check.py
measures an H100 where one is lent).

Prints the tables, writes experiments/results/bench_attention.md and a figure of the memory
(bench_attention.png, where matplotlib is installed).

--quick: seq 1024 and 2048 for the memory, llama-tiny's own shapes at batch 16 x seq 64 for the steps,
one timed step.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from _bench import compiled_step  # noqa: E402 (experiments/_bench.py)
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.cost import program_memory  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: E402

MODEL = "llama-tiny:d_model=512,layers=8,heads=8,kv_heads=8,head_dim=64,mlp_dim=1536,vocab=5632,max_seq=512"  # 33.0M
LAYOUTS = {"fsdp8": "fsdp=8", "fsdp4-tp2": "fsdp=4,tensor=2"}
KERNELS = ("dense", "blockwise")
RESULTS = ROOT / "experiments" / "results"


def temp_bytes(kernel: str, seq: int) -> tuple[int, float]:
    """(XLA's temp bytes, the cost model's activation bytes) of llama-tiny's step at one sequence of `seq`."""
    model = parse_model(f"llama-tiny:max_seq={seq}")
    st = parse_strategy("data=1").with_options(attention_kernel=kernel).resolved(1)
    tr = Trainer(model, st, TrainConfig(batch=1, seq=seq, steps=1), devices=jax.devices()[:1])
    temp = tr.lower_step().compile().memory_analysis().temp_size_in_bytes
    return temp, program_memory.activation_bytes(model, st, 1, seq, kernel=kernel)


def memory_table(seqs: list[int]) -> tuple[list[str], dict]:
    """The markdown rows and {kernel: [(XLA temp, model) bytes per seq]}."""
    rows = ["| seq | dense temp MiB | dense model MiB | blockwise temp MiB | blockwise model MiB |",
            "|---:|---:|---:|---:|---:|"]
    got = {k: [] for k in KERNELS}
    for seq in seqs:
        for k in KERNELS:
            got[k].append(temp_bytes(k, seq))
        cells = [f"{got[k][-1][i] / 2**20:,.1f}" for k in KERNELS for i in (0, 1)]
        rows.append(f"| {seq} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    growth = {k: got[k][-1][0] / got[k][0][0] for k in KERNELS}
    rows.append(f"\nseq x{seqs[-1] // seqs[0]}: dense temp x{growth['dense']:.1f}, blockwise x{growth['blockwise']:.1f}")
    return rows, got


def figure(seqs: list[int], got: dict, path: pathlib.Path) -> None:
    """Temp memory against the sequence, log-log: XLA's (points) and the cost model's (lines)."""
    try:
        import matplotlib  # deferred: the plot extra is optional
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # deferred: as above
    except ImportError:
        print("matplotlib not installed: no figure")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for k, color in zip(KERNELS, ("tab:red", "tab:blue")):
        ax.plot(seqs, [x / 2**20 for x, _ in got[k]], "o", color=color, label=f"{k}: XLA temp")
        ax.plot(seqs, [y / 2**20 for _, y in got[k]], "-", color=color, label=f"{k}: cost model")
    ax.set(xscale="log", yscale="log", xlabel="tokens in the sequence", ylabel="MiB per device",
           title="llama-tiny training step, one device: attention memory")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def step_table(model: str, batch: int, seq: int, steps: int) -> list[str]:
    rows = ["| layout | kernel | step s | tokens/s | temp MiB |", "|---|---|---:|---:|---:|"]
    for name, mesh in LAYOUTS.items():
        for kernel in KERNELS:
            st = parse_strategy(mesh).with_options(attention_kernel=kernel, dtype="bfloat16")
            r = compiled_step(model, st, batch, seq, steps)
            rows.append(f"| {name} | {kernel} | {r['step_s']:.3f} | {r['tokens'] / r['step_s']:,.0f} | "
                        f"{r['memory'].temp_size_in_bytes / 2**20:,.1f} |")
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration (default: 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: small sequences and llama-tiny's steps")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results folder (default: experiments/results)")
    args = p.parse_args(argv)
    seqs = [1024, 2048] if args.quick else [2048, 4096, 8192]
    model, batch, seq, steps = ("llama-tiny", 16, 64, 1) if args.quick else (MODEL, 16, 512, args.steps)
    print("XLA's temp memory of one training step, one device, one sequence (llama-tiny):")
    mem_rows, got = memory_table(seqs)
    args.out.mkdir(parents=True, exist_ok=True)
    figure(seqs, got, args.out / "bench_attention.png")
    lines = ["# Attention kernels on CPU", "", "## Memory of one step (llama-tiny, 1 device, 1 sequence)", "",
             *mem_rows, "", f"## Step time ({'llama-tiny' if args.quick else '33M llama'}, "
             f"batch {batch} x seq {seq}, bfloat16, 8 simulated CPU devices)", "",
             *step_table(model, batch, seq, steps), "",
             "Simulated devices share the host's cores: CPU figures, not a GPU's."]
    (args.out / "bench_attention.md").write_text("\n".join(lines) + "\n")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
