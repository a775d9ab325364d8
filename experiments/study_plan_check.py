"""Study (q): does `jaxpar plan` claim to beat the published runs, and by how much, and why?

    python experiments/study_plan_check.py           # every published training run of the stacks, ~4 min
    python experiments/study_plan_check.py --quick   # four small runs (two stacks), seconds

Question. On each published run's own model, cluster, global batch, sequence, precision and stack (read as
experiments/study_stacks.py reads jaxpar/cost/published/), what does the planner rank
first, and how does its predicted throughput compare with the cost model's prediction for the layout the run
published? A gain within the band `plan` ties with (planner.tie_band: the paired band, how far the model's
ratio of two published layouts' speeds fell from the published ratio, jaxpar/cost/bands.toml) is a tie: the
model cannot tell the two apart, and the published layout stands. A gain beyond it is the model's claim,
never a recommendation.

Method. `jaxpar.planning.planner.plan` with the run's stack preset (`Software.remats`, `pp_schedules`,
`pp_interleaved`, `axes`: what that stack runs) and its dtype, every fitting candidate ranked by predicted
tokens/s; the published layout is priced by `estimate` exactly as study_stacks prices it. Each row says what
mainly separates the planner's plan from the published one: activations kept that the run recomputed (made
room for by gradient accumulation), the published pipeline's bubble, or another mesh. The planner knows
neither the date of the run (torchtitan had no gradient accumulation in December 2024; MaxText none in 2023)
nor a TPU run's slices (its meshes treat a multi-slice run's chips as one cluster).
"""
from __future__ import annotations

import statistics

from _study import arguments, finish, md_table, progress

import study_stacks
from jaxpar.cost import SOFTWARE, estimate, load_hardware
from jaxpar.cost.band import band_for
from jaxpar.planning import planner

QUICK = ("llama2_7b 8 h100-sxm", "mpt_1b 64", "mpt_7b 8 a100", "llama3_1_8b 8 b200")


VERDICTS = ("tie", "claim of the model")


def verdict(gain: float, band: float) -> str:
    """A tie within the paired band (the published layout stands); beyond it, the model's claim."""
    return VERDICTS[gain > band]


def why(pub, top, pub_est) -> str:
    """What mainly separates the planner's plan `top` from the published layout `pub` (strategies)."""
    o, t = pub.options, top.options
    reasons = []
    if o.remat != t.remat:
        reasons.append(f"remat {o.remat} -> {t.remat}")
    if t.grad_accum > o.grad_accum:
        reasons.append(f"accumulation {o.grad_accum} -> {t.grad_accum} steps")
    bubble = pub_est.time.bubble / pub_est.time.total
    if pub.size("pipeline") > 1 and bubble > 0.1:
        reasons.append(f"the published pipeline idles {bubble:.0%} (S={pub.size('pipeline')}, M={o.microbatches})")
    if {a: n for a, n in pub.mesh if n > 1} != {a: n for a, n in top.mesh if n > 1}:
        reasons.append("another mesh")
    return "; ".join(reasons) or "the same layout"


def check(row, st) -> dict:
    """The planner's fastest fitting plan beside the published layout for one published run."""
    hw, sw = load_hardware(row.hardware), SOFTWARE[row.software]
    pub = estimate(row.model, st, hw, row.global_batch, row.seq, sw)
    plans, _, _ = planner.plan(row.model, hw, st.num_devices, row.seq, row.global_batch, top=10**9, software=sw,
                               dtype=st.options.dtype, grad_dtype=st.options.grad_dtype)
    best, top = max(plans, key=lambda p: p[0].tokens_per_s)
    b = band_for(hw.family, sw.name)
    band, worst = planner.tie_band(pub), (b.oos_worst if b.oos_worst is not None else b.worst) if b else planner.TIE_BAND
    gain = best.tokens_per_s / pub.tokens_per_s - 1
    return {"row": row, "published": pub, "best": best, "top": top, "gain": gain, "band": band, "worst": worst,
            "verdict": verdict(gain, band), "why": why(st, top, pub) if gain > band else "-"}


def checks(rows: list) -> list[dict]:
    out = []
    with progress(len(rows), "runs") as bar:
        for row, st in rows:
            out.append(check(row, st))
            bar.update()
    return out


def body(results: list[dict]) -> list[str]:
    table = [[r["row"].source, r["row"].label, r["row"].software, f"{r['published'].tokens_per_s / r['published'].devices:,.0f}",
              f"{r['top'].name} ({r['top'].options.remat}, accumulation {r['top'].options.grad_accum})",
              f"{r['best'].tokens_per_s / r['best'].devices:,.0f}", f"{r['gain']:+.1%}", f"±{r['band']:.1%}",
              r["verdict"], r["why"]] for r in results]
    counts = {v: sum(1 for r in results if r["verdict"] == v) for v in VERDICTS}
    by_stack: dict[str, list[float]] = {}
    for r in results:
        by_stack.setdefault(r["row"].software, []).append(r["gain"])
    lines = [f"{len(results)} published runs; the planner's fastest plan is a tie with the published layout on "
             f"{counts['tie']} (within the paired band: the published layout stands) and claimed faster beyond it on "
             f"{counts['claim of the model']} runs: the model's claim, not a recommendation.", "",
             *md_table(["stack", "runs", "median gain", "largest gain"],
                       [[s, len(g), f"{statistics.median(g):+.1%}", f"{max(g):+.1%}"] for s, g in sorted(by_stack.items())]),
             "",
             *md_table(["source", "run", "stack", "published layout, predicted tok/s/dev", "planner's fastest plan",
                        "its tok/s/dev", "gain", "band", "verdict", "what separates them"], table)]
    return lines


def figure(results: list[dict]):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        stacks = sorted({r["row"].software for r in results})
        for i, s in enumerate(stacks):
            gains = [100 * r["gain"] for r in results if r["row"].software == s]
            ax.scatter([i] * len(gains), gains, alpha=0.7)
            bands = [100 * r["band"] for r in results if r["row"].software == s]
            ax.hlines(max(bands), i - 0.3, i + 0.3, colors="k", linestyles="--", linewidth=1)
        ax.set_xticks(range(len(stacks)), stacks)
        ax.set_ylabel("planner's fastest plan over the published layout (%)")
        ax.set_title("Does the planner claim to beat the published runs? (dashed: the band plan ties within)")
        fig.tight_layout()
        return fig
    return draw


def main() -> int:
    args = arguments(__doc__, {})
    rows, _ = study_stacks.read_rows()
    ok, _ = study_stacks.predictions(rows)
    if args.quick:
        ok = [(row, st) for row, st in ok if any(q in row.label for q in QUICK)]
    results = checks(ok)
    lines = body(results)
    print("\n".join(lines))
    finish(args, "study_plan_check", "Does the planner claim to beat the published runs?", lines, figure(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
