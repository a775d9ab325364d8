"""Collective matmul on 8 devices: tensor x sequence parallelism with and without the `overlap` option.

    python experiments/bench_overlap.py [--steps 3] [--batch 16] [--seq 256] [--out DIR]
    python experiments/bench_overlap.py --quick      # smoke test: a few seconds

One model (llama-tiny widened: d_model 256, 16 heads of 16, MLP 1024, 4 layers), one train step per
(layout, overlap) on 8 simulated CPU devices, for tensor x SP layouts (tp8-sp: tensor=8; dp2-tp4-sp:
data=2, tensor=4), each under overlap = none (XLA's all-gathers and reduce-scatters),
collective_matmul (unidirectional rings of ppermutes between partial matmuls) and
collective_matmul_bidir. For each: step time (fastest of --steps, after a compile step), the compiled
step's collectives over `tensor` (all-gathers, reduce-scatters and all-reduces vs collective-permutes,
counted per step), its wire bytes per token (every collective, from the HLO tally) and the cost model's
for the same step (jaxpar.cost.comm, XLA:CPU traits). Prints the table and writes it to
experiments/results/bench_overlap.md (or --out DIR).

What CPU figures can and cannot show. XLA:CPU runs every collective synchronously (no start/done pairs,
no second stream), so a ring's permutes cannot hide behind its dots here: the step times measure the
rings' extra small ops and copies on simulated devices that share this host's cores, not the overlap a
GPU or TPU gets (that needs a node with 8 accelerators and XLA's latency-hiding scheduler). The wire
bytes are the layout's own: a ring sends (tensor-1)/tensor of the activation, as the ring all-gather
and reduce-scatter it replaces.

Beside the CPU measurements, what the cost model predicts the options buy on an H100 node
(jaxpar/cost/overlap.py: which collectives each option issues beside compute, bounded by the compute):
llama3-70b on 64 H100 (fsdp=8 x tensor=8, SP, remat full, batch 256 x seq 4096), the step and the
tensor and data communication left exposed, per option. These are predictions until an accelerator
measures them (the device tool; none was lent so far).

--quick: llama-tiny itself, dp2-tp4-sp with overlap none and collective_matmul, batch 16 x seq 32, 1
timed step, XLA's backend optimisations off (quick timings mean nothing). Options given explicitly
still win.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

from _bench import compiled_step  # noqa: E402 (experiments/_bench.py)
from jaxpar.core.strategy import parse_strategy  # noqa: E402

MODEL = "llama-tiny:d_model=256,heads=16,kv_heads=8,head_dim=16,mlp_dim=1024,layers=4"
LAYOUTS = {"tp8-sp": "tensor=8", "dp2-tp4-sp": "data=2,tensor=4"}
OVERLAPS = ("none", "collective_matmul", "collective_matmul_bidir")
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(model="llama-tiny", batch=16, seq=32, steps=1, layouts=["dp2-tp4-sp"],
             overlaps=["none", "collective_matmul"])


def measure(model: str, layout: str, overlap: str, batch: int, seq: int, steps: int) -> dict:
    strategy = parse_strategy(LAYOUTS[layout]).with_options(sequence_parallel=True, overlap=overlap)
    r = compiled_step(model, strategy, batch, seq, steps)
    tally, tokens = r["tally"], r["tokens"]
    over_tensor = [c for c in tally if c.axes == ("tensor",)]
    return {"layout": layout, "overlap": overlap, "step_s": r["step_s"], "tokens_per_s": tokens / r["step_s"],
            "gathers": sum(c.count for c in over_tensor if c.kind in ("all-gather", "reduce-scatter", "all-reduce")),
            "permutes": sum(c.count for c in over_tensor if c.kind == "collective-permute"),
            "wire": sum(c.wire_bytes for c in tally) / tokens,
            "predicted": sum(c.wire_bytes for c in r["predicted"]) / tokens}


PREDICT = ("llama3-70b", "fsdp=8,tensor=8", "h100-sxm", 256, 4096)
OPTION_SETS = (("none", {}), ("collective_matmul", dict(overlap="collective_matmul")),
               ("fsdp_prefetch", dict(fsdp_prefetch=True)), ("xla_preset gpu_overlap", dict(xla_preset="gpu_overlap")),
               ("xla_preset gpu_windowed_einsum", dict(xla_preset="gpu_windowed_einsum")),
               ("all three", dict(overlap="collective_matmul", fsdp_prefetch=True, xla_preset="gpu_overlap")))


def predicted_rows() -> tuple[str, list[str]]:
    """The cost model's step on PREDICT's layout under each option set (module docstring)."""
    from jaxpar.cost.estimate import estimate  # noqa: PLC0415
    from jaxpar.models.config import parse_model  # noqa: PLC0415
    name, mesh, hw, batch, seq = PREDICT
    base = parse_strategy(mesh).with_options(sequence_parallel=True, remat="full")
    title = f"{name} on 64 x {hw} [{mesh}], SP, remat full, batch {batch} x seq {seq} (cost model)"
    rows = []
    for label, options in OPTION_SETS:
        st = base.with_options(**options).resolved(base.num_devices)
        t = estimate(parse_model(name), st, hw, batch, seq).time
        rows.append(f"| {label} | {t.total:.3f} | {t.compute:.3f} | {t.tensor:.3f} | {t.data:.3f} | {t.data_total:.3f} |")
    return title, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--model", default=MODEL, help="a model with attention blocks")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (the fastest counts)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="tensor x SP layouts")
    ap.add_argument("--overlaps", nargs="+", default=list(OVERLAPS), choices=OVERLAPS, help="overlap option values")
    ap.add_argument("--quick", action="store_true", help="smoke test: llama-tiny, a few seconds")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_overlap.md goes")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    rows = [measure(args.model, layout, overlap, args.batch, args.seq, args.steps)
            for layout in args.layouts for overlap in args.overlaps]
    title = (f"{args.model}, batch {args.batch} x seq {args.seq}, sequence parallelism, 8 simulated CPU devices "
             f"(XLA:CPU: collectives are synchronous, so nothing overlaps), fastest of {args.steps} steps")
    head = ("| layout | overlap | step s | tokens/s | AG/RS/AR over tensor | permutes over tensor "
            "| wire B / token | predicted wire B / token |")
    md = ["# Collective matmul: tensor x SP with and without the overlap option (CPU)", "", title, "",
          head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    print(title)
    print(f"{'layout':<12}{'overlap':<25}{'step s':>9}{'tokens/s':>11}{'AG/RS/AR':>10}{'permutes':>10}"
          f"{'wire B/tok':>12}{'model B/tok':>13}")
    for r in rows:
        print(f"{r['layout']:<12}{r['overlap']:<25}{r['step_s']:>9.3f}{r['tokens_per_s']:>11,.0f}{r['gathers']:>10}"
              f"{r['permutes']:>10}{r['wire']:>12,.0f}{r['predicted']:>13,.0f}")
        md.append(f"| {r['layout']} | {r['overlap']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['gathers']} "
                  f"| {r['permutes']} | {r['wire']:,.0f} | {r['predicted']:,.0f} |")
    note = ("(AG/RS/AR: all-gathers, reduce-scatters and all-reduces over tensor per step, the embedding's, the "
            "head's and the norm weights' gradients included; wire bytes: what one device sends under the ring "
            "model, from the compiled HLO (XLA:CPU keeps the partitioner's reduce-scatters as all-reduces, twice "
            "the wire bytes of a ring, and sums q/k/v's input gradients one by one, so the option's bytes are lower "
            "here than a GPU's textbook comparison would show); predicted: the cost model for the same step. "
            "CPU step times: "
            "simulated devices share this host's cores and run collectives synchronously; they show the rings' "
            "overhead, not the overlap an accelerator gets.)")
    print(note)
    title, predicted = predicted_rows()
    md += ["", note, "", "## Predicted on an H100 node (jaxpar/cost/overlap.py)", "", title, "",
           "| options | step s | compute s | tensor exposed s | data exposed s | data total s |",
           "|---|---:|---:|---:|---:|---:|", *predicted]
    note = ("(tensor and data exposed: what the model leaves on the critical path after hiding what each option "
            "issues beside compute; predictions, not measurements)")
    print("\n" + title)
    print("\n".join(predicted))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_overlap.md").write_text("\n".join(md + ["", note]) + "\n")
    print(f"\nwritten to {args.out / 'bench_overlap.md'}")


if __name__ == "__main__":
    main()
