"""Where a small training run's wall time goes: imports, compilation, initialisation, steps.

    python experiments/bench_startup.py [--steps 20] [--tries 3] [--against DIR] [--out DIR]
    python experiments/bench_startup.py --quick      # smoke test: 5 steps, one try

Runs `jaxpar train --model llama-tiny --mesh dp8 --devices 8 --steps 20` as a whole process (best of
--tries by wall time) and reads its closing line's split (jaxpar/cli/train_log.py, `Phases`): the
imports, the step's compile, the state's initialisation (one compiled function:
`xla_workarounds.compile_initializer`), the steps, the rest. Goal: imports + initialisation at most the
compile. With --against DIR (another checkout, e.g. `git worktree add /tmp/base fc9ea6e` with
`ln -s ../models /tmp/base/jaxpar/models` and the same for mesh_configs) the same run of that tree beside it; a tree whose closing line has no split gives its compile, initialisation and wall,
its imports timed as `import jaxpar.cli.commands` alone. Also `jaxpar --help`'s wall (goal: < 0.5 s).
Writes experiments/results/bench_startup.md (or --out DIR).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
RUN = ["train", "--model", "llama-tiny", "--mesh", "dp8", "--devices", "8", "--no-progress"]
PHASES = ("imports", "compile", "initialisation", "steps", "the rest")
QUICK = {"steps": 5, "tries": 1}


def environment(tree: pathlib.Path) -> dict[str, str]:
    """A process that imports `tree`'s jaxpar (its jaxpar/models and jaxpar/mesh_configs must resolve there:
    an installed checkout, or links to ../models and ../mesh_configs), with the run's own XLA flags."""
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # not a test harness's
    return env


def jaxpar(tree: pathlib.Path, argv: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of one `jaxpar` process run from `tree`'s sources."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *argv], cwd=tree, env=environment(tree),
                         check=True, capture_output=True, text=True)
    return time.perf_counter() - t0, out.stdout


def import_seconds(tree: pathlib.Path) -> float:
    """The wall of a process that only imports what `train` imports, less an empty interpreter's."""
    env, walls = environment(tree), []
    for code in ("import jaxpar.cli.commands", "pass"):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)
        walls.append(time.perf_counter() - t0)
    return walls[0] - walls[1]


def split(tree: pathlib.Path, steps: int, tries: int) -> dict[str, float]:
    """The phases of the fastest of `tries` runs, with the process's wall measured outside it."""
    best = None
    for _ in range(tries):
        wall, out = jaxpar(tree, [*RUN, "--steps", str(steps)])
        if best is None or wall < best[0]:
            best = (wall, out.strip().splitlines()[-1])
    wall, line = best
    got = {name: float(t) for name, t in re.findall(r"(imports|compile|initialisation|steps|the rest) ([\d.]+) s",
                                                    line)}
    if "imports" not in got:  # an older closing line: compile and initialisation only
        got["imports"] = import_seconds(tree)
        median = float(re.search(r"median step ([\d.]+) ms", line).group(1)) / 1e3
        got["steps"] = median * steps
        got["the rest"] = max(0.0, wall - sum(got.values()))
    return {"process wall": wall, "printed wall": float(re.search(r"wall ([\d.]+) s", line).group(1)), **got}


def revision(tree: pathlib.Path) -> str:
    """`tree`'s commit, short, or '?' outside git."""
    got = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return got.stdout.strip() or "?"


def help_seconds(tries: int) -> float:
    return min(jaxpar(ROOT, ["--help"])[0] for _ in range(max(tries, 3)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps of the timed run")
    ap.add_argument("--tries", type=int, default=3, help="runs per tree; the fastest is reported")
    ap.add_argument("--against", type=pathlib.Path, help="another checkout to time beside this one")
    ap.add_argument("--quick", action="store_true", help="smoke test: 5 steps, one try")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where bench_startup.md goes")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    trees = {"this tree": ROOT} | ({f"{args.against} ({revision(args.against)})": args.against} if args.against else {})
    runs = {name: split(tree, args.steps, args.tries) for name, tree in trees.items()}
    columns = ("process wall", "printed wall", *PHASES)
    rows = [f"`jaxpar {' '.join(RUN)} --steps {args.steps}`, best of {args.tries} by wall (seconds):", "",
            "| tree | " + " | ".join(columns) + " | imports + initialisation / compile |",
            "|---|" + "---:|" * (len(columns) + 1)]
    for name, r in runs.items():
        ratio = (r["imports"] + r.get("initialisation", 0.0)) / r["compile"]
        rows.append(f"| {name} | " + " | ".join(f"{r.get(c, 0.0):.2f}" for c in columns) + f" | {ratio:.2f} |")
        print(f"{name}: " + ", ".join(f"{c} {r.get(c, 0.0):.2f} s" for c in columns))
    helps = help_seconds(args.tries)
    print(f"jaxpar --help: {helps:.2f} s wall (best of {max(args.tries, 3)})")
    rows += ["", "| process (best of %d) | wall s |" % max(args.tries, 3), "|---|---:|", f"| jaxpar --help | {helps:.2f} |"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_startup.md").write_text("# bench_startup\n\n" + "\n".join(rows) + "\n")
    print(f"written to {args.out / 'bench_startup.md'}")


if __name__ == "__main__":
    main()
