"""`format_estimate`: the human view of an Estimate -- time terms, FLOPs by block, collectives, memory."""
from __future__ import annotations

from jaxpar.collectives import human_bytes
from jaxpar.cost import band, flops
from jaxpar.cost.estimate import Estimate


def _bytes(x: float) -> str:
    return human_bytes(x, digits=1)


def _secs(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def mfu_convention(est: Estimate) -> str:
    """What MFU and HFU count: model FLOPs by one convention (flops.MODEL_FLOPS_CONVENTION) whatever the
    stack's kernel computes; hardware FLOPs as the kernel computes them (the full scores under a dense one)."""
    kernel = "the causal half" if est.causal else "the full s x s scores (a dense kernel)"
    return (f"MFU = model FLOPs ({flops.MODEL_FLOPS_CONVENTION}) / (step time x devices x bf16 peak); "
            f"HFU counts what the kernels compute: {kernel}, and the recompute")


def format_estimate(est: Estimate, recomputed: str = "") -> str:
    """The estimate as text. `recomputed`: what the step recomputes, named beside the recompute FLOPs
    (jaxpar.planning.planner.remat_label: `remat=none+QK^T`)."""
    mesh = " x ".join(f"{a}={s}" for a, s in est.mesh if s != 1) or "1 device"
    lines = [f"{est.model} on {est.devices} x {est.hardware} [{mesh}], software {est.software}: global batch "
             f"{est.global_batch:,} sequences x seq {est.seq:,} = {est.global_batch * est.seq:,} tokens",
             f"  step {_secs(est.step_time_s)}   {est.tokens_per_s:,.0f} tokens/s   "
             f"MFU {est.mfu:.1%}   HFU {est.hfu:.1%}   dominant: {est.dominant}",
             f"  {mfu_convention(est)}", f"  {band.describe(est.family, est.software)}",
             f"  {band.regime_band(est.regime).describe()}", "", "time per step:"]
    total = est.step_time_s
    for name, t in est.time.terms().items():
        if t > 0:
            lines.append(f"  {name:<15} {_secs(t):>12}  {t / total:6.1%}")
    if est.time.data_total > est.time.data:
        lines.append(f"  (data comm {_secs(est.time.data_total)} before overlap with compute)")
    e = est.energy
    if e is not None:
        lines += ["", f"energy: {e.joules_per_step / 1e3:,.1f} kJ per step, {e.joules_per_token:.3g} J per token, "
                      f"{e.average_watts:.0f} W per device on average ({e.idle_share:.0%} of it idle power; "
                      "power model: jaxpar/cost/energy.py)"]
    lines += ["", f"FLOPs per step (model {est.flops.model:.3e}, hardware {est.flops.hardware:.3e}):",
              f"  {'part':<17} {'matmul':>10} {'of model':>9} {'elementwise':>12}"]
    for name, mm, other in est.flops.by_block:
        lines.append(f"  {name:<17} {mm:>10.3e} {mm / est.flops.model:>9.1%} {other:>12.3e}")
    if est.flops.recompute:
        lines.append(f"  {'recompute':<17} {est.flops.recompute:>10.3e}" + (f"  ({recomputed})" if recomputed else ""))
    lines += ["", "collectives per device per step:",
              f"  {'kind':<19} {'axes':<22} {'phase':<10} {'count':>8} {'bytes':>12} {'wire':>12}"]
    for c in sorted(est.collectives, key=lambda c: -c.wire_bytes):
        lines.append(f"  {c.kind:<19} {','.join(c.axes):<22} {c.phase:<10} {c.count:>8.0f} "
                     f"{_bytes(c.bytes):>12} {_bytes(c.wire_bytes):>12}")
    if not est.collectives:
        lines.append("  (none)")
    mem = est.memory
    lines += ["", "memory per device:"]
    for name, b in (("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer),
                    ("activations", mem.activations), ("total", mem.total)):
        lines.append(f"  {name:<15} {_bytes(b):>12}")
    if mem.host:
        of = (f"{'fits' if est.host_fits else 'does NOT fit'} in {_bytes(est.usable_host_bytes)} of "
              f"{_bytes(est.host_memory)} host memory per device" if est.host_memory else "host memory not stated")
        lines.append(f"  {'host memory':<15} {_bytes(mem.host):>12}  (remat offload: each layer unit's input, "
                     f"not in the total; {of}; copies exposed beyond compute {est.time.host * 1e3:.1f} ms/step)")
    verdict = "fits" if est.fits else "does NOT fit"
    keep = f", keeping {est.headroom:.0%} for the runtime (--hbm-headroom)" if est.headroom else ""
    lines.append(f"  {verdict} in {_bytes(est.usable_bytes)} of {_bytes(est.hbm_bytes)} HBM{keep}: "
                 f"{mem.total / est.hbm_bytes:.0%} of HBM used")
    return "\n".join(lines)
