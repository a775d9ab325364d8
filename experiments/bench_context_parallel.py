"""Context parallelism: memory per device, causal work balance, and step time (figures only).

    PYTHONPATH=. python experiments/bench_context_parallel.py [--seq-memory 32768] [--seq-time 4096]

(a) Compile-only temp memory per device of attention forward+backward at a long sequence with
    llama-tiny attention widths: dense on one device vs ring and all-gather over context=8.
(b) Causal work balance over the context axis, contiguous vs zigzag: unmasked score entries per
    device (the FLOPs that matter), the ring's critical path in the sub-blocks it actually computes
    (each ring step waits for the slowest device), and measured forward+backward step time
    (fastest of --repeats, layouts alternating) on 8 simulated CPU devices.
"""
from __future__ import annotations

import argparse
import time

from jaxpar.devices import simulate_cpu_devices

CONTEXT = 8
simulate_cpu_devices(CONTEXT)  # before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.mesh import make_mesh  # noqa: E402
from jaxpar.ops.context_parallel import LAYOUTS, context_attention, token_permutation  # noqa: E402
from jaxpar.sharding import Layout, use_layout  # noqa: E402
from jaxpar.strategy import parse_inline  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BATCH = 16, 8, 8, 1  # llama-tiny attention widths


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

def memory(seq: int) -> None:
    print(f"\n(a) temp memory per device, attention fwd+bwd, seq={seq}, heads={HEADS}, kv_heads={KV_HEADS}, "
          f"head_dim={HEAD_DIM}, batch={BATCH}, float32 (compile only)")
    rows = []
    for name, context, impl in (("dense, context=1", 1, "ring"),
                                (f"ring, context={CONTEXT}", CONTEXT, "ring"),
                                (f"allgather, context={CONTEXT}", CONTEXT, "allgather")):
        lay = layout(context)
        t = time.perf_counter()
        compiled = fwd_bwd(lay, impl).lower(*arg_shapes(lay, seq)).compile()
        rows.append((name, compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - t))
    dense = rows[0][1]
    print(f"  {'strategy':<24}{'temp / device':>16}{'vs dense':>12}{'compile s':>11}")
    for name, temp, secs in rows:
        print(f"  {name:<24}{temp / 2**20:>13.1f} MiB{temp / dense:>12.4f}{secs:>11.1f}")
    scores = BATCH * HEADS * seq * seq * 4
    print(f"  (one full [b, h, s, s] float32 score matrix is {scores / 2**20:.0f} MiB; the ideal "
          f"1/{CONTEXT} share {scores / CONTEXT / 2**20:.0f} MiB)")


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


def balance(seq: int, repeats: int) -> None:
    print(f"\n(b) causal work balance over context={CONTEXT}, seq={seq}")
    print(f"  {'layout':<12}{'unmasked max/min':>18}{'ring critical path':>20}{'ring total':>12}"
          f"{'ring fwd+bwd s':>16}{'allgather fwd+bwd s':>21}")
    ring_s, ag_s = step_times(seq, "ring", repeats), step_times(seq, "allgather", repeats)
    for name in LAYOUTS:
        work = unmasked_per_device(seq, CONTEXT, name)
        path, total = ring_critical_path(seq, CONTEXT, name)
        print(f"  {name:<12}{work.max() / work.min():>18.3f}{path:>13} quarters{total:>12}"
              f"{ring_s[name]:>16.3f}{ag_s[name]:>21.3f}")
    print(f"  (critical path: sum over the {CONTEXT} ring steps of the busiest device's quarter blocks; "
          f"a full block is 4 quarters. Simulated devices share this host's {jax.local_devices()[0].platform} "
          "cores, so step time tracks total work, not the critical path.)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-memory", type=int, default=32768)
    parser.add_argument("--seq-time", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    memory(args.seq_memory)
    balance(args.seq_time, args.repeats)


if __name__ == "__main__":
    main()
