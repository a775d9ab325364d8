"""`jaxpar schedule --pp-schedule NAME --stages S --microbatches M`: a pipeline schedule's timetable (stage x
time: F, B, W, idle) as text and as a figure, its bubble beside the one its source states, and the
activations each stage holds (jaxpar/core/timetable.py lays it out, jaxpar/core/schedule.py states the
papers' arithmetic). Nothing is compiled: the command imports neither JAX nor a model."""
from __future__ import annotations

import argparse
import json

from jaxpar.core import timetable
from jaxpar.core.inputs import POSITIVE, nonempty, png_path, real
from jaxpar.core.schedule import stated_activations, stated_idle
from jaxpar.errors import ConfigError

MAX_STAGES, MAX_MICROBATCHES = 64, 512   # the timetable is drawn cell by cell: beyond these it is unreadable


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `schedule` on the subparsers `sub`."""
    p = sub.add_parser("schedule", help="draw a pipeline schedule's timetable and its bubble (no compilation)",
                       description="Lay out a pipeline schedule: every stage runs each pass as soon as it is "
                                   "free and the pass's input has arrived (sends cost nothing), and print the "
                                   "timetable, the bubble and the peak activations beside what the schedule's "
                                   "paper states.")
    p.add_argument("--pp-schedule", dest="kind", required=True, choices=timetable.KINDS, help="the schedule")
    p.add_argument("--stages", type=POSITIVE, required=True, metavar="S", help="pipeline stages (devices)")
    p.add_argument("--microbatches", dest="count", type=POSITIVE, required=True, metavar="M",
                   help="micro-batches per step")
    p.add_argument("--times", type=pass_times, default=timetable.Times(), metavar="F,B,W",
                   help="a stage's forward, input-gradient and weight-gradient time per micro-batch (default 1,1,1: "
                        "the papers' T_F = T_B = T_W)")
    p.add_argument("--json", type=nonempty, metavar="FILE", help="also write the timetable and bubble as JSON")
    p.add_argument("--figure", type=png_path, metavar="FILE.png", help="also draw the timetable as a PNG")
    return p


def pass_times(text: str) -> timetable.Times:
    """An argparse type: three positive times `F,B,W`."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r} must be three times F,B,W, e.g. 1,1,1")
    return timetable.Times(*(real(0.0, open_lo=True)(x) for x in parts))


def summary(t: timetable.Timetable, times: timetable.Times) -> dict:
    """The figures the command prints and `--json` carries."""
    idle, formula = stated_idle(t.kind, t.stages, times)
    held, claim = stated_activations(t.kind, t.stages, t.microbatches)
    return {"schedule": t.kind, "stages": t.stages, "microbatches": t.microbatches, "times": vars(times),
            "makespan": t.makespan, "work": t.work, "idle": t.idle, "bubble": t.bubble,
            "idle_between": t.idle_between, "stated_idle": idle, "stated_formula": formula,
            "peak_activations": [t.peak_in_flight(s) for s in range(t.stages)],
            "stated_activations": held, "stated_claim": claim,
            "slots": [{"stage": s.stage, "start": s.start, "end": s.end, "pass": s.op.kind, "microbatch": s.op.mb,
                       "chunk": s.op.chunk} for s in t.slots]}


def render(t: timetable.Timetable, info: dict) -> str:
    chunks = "two chunks per stage in a V (lower case: the second)" if t.chunks > t.stages else "one chunk per stage"
    return "\n".join([
        f"{t.kind}: {t.stages} stages, {t.microbatches} micro-batches, {chunks}; F forward, B input gradient, "
        "W weight gradient, X both (B and W), . idle",
        timetable.text(t), "",
        f"bubble {info['bubble']:.1%}: each stage idles {info['idle']:.3g} of {info['makespan']:.3g} "
        f"(its work {info['work']:.3g}) with the step's synchronization at its end",
        f"stated: {info['stated_idle']:.3g} = {info['stated_formula']}",
        f"idle between a stage's first and last pass (post-validated, no synchronization): {info['idle_between']:.3g}",
        f"peak activations per stage (chunks): {info['peak_activations']}; stated {info['stated_activations']}: "
        f"{info['stated_claim']}"])


def cmd_schedule(args) -> int:
    if args.stages > MAX_STAGES or args.count > MAX_MICROBATCHES:
        raise ConfigError(f"schedule draws at most {MAX_STAGES} stages and {MAX_MICROBATCHES} micro-batches "
                          f"(got stages={args.stages}, microbatches={args.count})")
    t = timetable.simulate(args.kind, args.stages, args.count, args.times)
    info = summary(t, args.times)
    print(render(t, info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    if args.figure:
        draw(t, args.figure)
        print(f"figure: {args.figure}")
    return 0


COLORS = {"F": "#0072B2", "B": "#D55E00", "W": "#009E73", "BW": "#CC79A7"}   # Okabe-Ito


def draw(t: timetable.Timetable, path: str) -> None:
    """The timetable as a PNG: one row per stage, one box per pass, the second chunk of a V hatched."""
    from matplotlib import figure  # deferred: optional dependency, jaxpar[plot]

    fig = figure.Figure(figsize=(min(24, 4 + t.makespan * 0.35), 1 + 0.45 * t.stages))
    ax = fig.subplots()
    for s in t.slots:
        ax.barh(s.stage, s.end - s.start, left=s.start, color=COLORS[s.op.kind], edgecolor="white",
                hatch="//" if s.op.chunk >= t.stages else None)
        ax.text((s.start + s.end) / 2, s.stage, str(s.op.mb), ha="center", va="center", fontsize=7, color="white")
    for kind in sorted({s.op.kind for s in t.slots}, key=list(COLORS).index):
        ax.barh(0, 0, color=COLORS[kind], label={"BW": "B+W"}.get(kind, kind))
    ax.set_yticks(range(t.stages), [f"stage {s}" for s in range(t.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (one stage's forward = 1)")
    ax.set_title(f"{t.kind}, S={t.stages}, M={t.microbatches}: bubble {t.bubble:.1%}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
