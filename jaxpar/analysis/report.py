"""Presenting `jaxpar comm` reports: a table per report, several side by side, and a bar chart."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxpar.collectives import KINDS, PHASES, human_bytes


def human_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def mesh_label(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "1 device"


def _rows(report: dict) -> dict[tuple[str, str, str], dict]:
    return {(c["kind"], ",".join(c["axes"]), c["phase"]): c for c in report["collectives"]}


def _row_order(keys: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return sorted(set(keys), key=lambda k: (KINDS.index(k[0]), k[1], PHASES.index(k[2])))


def format_table(report: dict) -> str:
    """One report as text: kind x axes x phase with totals, then FLOPs, memory and warnings."""
    lines = [f"{report['model']} on {mesh_label(report['mesh'])} ({report['devices']} devices), "
             f"per device per step, compiled by {report.get('compiler', 'XLA:CPU')}"]
    if "reduced_from" in report:
        r = report["reduced_from"]
        lines.append(f"  compiled at {mesh_label(r['compiled_mesh'])} ({r['compiled_devices']} devices, "
                     f"batch {r['compiled_batch']} of {r['batch']}) and rescaled: see reduced_from")
    head = f"{'kind':<20}{'axes':<16}{'phase':<11}{'count':>7}{'bytes':>14}{'wire bytes':>14}"
    lines += ["", head, "-" * len(head)]
    rows = _rows(report)
    for key in _row_order(rows):
        c = rows[key]
        lines.append(f"{key[0]:<20}{key[1]:<16}{key[2]:<11}{c['count']:>7}"
                     f"{human_bytes(c['bytes']):>14}{human_bytes(c['wire_bytes']):>14}")
    t = report["totals"]
    lines += ["-" * len(head),
              f"{'total':<47}{t['count']:>7}{human_bytes(t['bytes']):>14}{human_bytes(t['wire_bytes']):>14}", ""]
    m = report["memory"]
    lines.append(f"FLOPs per device  {human_flops(report['flops_per_device'])} "
                 f"(matmuls {human_flops(report['matmul_flops_per_device'])})")
    lines.append("memory per device " + ", ".join(f"{k} {human_bytes(m[k])}" for k in ("argument", "output", "temp", "peak")))
    lines.append(f"compile           {report['compile_seconds']:.1f} s")
    if report.get("warnings"):
        lines += ["", "notes:"] + [f"  - {w}" for w in report["warnings"]]
    return "\n".join(lines)


def report_name(report: dict) -> str:
    return report.get("name") or mesh_label(report["mesh"])


def compare(reports: Sequence[dict]) -> str:
    """Several reports side by side: bytes per kind x axes x phase, totals, FLOPs, memory, runs."""
    names = [report_name(r) for r in reports]
    width = max(14, *(len(n) + 2 for n in names))
    label = 47
    head = f"{'kind / axes / phase':<{label}}" + "".join(f"{n:>{width}}" for n in names)
    compilers = sorted({r.get("compiler", "XLA:CPU") for r in reports})
    lines = [f"model {reports[0]['model']}, per device per step (bytes), compiled by {', '.join(compilers)}", "",
             head, "-" * len(head)]
    all_rows = [_rows(r) for r in reports]
    for key in _row_order(k for rows in all_rows for k in rows):
        cells = [human_bytes(rows[key]["bytes"]) if key in rows else "-" for rows in all_rows]
        lines.append(f"{' / '.join(key):<{label}}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append("-" * len(head))

    def row(title: str, values: Iterable[str]) -> None:
        lines.append(f"{title:<{label}}" + "".join(f"{v:>{width}}" for v in values))

    row("total bytes", (human_bytes(r["totals"]["bytes"]) for r in reports))
    row("total wire bytes", (human_bytes(r["totals"]["wire_bytes"]) for r in reports))
    row("collective instances", (str(r["totals"]["count"]) for r in reports))
    row("devices", (str(r["devices"]) for r in reports))
    row("FLOPs per device", (human_flops(r["flops_per_device"]) for r in reports))
    row("matmul FLOPs per device", (human_flops(r["matmul_flops_per_device"]) for r in reports))
    row("peak memory per device", (human_bytes(r["memory"]["peak"]) for r in reports))
    row("compile seconds", (f"{r['compile_seconds']:.1f}" for r in reports))
    if any("run" in r for r in reports):
        row("|loss - 1-device loss| (max over steps)",
            (f"{r['run']['loss_diff']:.2e}" if "run" in r else "-" for r in reports))
        row("step time (ms)", (f"{r['run']['step_time_s'] * 1e3:.1f}" if "run" in r else "-" for r in reports))
    return "\n".join(lines)


def plot(reports: Sequence[dict], path: str) -> None:
    """PNG: per strategy, stacked bars of bytes and wire bytes per device per step by kind and axes."""
    from matplotlib import colormaps, figure  # deferred: optional dependency, jaxpar[plot]

    names = [report_name(r) for r in reports]
    groups = sorted({(c["kind"], ",".join(c["axes"])) for r in reports for c in r["collectives"]},
                    key=lambda g: (KINDS.index(g[0]), g[1]))
    colors = colormaps["tab20"]
    biggest = max(max(r["totals"]["bytes"], r["totals"]["wire_bytes"]) for r in reports)
    unit, scale = ("GiB", 2**30) if biggest > 10 * 2**30 else ("MiB", 2**20) if biggest > 10 * 2**20 else ("KiB", 2**10)
    fig = figure.Figure(figsize=(max(8, 2.2 * len(names) + 4), 5))  # no pyplot: no GUI backend, no global state
    panels = fig.subplots(1, 2, sharey=True)
    for panel, field in zip(panels, ("bytes", "wire_bytes")):
        bottom = [0.0] * len(reports)
        for i, (kind, axes) in enumerate(groups):
            heights = [sum(c[field] for c in r["collectives"] if (c["kind"], ",".join(c["axes"])) == (kind, axes))
                       / scale for r in reports]
            panel.bar(names, heights, bottom=bottom, color=colors(i % 20), label=f"{kind} over {axes}")
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, top in enumerate(bottom):  # each bar's total just above it
            panel.annotate(f"{top:.3g}", (x, top), xytext=(0, 3), textcoords="offset points", ha="center",
                           fontsize=8)
        panel.set_title(field.replace("_", " ") + " per device per step")
        panel.tick_params(axis="x", rotation=30)
    panels[0].set_ylim(0, 1.15 * biggest / scale or 1)  # headroom above the tallest bar for its label
    panels[0].set_ylabel(unit)
    panels[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{reports[0]['model']}: collectives by kind and mesh axes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
