"""What the analytic studies (experiments/study_*.py) share: the command line, a constrained plan
search, markdown tables, the colour palette and figure saving.

Not a study itself (the leading underscore keeps tests/test_experiments.py from running it). Every
study: `--quick` (a few configurations, seconds: what the test suite runs), `--out DIR` (results
markdown and figure; default experiments/results/), `--format png|svg`, and in full mode the PNG is
also written small under experiments/figures/, where experiments/README.md shows it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from jaxpar.planning import planner  # noqa: E402
from jaxpar.cost import band as error_band, estimate  # noqa: E402
from jaxpar.cost.hardware import load_hardware  # noqa: E402
from jaxpar.cost.software import JAXPAR  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.core.strategy import AXES, Strategy  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
FIGURES = ROOT / "experiments" / "figures"
# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision deficiencies
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442", "#000000"]
SHORT = {"data": "DP", "fsdp": "FSDP", "pipeline": "PP", "context": "CP", "expert": "EP", "tensor": "TP"}


def arguments(doc: str, quick: dict, **extra) -> argparse.Namespace:
    """--quick, --out, --format, --figures, plus `extra` (name -> (type, default, help)); quick values
    become the defaults under --quick, options given explicitly still win."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="a few configurations, seconds (the test suite's run)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where <study>.md and the figure go")
    ap.add_argument("--format", choices=("png", "svg"), default="png", help="figure format")
    ap.add_argument("--figures", type=pathlib.Path, default=None,
                    help="also write a small PNG here (default: experiments/figures/ in full mode, none in --quick)")
    for name, (kind, default, help_) in extra.items():
        ap.add_argument(f"--{name}", type=kind, default=default, help=help_)
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(**quick)
        args = ap.parse_args()
    elif args.figures is None:
        args.figures = FIGURES
    return args


def progress(total: int, what: str):
    """A progress bar over a sweep, on a terminal only (as the bench scripts do)."""
    return tqdm(total=total, unit=what, disable=not sys.stdout.isatty(), dynamic_ncols=True, leave=False)


# ---- searching layouts -----------------------------------------------------------------------------

def layout(st: Strategy) -> str:
    """A strategy's mesh in the papers' words: 'TP8 PP16 DP64' (inner axes first), ZeRO stage appended."""
    parts = [f"{SHORT[a]}{n}" for a, n in reversed(st.mesh) if n > 1] or ["1 device"]
    if st.zero == 1:
        parts.append("ZeRO-1")
    return " ".join(parts)


def options(sizes: dict, batch: int, units: int, software=JAXPAR):
    """The planner's option candidates for `software` (jaxpar.planning.planner.candidate_options) plus
    interleaved schedules it does not try: v = 2, 4 and units // stages chunks per stage when the stages do
    not divide the units (the planner tries v = units / stages only, when it is whole; uneven chunks:
    jaxpar/core/schedule.py), each of the stack's interleaved schedules (Software.pp_interleaved)."""
    stages = sizes["pipeline"]
    for o in planner.candidate_options(sizes, batch, units, software=software):
        yield o
        if stages > 1 and o.pp_repeats == 1 and o.pp_schedule == software.pp_schedules[0] and o.microbatches >= stages:
            for v in sorted({2, 4, units // stages} - {1, units / stages}):
                if 1 < v and stages * v <= units:
                    for kind in software.pp_interleaved:
                        yield dataclasses.replace(o, pp_schedule=kind, pp_repeats=v)


def search(model, hw, devices: int, seq: int, batch: int, software, keep=lambda sizes: True,
           key=lambda st: 0, max_tensor: int | None = None) -> dict:
    """Best fitting (estimate, strategy) by tokens/s for each `key(strategy)`, over the planner's
    candidates (jaxpar.planning.planner: meshes, remat x accumulation x ZeRO x micro-batches x schedule; `options`
    adds interleaved schedules) whose sizes pass `keep`. Layouts the planner does not rank for `software`
    (planner.check_plannable: refused by jaxpar.core.validate, or not costed) are skipped (counted under 'refused');
    best["valid"][k] counts the valid candidates under key k, whether they fit or not."""
    max_tensor = max_tensor or min(hw.devices_per_node, devices)
    best, counts, valid = {}, {"considered": 0, "refused": 0, "fit": 0}, {}
    experts = model.experts if model.moe_layers else 0
    for sizes in planner.candidate_meshes(devices, max_tensor, experts):
        if not keep(sizes) or not planner.runs(software, sizes):
            continue
        for opts in options(sizes, batch, model.units, software):
            counts["considered"] += 1
            st = Strategy(name="-".join(f"{a}{sizes[a]}" for a in AXES if sizes[a] > 1) or "single",
                          mesh=tuple((a, sizes[a]) for a in AXES), options=opts)
            try:
                planner.check_plannable(model, st, batch, seq, software.jaxpar_program)
            except ConfigError:
                counts["refused"] += 1
                continue
            k = key(st)
            valid[k] = valid.get(k, 0) + 1
            est = estimate(model, st, hw, batch, seq, software)
            if not est.fits:
                continue
            counts["fit"] += 1
            if k not in best or est.tokens_per_s > best[k][0].tokens_per_s:
                best[k] = (est, st)
    best["counts"], best["valid"] = counts, valid
    return best


# ---- the error band: which differences the model can tell apart ----------------------------------

def band(hardware: str, software: str) -> float:
    """The share within which two of the study's predictions are a tie: the cost model's out-of-sample
    median error on published runs of `software` on `hardware`'s family (jaxpar/cost/bands.toml, written by
    study_stacks.py); 0 where no published run calibrates the pair (then the study says so: `band_line`)."""
    b = error_band.band_for(load_hardware(hardware).family, software)
    return b.guide() if b else 0.0


def band_line(hardware: str, software: str) -> str:
    """One sentence for a results file: the band the study's comparisons use, and where it comes from."""
    fam = load_hardware(hardware).family
    b = error_band.band_for(fam, software)
    if b is None:
        return (f"Error band: none: no published {software} run on {fam} calibrates the model, so the "
                "figures below rank layouts by the model alone.")
    oos = "out of sample" if b.oos_median is not None else "in sample (no other source covers this family)"
    return (f"Error band: ±{b.guide():.1%} ({oos} median over {b.runs} published {software} runs on {fam}, "
            f"worst {b.oos_worst if b.oos_worst is not None else b.worst:.0%}; jaxpar/cost/bands.toml). "
            "Predictions closer than the band are ties.")


def versus(a: float, b: float, share: float) -> str:
    """'a tie' when a and b (higher is better) are within `share` of each other, else how far a leads or trails."""
    diff = a / b - 1
    if abs(diff) <= share:
        return f"a tie ({diff:+.1%}, inside ±{share:.1%})"
    return f"{'ahead' if diff > 0 else 'behind'} by {abs(diff):.1%}"


# ---- writing --------------------------------------------------------------------------------------

def md_table(headers: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def write_results(args, stem: str, title: str, body: list[str]) -> pathlib.Path:
    """<out>/<stem>.md: the title, the mode and the command that wrote it, then `body`."""
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(a) for a in [f"experiments/{stem}.py", *sys.argv[1:]])
    head = [f"# {title}", "", f"mode: {'quick' if args.quick else 'full'}; written by `{command}`", ""]
    path = args.out / f"{stem}.md"
    path.write_text("\n".join(head + body) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.rcParams.update({"axes.prop_cycle": matplotlib.cycler(color=OKABE_ITO), "font.size": 9,
                         "axes.grid": True, "grid.alpha": 0.3})
    return plt


def save_figure(fig, args, stem: str) -> str:
    """<out>/<stem>.<format>, and in full mode a small PNG under experiments/figures/."""
    path = args.out / f"{stem}.{args.format}"
    fig.savefig(path, dpi=110)
    if args.figures is not None:
        args.figures.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.figures / f"{stem}.png", dpi=80)
    return path.name


def finish(args, stem: str, title: str, body: list[str], figure) -> None:
    """Write the results file and the figure (`figure(plt) -> fig`, skipped without matplotlib); say where."""
    md = write_results(args, stem, title, body)
    plt = pyplot()
    if plt is None:
        print(f"\nwritten to {md}; no figure: matplotlib is not installed")
        return
    fig = figure(plt)
    name = save_figure(fig, args, stem)
    plt.close(fig)
    print(f"\nwritten to {md} and {args.out / name}")
