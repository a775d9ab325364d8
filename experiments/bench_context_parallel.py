"""Context parallelism: memory per device, causal work balance, and step time (figures only).

    python experiments/bench_context_parallel.py [--seq-memory 32768] [--seq-time 4096] [--out DIR]
    python experiments/bench_context_parallel.py --quick      # smoke test: a few seconds

(a) Compile-only temp memory per device of attention forward+backward at a long sequence with
    llama-tiny attention widths: dense on one device vs ring and all-gather over context=8.
(b) Causal work balance over the context axis, contiguous vs zigzag: unmasked score entries per
    device (the FLOPs that matter), the ring's critical path in the sub-blocks it actually computes
    (each ring step waits for the slowest device), and measured forward+backward step time
    (fastest of --repeats, layouts alternating) on 8 simulated CPU devices.

Writes both tables to experiments/results/bench_context_parallel.md (or --out DIR) and
bench_context_parallel.png (unmasked score entries per device, contiguous vs zigzag).

--quick: the same path with --seq-memory 1024 --seq-time 256 --repeats 1, and XLA's backend
optimisations off (compiles faster, runs slower: quick timings mean nothing; the memory column is
XLA's buffer assignment, which is not affected). Options given explicitly still win.
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

CONTEXT = 8
if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(CONTEXT)  # before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxpar.core.mesh import make_mesh  # noqa: E402
from jaxpar.ops.attention import LAYOUTS, context_attention, token_permutation  # noqa: E402
from jaxpar.core.sharding import Layout, use_layout  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BATCH = 16, 8, 8, 1  # llama-tiny attention widths
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(seq_memory=1024, seq_time=256, repeats=1)


def layout(context: int) -> Layout | None:
    if context == 1:
        return None  # no layout: context_attention is dense_attention
    strategy = parse_inline(f"context={context}").resolved(context)
    return Layout(make_mesh(strategy, jax.devices()[:context]), strategy)


def fwd_bwd(lay: Layout | None, impl: str):
    """jit of (q, k, v, positions, dout) -> (out, dq, dk, dv) under `lay`."""
    def f(q, k, v, pos, dout):
        with use_layout(lay):
            out, vjp = jax.vjp(lambda q, k, v: context_attention(q, k, v, pos, impl=impl, causal=True), q, k, v)
            return out, *vjp(dout)
    return jax.jit(f)


def arg_shapes(lay: Layout | None, seq: int):
    def arg(shape, names, dtype=jnp.float32):
        sharding = lay.activation(*names) if lay else None
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    q = arg((BATCH, seq, HEADS, HEAD_DIM), ("batch", "seq", "act_heads", None))
    kv = arg((BATCH, seq, KV_HEADS, HEAD_DIM), ("batch", "seq", "act_kv_heads", None))
    return q, kv, kv, arg((BATCH, seq), ("batch", "seq"), jnp.int32), q


# ---- (a) memory ----------------------------------------------------------------------------------

def memory(seq: int, bar) -> list[str]:
    """Compile dense, ring and all-gather attention fwd+bwd; print and return the markdown lines."""
    title = (f"(a) temp memory per device, attention fwd+bwd, seq={seq}, heads={HEADS}, kv_heads={KV_HEADS}, "
             f"head_dim={HEAD_DIM}, batch={BATCH}, float32 (compile only)")
    rows = []
    for name, context, impl in (("dense, context=1", 1, "ring"),
                                (f"ring, context={CONTEXT}", CONTEXT, "ring"),
                                (f"allgather, context={CONTEXT}", CONTEXT, "allgather")):
        bar.set_description(f"compile {name}")
        lay = layout(context)
        t = time.perf_counter()
        compiled = fwd_bwd(lay, impl).lower(*arg_shapes(lay, seq)).compile()
        rows.append((name, compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - t))
        bar.update()
    dense = rows[0][1]
    scores = BATCH * HEADS * seq * seq * 4
    note = (f"(one full [b, h, s, s] float32 score matrix is {scores / 2**20:.0f} MiB; the ideal "
            f"1/{CONTEXT} share {scores / CONTEXT / 2**20:.0f} MiB)")
    out = [f"\n{title}", f"  {'strategy':<24}{'temp / device':>16}{'vs dense':>12}{'compile s':>11}"]
    out += [f"  {name:<24}{temp / 2**20:>13.1f} MiB{temp / dense:>12.4f}{secs:>11.1f}" for name, temp, secs in rows]
    bar.write("\n".join(out + [f"  {note}"]), file=sys.stdout)
    md = [f"## {title}", "", "| strategy | temp MiB / device | vs dense | compile s |", "|---|---:|---:|---:|"]
    md += [f"| {name} | {temp / 2**20:.1f} | {temp / dense:.4f} | {secs:.1f} |" for name, temp, secs in rows]
    return md + ["", note]


# ---- (b) causal work balance ---------------------------------------------------------------------

def unmasked_per_device(seq: int, context: int, layout_name: str) -> np.ndarray:
    """Unmasked causal score entries (q >= k) computed for each device's queries."""
    local = token_permutation(seq, context, layout_name).reshape(context, -1)
    return (local + 1).sum(axis=1)


def ring_critical_path(seq: int, context: int, layout_name: str) -> tuple[int, int]:
    """(critical path, total) in quarter blocks the ring kernel computes: the local sequence is
    split in two halves and a (q half, kv half) sub-block runs only if some q may see some k.
    Every ring step is a ppermute, so each step lasts as long as its busiest device."""
    local = token_permutation(seq, context, layout_name).reshape(context, 2, -1)
    path = total = 0
    for step in range(context):
        per_device = []
        for i in range(context):
            src = (i - step) % context
            per_device.append(sum(int(local[i, a].max() >= local[src, b].min())
                                  for a in range(2) for b in range(2)))
        path += max(per_device)
        total += sum(per_device)
    return path, total


def step_times(seq: int, impl: str, repeats: int) -> dict[str, float]:
    """Fastest forward+backward time per layout. The layouts' runs alternate, so both see the
    same contention on a shared host."""
    lay = layout(CONTEXT)
    q, k, v, pos_shape, dout = arg_shapes(lay, seq)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.device_put(jax.random.normal(key, s.shape, s.dtype), s.sharding)
                     for key, s in zip(keys, (q, k, v, dout)))
    f = fwd_bwd(lay, impl)
    runs = {}
    for name in LAYOUTS:
        # The laid-out sequence: token j of the array is token perm[j] of the text, and says so.
        perm = token_permutation(seq, CONTEXT, name)
        pos = jax.device_put(jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (BATCH, seq)), pos_shape.sharding)
        jax.block_until_ready(f(q, k, v, pos, dout))  # compile + warm up
        runs[name] = (pos, [])
    for _ in range(repeats):
        for pos, times in runs.values():
            t = time.perf_counter()
            jax.block_until_ready(f(q, k, v, pos, dout))
            times.append(time.perf_counter() - t)
    return {name: min(times) for name, (_, times) in runs.items()}


def balance(seq: int, repeats: int, bar) -> tuple[list[str], dict[str, np.ndarray]]:
    """Work balance and step times; print them, return the markdown lines and the per-device work."""
    times = {}
    for impl in ("ring", "allgather"):
        bar.set_description(f"{impl} fwd+bwd, seq={seq}")
        times[impl] = step_times(seq, impl, repeats)
        bar.update()
    title = f"(b) causal work balance over context={CONTEXT}, seq={seq}"
    out = [f"\n{title}", f"  {'layout':<12}{'unmasked max/min':>18}{'ring critical path':>20}{'ring total':>12}"
                         f"{'ring fwd+bwd s':>16}{'allgather fwd+bwd s':>21}"]
    md = [f"## {title}", "", "| layout | unmasked max/min | ring critical path (quarters) | ring total (quarters) "
          "| ring fwd+bwd s | allgather fwd+bwd s |", "|---|---:|---:|---:|---:|---:|"]
    work = {}
    for name in LAYOUTS:
        work[name] = unmasked_per_device(seq, CONTEXT, name)
        ratio = work[name].max() / work[name].min()
        path, total = ring_critical_path(seq, CONTEXT, name)
        ring, ag = times["ring"][name], times["allgather"][name]
        out.append(f"  {name:<12}{ratio:>18.3f}{path:>13} quarters{total:>12}{ring:>16.3f}{ag:>21.3f}")
        md.append(f"| {name} | {ratio:.3f} | {path} | {total} | {ring:.3f} | {ag:.3f} |")
    note = (f"(critical path: sum over the {CONTEXT} ring steps of the busiest device's quarter blocks; "
            f"a full block is 4 quarters. Simulated devices share this host's {jax.local_devices()[0].platform} "
            "cores, so step time tracks total work, not the critical path.)")
    bar.write("\n".join(out + [f"  {note}"]), file=sys.stdout)
    return md + ["", note], work


def plot(work: dict[str, np.ndarray], seq: int, path: pathlib.Path) -> None:
    """PNG: unmasked causal score entries per device for each layout."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(work)
    for i, (name, w) in enumerate(work.items()):
        ax.bar(np.arange(CONTEXT) + (i - (len(work) - 1) / 2) * width, w, width, label=name)
    ax.set_xlabel("device on the context axis")
    ax.set_ylabel("unmasked score entries (q >= k)")
    ax.set_title(f"causal attention work per device, seq={seq}, context={CONTEXT}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    parser.add_argument("--seq-memory", type=int, default=32768)
    parser.add_argument("--seq-time", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: small sequences, a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="where bench_context_parallel.md and .png go")
    args = parser.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    with tqdm(total=5, unit="case", disable=not sys.stdout.isatty(), dynamic_ncols=True) as bar:
        md = memory(args.seq_memory, bar)
        md_balance, work = balance(args.seq_time, args.repeats, bar)
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(["# Context parallelism: memory and causal work balance", "",
                      f"{CONTEXT} simulated CPU devices, fastest of {args.repeats} steps", "", *md, "", *md_balance])
    (args.out / "bench_context_parallel.md").write_text(text + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_context_parallel.md'}; no figure: matplotlib is not installed")
    else:
        plot(work, args.seq_time, args.out / "bench_context_parallel.png")
        print(f"\nwritten to {args.out / 'bench_context_parallel.md'} and bench_context_parallel.png")


if __name__ == "__main__":
    main()
