"""How long and how much memory does `jaxpar comm --abstract` take on pod-sized meshes?

    python experiments/bench_comm.py [--model llama3-70b] [--devices 256 2048] [--out DIR]
    python experiments/bench_comm.py --quick        # smoke test: llama-tiny on 16 devices, a few seconds

Each run is `jaxpar comm --model M --mesh fsdp=N/8,tensor=8 --abstract` in a fresh process (the
simulated device count is fixed when JAX starts), timed by wall clock, with the process's peak
resident memory from `os.wait4` (getrusage of that one child). Goal on a 2-core laptop: < 30 s and
< 6 GB each for llama3-70b on 256 and 2048 virtual devices. Writes experiments/results/bench_comm.md
and bench_comm.png (the collectives of each run, bytes by kind and mesh axes), or into --out DIR.

--quick: the same path (child processes, table, figure) for llama-tiny on 16 devices (fsdp=2 x
tensor=8); --model and --devices given explicitly still win.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
QUICK = dict(model="llama-tiny", devices=[16])
sys.path.insert(0, str(ROOT))


def run_comm(model: str, devices: int, tmp: pathlib.Path) -> dict:
    """One `jaxpar comm --abstract` in a child process: seconds, peak RSS and its JSON report."""
    out = tmp / f"comm-{devices}.json"
    cmd = [sys.executable, "-m", "jaxpar.cli.main", "comm", "--model", model, "--mesh", f"fsdp={devices // 8},tensor=8",
           "--abstract", "--json", str(out)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log}")
    report = json.loads(out.read_text())
    report["name"] = f"{devices} devices"
    return {"devices": devices, "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "max_rss_gb": usage.ru_maxrss * 1024 / 1e9, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--devices", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--quick", action="store_true", help="smoke test: llama-tiny on 16 devices")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_comm.md and .png go")
    args = parser.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    bad = [n for n in args.devices if n < 8 or n % 8]
    if bad:
        parser.error(f"--devices must be multiples of 8 (the mesh is fsdp=N/8 x tensor=8), got {bad}")
    from tqdm import tqdm  # noqa: PLC0415  (no JAX in this process)

    from jaxpar.analysis.report import plot  # noqa: PLC0415
    from jaxpar.collectives import human_bytes  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bar = tqdm(args.devices, unit="run", disable=not sys.stdout.isatty(), dynamic_ncols=True)
        for n in bar:
            bar.set_description(f"{args.model} on {n} devices")
            r = run_comm(args.model, n, pathlib.Path(tmp))
            rep = r["report"]
            rows.append((n, r["seconds"], r["cpu_seconds"], r["max_rss_gb"], rep["compile_seconds"],
                         rep["totals"]["bytes"], rep["memory"]["peak"], r))
            bar.write(f"{args.model} fsdp={n // 8} x tensor=8 on {n} devices: {r['seconds']:.1f} s wall, "
                      f"{r['cpu_seconds']:.1f} s CPU (XLA compile {rep['compile_seconds']:.1f} s wall), "
                      f"peak RSS {r['max_rss_gb']:.2f} GB", file=sys.stdout)
    lines = [f"# `jaxpar comm --abstract`: {args.model}, fsdp x tensor=8", "",
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; goal < 30 s and < 6 GB "
             "per run. CPU seconds (user + system) are what a run costs on an idle machine.", "",
             "| devices | wall s | CPU s | peak RSS GB | XLA compile s | collective bytes / device / step "
             "| peak memory / device |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for n, secs, cpu, rss, comp, nbytes, peak, _ in rows:
        lines.append(f"| {n} | {secs:.1f} | {cpu:.1f} | {rss:.2f} | {comp:.1f} | {human_bytes(nbytes)} "
                     f"| {human_bytes(peak)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_comm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'bench_comm.md'}; no figure: matplotlib is not installed")
    else:
        plot([row[-1]["report"] for row in rows], str(args.out / "bench_comm.png"))
        print(f"\nwritten to {args.out / 'bench_comm.md'} and bench_comm.png")


if __name__ == "__main__":
    main()
