"""Study (e), ZeRO stages: what DP, ZeRO-1 and FSDP (ZeRO-3) cost in memory per device and bytes per step.

    python experiments/study_zero_stages.py            # full: a 4-layer d=256 model compiled + llama3-70b modelled
    python experiments/study_zero_stages.py --quick    # llama-tiny compiled + the model rows

Question. Data parallelism replicates the model state (16 bytes per parameter: float32 weights,
gradients and two Adam moments); ZeRO-1 shards the optimizer moments, FSDP everything. What does each
save, and what does it move?

Method. (1) Measured: the training step of a small model compiled on 8 simulated CPU devices under
dp8, zero1-dp8 and fsdp8 (jaxpar/training/trainer.py as `jaxpar comm` compiles it): XLA's memory analysis (the
arguments are the state and the batch) and the HLO tally's bytes per device, each beside the cost
model's prediction (jaxpar/cost/memory.py, jaxpar/cost/comm.py for XLA:CPU). (2) Modelled:
llama3-70b on 64 H100 (global batch 256 x 4096 in 4 accumulation steps, bf16, full recompute,
software jaxpar; no tensor or pipeline parallelism, to isolate the stage): memory per
device and data-parallel bytes per device per step under the three stages.

Assumptions. The textbook (Rajbhandari et al. 2020): ZeRO-1 replaces the gradient all-reduce by a
reduce-scatter plus a parameter all-gather (the same bytes: each is (n-1)/n of the buffer against the
all-reduce's 2(n-1)/n); FSDP gathers the parameters forward and again backward and reduce-scatters the
gradients (1.5x). XLA:CPU keeps reduce-scatters as all-reduces (same bytes, twice the wire bytes:
jaxpar/cost/compiler.py), so the measured wire bytes favour DP on CPU; the modelled rows use GPU traits.
Writes experiments/results/study_zero_stages.md and .png.
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before JAX starts its backend

from _bench import compiled_step  # noqa: E402
from _study import arguments, finish, md_table, progress  # noqa: E402

from jaxpar.cost import estimate, memory  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline, parse_strategy  # noqa: E402

STEM = "study_zero_stages"
MEASURED = ("dp8", "zero1-dp8", "fsdp8")
MODEL = "llama-tiny:d_model=256,heads=16,kv_heads=8,head_dim=16,mlp_dim=1024,layers=4"
BIG, DEVICES, BATCH, SEQ = "llama3-70b", 64, 256, 4096
STAGES = {"ZeRO-0 (DP)": ("data=64", 0), "ZeRO-1": ("data=64", 1), "ZeRO-3 (FSDP)": ("fsdp=64", 3)}


def measured(model: str, batch: int, seq: int, bar) -> list[dict]:
    rows = []
    for mesh in MEASURED:
        bar.set_description(f"compile {mesh}")
        r = compiled_step(model, parse_strategy(mesh), batch, seq, steps=1)
        st, m = r["trainer"].strategy, r["trainer"].model_cfg
        params, grads, opt = memory.state_bytes(m, st)
        rows.append({"mesh": mesh, "zero": st.zero, "state_pred": params + opt,
                     "state_xla": r["memory"].argument_size_in_bytes - memory.batch_bytes(st, batch, seq),
                     "bytes_pred": sum(c.bytes for c in r["predicted"]),
                     "bytes_hlo": sum(c.bytes for c in r["tally"])})
        bar.update()
    return rows


def modelled() -> list[dict]:
    m, rows = parse_model(BIG), []
    for name, (mesh, zero) in STAGES.items():
        st = parse_inline(mesh).with_options(zero=zero, dtype="bfloat16", remat="full", grad_accum=4)
        est = estimate(m, st, "h100-sxm", BATCH, SEQ)
        rows.append({"stage": name, "params": est.memory.params, "grads": est.memory.grads,
                     "optimizer": est.memory.optimizer, "activations": est.memory.activations,
                     "total": est.memory.total, "fits": est.fits,
                     "data_bytes": sum(c.bytes for c in est.collectives), "mfu": est.mfu})
    return rows


def figure(plt, meas, mod):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(meas))
    ax.bar([i - 0.2 for i in x], [r["state_pred"] / 2**20 for r in meas], 0.4, label="cost model")
    ax.bar([i + 0.2 for i in x], [r["state_xla"] / 2**20 for r in meas], 0.4, label="compiled (XLA)")
    ax.set_xticks(list(x), [r["mesh"] for r in meas])
    ax.set(ylabel="weights + Adam state, MiB per device", title="(1) 8 simulated devices: model vs compiled")
    ax.set_ylim(0, 1.15 * max(r["state_xla"] for r in meas) / 2**20)
    ax.legend(fontsize=8)
    bottom = [0.0] * len(mod)
    for part in ("params", "grads", "optimizer", "activations"):
        vals = [r[part] / 2**30 for r in mod]
        bx.bar(range(len(mod)), vals, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.axhline(80e9 / 2**30, color="black", linestyle="--", linewidth=1, label="H100 80 GB")
    bx.set_xticks(range(len(mod)), [r["stage"] for r in mod])
    bx.set(ylabel="GiB per device", title=f"(2) {BIG} on {DEVICES} H100 (model)")
    bx.set_ylim(0, 1.1 * max(bottom))
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(model="llama-tiny", batch=16, seq=32), model=(str, MODEL, "compiled model"),
                     batch=(int, 16, "global batch, sequences"), seq=(int, 128, "sequence length"))
    with progress(len(MEASURED), "strategy") as bar:
        meas = measured(args.model, args.batch, args.seq, bar)
    mod = modelled()
    mib, gib = 2**20, 2**30
    body = [f"## (1) {args.model} on 8 simulated CPU devices, batch {args.batch} x {args.seq}, float32", "",
            *md_table(["strategy", "ZeRO", "state MiB/device (model)", "state MiB/device (compiled)", "state error",
                       "bytes/step (model)", "bytes/step (compiled)", "bytes error"],
                      [[r["mesh"], r["zero"], f"{r['state_pred'] / mib:.3f}", f"{r['state_xla'] / mib:.3f}",
                        f"{r['state_pred'] / r['state_xla'] - 1:+.2%}", f"{r['bytes_pred'] / mib:.2f} MiB",
                        f"{r['bytes_hlo'] / mib:.2f} MiB", f"{r['bytes_pred'] / r['bytes_hlo'] - 1:+.2%}"]
                       for r in meas]), "",
            "State: weights + Adam moments (the arguments XLA keeps, minus the batch); gradients live in the "
            "step's temporaries. Bytes: every collective's full buffer per device per step (the HLO tally).", "",
            f"## (2) {BIG} on {DEVICES} H100, batch {BATCH} x {SEQ} in 4 accumulation steps, bf16, full recompute "
            "(model, GPU traits)", "",
            *md_table(["stage", "params GiB", "grads GiB", "optimizer GiB", "activations GiB", "total GiB", "fits",
                       "collective bytes/step GiB", "MFU"],
                      [[r["stage"], f"{r['params'] / gib:.1f}", f"{r['grads'] / gib:.1f}", f"{r['optimizer'] / gib:.1f}",
                        f"{r['activations'] / gib:.1f}", f"{r['total'] / gib:.1f}", "yes" if r["fits"] else "no",
                        f"{r['data_bytes'] / gib:.1f}", f"{100 * r['mfu']:.1f}%"] for r in mod])]
    print("\n".join(body))
    finish(args, STEM, "Study (e): ZeRO stages", body, lambda plt: figure(plt, meas, mod))


if __name__ == "__main__":
    main()
