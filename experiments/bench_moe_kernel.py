"""The grouped MoE kernel against the padded one: step time, expert FLOPs and all-to-all bytes per token.

    python experiments/bench_moe_kernel.py [--model M] [--layouts ep8 data=4,expert=2] [--batch 16] [--seq 64]
    python experiments/bench_moe_kernel.py --quick      # smoke test: ep8, batch 8 x seq 16, 1 timed step

For each layout and each `moe_kernel` (grouped: jaxpar/ops/moe_grouped.py; padded: jaxpar/ops/moe.py's
static buffers) one train step on 8 simulated CPU devices, and per token:
    step ms             fastest of --steps after a compile step
    expert MFLOP        the cost model's expert matmul FLOPs of the forward, all MoE layers (jaxpar.cost.flops:
                        k copies per token for grouped, E * C_loc / s_loc rows for padded)
    XLA MFLOP           XLA's cost analysis of the whole compiled step (forward, backward, optimizer)
    a2a B compiled      the expert all-to-alls' bytes in the compiled step (HLO tally), forward and backward
    a2a B model         the cost model's for the same step on XLA:CPU (bucketed for grouped)
    a2a B GPU model     the cost model's on GPU/TPU, where the grouped kernel's ragged all-to-all moves only
                        the routed copies
Prints only. CPU caveat (printed): XLA:CPU expands jax.lax.ragged_dot to a dense masked product over every
expert, so on CPU the grouped kernel computes E x the routed FLOPs (its XLA MFLOP and step time show the
expansion), and it has no ragged all-to-all, so the bucketed form sends a fixed worst-case bucket; the
saving is real on GPU and TPU, where ragged_dot is a grouped matmul. Simulated devices share this host's
cores, so step times track the total work of all 8.
"""
from __future__ import annotations

import argparse
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

from _bench import host_params  # noqa: E402 (experiments/_bench.py)
from jaxpar.analysis import comm as analysis_comm  # noqa: E402
from jaxpar.analysis.tally import tally_compiled  # noqa: E402
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.cost import comm as cost_comm  # noqa: E402
from jaxpar.cost.flops import expert_flops, expert_rows  # noqa: E402
from jaxpar.cost.shape import step_shape  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.training.data import Synthetic  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: E402

KERNELS = ("grouped", "padded")
QUICK = dict(batch=8, seq=16, steps=1, layouts=["ep8"])
CAVEAT = ("CPU caveat: XLA:CPU expands ragged_dot to a dense masked product over every expert (E x the routed "
          "FLOPs: see XLA MFLOP and step ms) and has no ragged all-to-all (the grouped kernel sends fixed "
          "worst-case buckets); on GPU and TPU ragged_dot is a grouped matmul and only routed copies travel "
          "(a2a B GPU model).")


def a2a_bytes(collectives) -> float:
    return sum(c.bytes for c in collectives if c.kind == "all-to-all" and c.axes == ("expert",))


def measure(model: str, layout: str, kernel: str, batch: int, seq: int, steps: int) -> dict:
    strategy = parse_strategy(layout).with_options(moe_kernel=kernel)
    tr = Trainer(parse_model(model), strategy, TrainConfig(batch=batch, seq=seq, steps=steps))
    compiled = tr.lower_step().compile(analysis_comm.ANALYSIS_COMPILER_OPTIONS)
    state, src = tr.state_from_params(host_params(tr)), Synthetic(tr.model_cfg.vocab)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, tr.batch(src, step))
        float(metrics["loss"])
        times.append(time.perf_counter() - t0)
    m, st, tokens = tr.model_cfg, tr.strategy, batch * seq
    shape = step_shape(m, st, batch, seq)
    rows = expert_rows(m, seq, st.size("context"), padded=kernel == "padded")
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {"layout": layout, "kernel": kernel, "step_ms": 1e3 * min(times[1:]),
            "expert_mflop": expert_flops(m, 1.0, rows).matmul * m.moe_layers / 1e6,
            "xla_mflop": analysis.get("flops", 0.0) * st.num_devices / tokens / 1e6,
            "a2a": a2a_bytes(tally_compiled(compiled, tr.mesh)) * st.num_devices / tokens,
            "a2a_model": a2a_bytes(cost_comm.collectives(m, st, shape, compiler="cpu")) * st.num_devices / tokens,
            "a2a_gpu": a2a_bytes(cost_comm.collectives(m, st, shape, compiler="gpu")) * st.num_devices / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --quick: see top
    ap.add_argument("--model", default="moe-tiny", help="an MoE model (pattern with E)")
    ap.add_argument("--layouts", nargs="+", default=["ep8", "data=4,expert=2"], help="8-device layouts")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (the fastest counts)")
    ap.add_argument("--quick", action="store_true", help="smoke test: ep8, batch 8 x seq 16, 1 step")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    m = parse_model(args.model)
    print(f"{args.model}: {m.experts} experts, top-{m.top_k}, capacity_factor {m.capacity_factor}; batch "
          f"{args.batch} x seq {args.seq}, 8 simulated CPU devices; bytes and FLOPs per token, all devices")
    print(f"{'layout':<18}{'kernel':<9}{'step ms':>9}{'expert MFLOP':>14}{'XLA MFLOP':>11}"
          f"{'a2a B compiled':>16}{'a2a B model':>13}{'a2a B GPU model':>17}")
    for layout in args.layouts:
        for kernel in KERNELS:
            r = measure(args.model, layout, kernel, args.batch, args.seq, args.steps)
            print(f"{r['layout']:<18}{r['kernel']:<9}{r['step_ms']:>9.1f}{r['expert_mflop']:>14.4f}"
                  f"{r['xla_mflop']:>11.3f}{r['a2a']:>16,.0f}{r['a2a_model']:>13,.0f}{r['a2a_gpu']:>17,.0f}")
    print(CAVEAT)


if __name__ == "__main__":
    main()
