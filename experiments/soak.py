"""A soak of preemptions: a long run killed (SIGKILL) many times at random moments and resumed each time
must end bitwise where an uninterrupted run ends, with nothing lost on the way.

    python experiments/soak.py [--steps 1000] [--kills 25] [--every 10] [--seed 0] [--out DIR]
    python experiments/soak.py --quick        # 60 steps, 3 kills: the test suite's version

Trains llama-tiny on 8 simulated CPU devices (fsdp8) through `jaxpar train` in fresh processes, a
checkpoint every --every steps. First an uninterrupted run (the reference), then the soak: the same run
SIGKILLed --kills times, each kill followed by `--resume` on the same --ckpt-dir and --metrics file. A
kill's moment is one of three kinds (as many of each as the count allows, in random order): during the steps (0 to 30 ms after a random step
completed, so in the next step or in a save: faults.KILL_AFTER_STEP), during a save (right after the
save of a random checkpoint step has started: faults.KILL_DURING_SAVE), or before the first step
(during start-up, restore and compilation: at a random fraction of the uninterrupted run's time to its
first step; if a step was logged before the kill landed, it is counted as a kill during the steps).
The process kills itself where a hook says, so no kill misses its moment on a fast or a loaded machine.

Checks, each reported (the script exits 1 if one fails):
  * every resume restored (no kill left the directory unrestorable), and each complete checkpoint
    left at the end restores with its CRC-32s verified;
  * the final parameters and optimizer state (the last checkpoints' arrays) bitwise equal to the
    reference's;
  * the metrics JSONL holds every step exactly once.
Prints and writes to experiments/results/soak.md (or --out DIR): kills by kind, resumes, steps lost
per kill (the steps logged before the kill minus the step resumed from), wall time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.training import faults  # noqa: E402
from jaxpar.training.checkpoint import Checkpointer  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer, gather  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
MODEL, MESH, BATCH, SEQ = "llama-tiny", "fsdp8", 8, 32
QUICK_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
KINDS = ("step", "save", "compile")


def train_cmd(args, ckpt: pathlib.Path, metrics: pathlib.Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli.main", "train", "--model", MODEL, "--mesh", MESH, "--devices", "8",
            "--steps", str(args.steps), "--batch", str(BATCH), "--seq", str(SEQ), "--ckpt-dir", str(ckpt),
            "--ckpt-every", str(args.every), "--metrics", str(metrics), "--no-progress", *(["--resume"] if resume else [])]


def child_env(args, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    if args.quick:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + QUICK_XLA).strip()
    return env | extra


def logged_steps(metrics: pathlib.Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


class Run:
    """One `jaxpar train` process, its output in files (no pipe to fill)."""

    def __init__(self, args, work: pathlib.Path, n: int, resume: bool, **env):
        self.log = work / f"run{n}.out"
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(train_cmd(args, work / "ck", work / "m.jsonl", resume), cwd=ROOT,
                                         env=child_env(args, **env), stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def restored(self) -> int:
        m = re.search(r"restored step (\d+)", self.text())
        return int(m.group(1)) if m else 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def wait_for(run: Run, done, what: str, timeout_s: float = 900) -> bool:
    """Poll until done() or the process ends; False if it ended first (the metrics may be written at the end)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if run.proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            run.kill()
            raise SystemExit(f"soak: no {what} in {timeout_s} s:\n{run.text()[-3000:]}")
        time.sleep(0.005)
    return True


def plan(args, rng: random.Random) -> list[tuple[str, int]]:
    """The kills: (kind, step) in run order; `step` is where a step or save kill lands. The kinds as even
    as the count allows (3 kills: one of each), in random order."""
    targets = sorted(rng.sample(range(2, args.steps - 2), args.kills))
    kinds = [KINDS[i % len(KINDS)] for i in range(args.kills)]
    rng.shuffle(kinds)
    return list(zip(kinds, targets))


def one_kill(args, work: pathlib.Path, n: int, kind: str, target: int, startup_s: float, rng) -> dict:
    """Start run n (a resume unless n == 0) and kill it as `kind` says. Returns the kind that happened,
    the step the run resumed from (None if killed before it said) and the newest step it logged."""
    metrics = work / "m.jsonl"
    newest = max((int(d.name) for d in (work / "ck").glob("*") if d.name.isdigit()), default=0)
    target = max(target, newest + 1)  # this run resumes from `newest`: its first step is newest + 1
    if kind == "compile":
        run = Run(args, work, n, n > 0)
        time.sleep(rng.uniform(0.1, 0.6) * startup_s)  # resumes start sooner (no initialisation)
        if run.proc.poll() is not None:
            raise SystemExit(f"soak: run {n} ended before its kill (exit {run.proc.returncode}):\n{run.text()[-3000:]}")
        run.kill()
    else:
        save_at = min(args.every * -(-target // args.every), args.steps)  # the first save at or after it
        hook = ({faults.KILL_DURING_SAVE: str(save_at)} if kind == "save" else
                {faults.KILL_AFTER_STEP: f"{target}:{rng.randint(0, 30)}"})  # in the next step, or a save
        run = Run(args, work, n, n > 0, **hook)
        if run.proc.wait() != -signal.SIGKILL:
            raise SystemExit(f"soak: run {n} was not killed ({hook}; exit {run.proc.returncode}):\n{run.text()[-3000:]}")
    text = run.text()
    start = int(m.group(1)) if (m := re.search(r"restored step (\d+)", text)) else (0 if n == 0 or "no checkpoint in" in text else None)
    steps = logged_steps(metrics)
    ran = steps[-1] if steps and start is not None and steps[-1] > start else start
    actual = "step" if kind == "compile" and ran is not None and start is not None and ran > start else kind
    return {"kind": actual, "start": start, "reached": ran}


def soak(args, work: pathlib.Path, rng: random.Random, startup_s: float) -> dict:
    """The killed-and-resumed run (`startup_s`: the reference run's time to its first step); its figures."""
    t0 = time.monotonic()
    kills = []
    for n, (kind, target) in enumerate(plan(args, rng)):
        kills.append(one_kill(args, work, n, kind, target, startup_s, rng))
        print(f"  kill {n + 1}/{args.kills}: {kills[-1]['kind']:<7} resumed from {kills[-1]['start']}, "
              f"reached step {kills[-1]['reached']}", flush=True)
    last = Run(args, work, len(kills), True)
    last.proc.wait()
    if last.proc.returncode != 0:
        raise SystemExit(f"soak: the final run failed (exit {last.proc.returncode}):\n{last.text()[-3000:]}")
    # the step each kill's work resumed from: the next run that got as far as restoring
    starts = [k["start"] for k in kills[1:]] + [int(re.search(r"restored step (\d+)", last.text()).group(1))]
    for i in reversed(range(len(starts) - 1)):
        starts[i] = starts[i + 1] if starts[i] is None else starts[i]
    lost = [k["reached"] - s for k, s in zip(kills, starts) if k["reached"] is not None]
    # a resume that cannot restore stops with an error (a killed run prints none); the run after a kill
    # before the first checkpoint starts afresh ("no checkpoint in ...")
    unrestored = [n for n in range(1, len(kills) + 1) if "jaxpar: error" in (work / f"run{n}.out").read_text()]
    return {"kills": kills, "lost": lost, "resumes": len(kills), "wall_s": time.monotonic() - t0,
            "unrestored": unrestored}


def final_state(ckpt: pathlib.Path, steps: int) -> tuple[dict, list[int]]:
    """The arrays of the checkpoint of step `steps` in `ckpt` (restored with their CRC-32s checked), and
    the steps of the checkpoints there, each of which restores."""
    trainer = Trainer(parse_model(MODEL), parse_strategy(MESH), TrainConfig(batch=BATCH, seq=SEQ, steps=steps))
    c = Checkpointer(str(ckpt), every=0)
    try:
        found = c.steps()
        for step in found[:-1]:
            c.restore(trainer, step)
        state, step, _ = c.restore(trainer, steps)
    finally:
        c.close()
    return gather(state), found


def compare(ref: dict, got: dict) -> list[str]:
    """The arrays whose bits differ (none if equal)."""
    a, b = jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves_with_path(got)
    assert [p for p, _ in a] == [p for p, _ in b]
    return [jax.tree_util.keystr(p) for (p, x), (_, y) in zip(a, b)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes()]


def report(args, figures: dict, ref_s: float, differ: list[str], found: list[int], once: bool) -> str:
    kinds = collections.Counter(k["kind"] for k in figures["kills"])
    lost = figures["lost"]
    rows = [("steps", f"{args.steps}"), ("checkpoint every", f"{args.every}"),
            ("kills", f"{len(figures['kills'])}"), *((f"kills during {k}", f"{kinds.get(k, 0)}") for k in KINDS),
            ("resumes", f"{figures['resumes']}"),
            ("steps lost per kill (mean)", f"{np.mean(lost):.1f}" if lost else "0"),
            ("steps lost per kill (max)", f"{max(lost) if lost else 0}"),
            ("bound on steps lost per kill", f"{args.every + 1}"),
            ("resumes that failed to restore", f"{len(figures['unrestored'])}"),
            ("checkpoints left, each restored", f"{len(found)}"),
            ("arrays differing from the uninterrupted run", f"{len(differ)}"),
            ("metrics JSONL holds every step once", "yes" if once else "no"),
            ("soak wall s", f"{figures['wall_s']:.0f}"), ("uninterrupted run wall s", f"{ref_s:.0f}")]
    width = max(len(r[0]) for r in rows)
    table = ["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    return (f"# Soak: {MODEL} on {MESH} (8 simulated CPU devices), {args.steps} steps, {args.kills} SIGKILLs\n\n"
            f"seed {args.seed}; steps lost per kill: {lost}\n\n" + "\n".join(table) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=25)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    ap.add_argument("--seed", type=int, default=0, help="of the kills' kinds and moments")
    ap.add_argument("--quick", action="store_true", help="60 steps, 3 kills, fast compilation")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where soak.md goes")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.kills = 60, 3
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="jaxpar-soak-") as tmp:
        ref, work = pathlib.Path(tmp) / "ref", pathlib.Path(tmp) / "soak"
        ref.mkdir()
        work.mkdir()
        print(f"uninterrupted run of {args.steps} steps ...", flush=True)
        t0 = time.monotonic()
        run = Run(args, ref, 0, False)
        wait_for(run, lambda: logged_steps(ref / "m.jsonl"), "first step")
        startup_s = time.monotonic() - t0
        if run.proc.wait() != 0:
            raise SystemExit(f"soak: the uninterrupted run failed:\n{run.text()[-3000:]}")
        ref_s = time.monotonic() - t0
        print(f"soak: {args.kills} kills ...", flush=True)
        figures = soak(args, work, rng, startup_s)
        want, _ = final_state(ref / "ck", args.steps)
        got, found = final_state(work / "ck", args.steps)
        differ = compare(want, got)
        steps = logged_steps(work / "m.jsonl")
        once = steps == list(range(1, args.steps + 1))
        text = report(args, figures, ref_s, differ, found, once)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.md").write_text(text)
    print(f"\nwritten to {args.out / 'soak.md'}")
    failed = [what for what, bad in (("final state differs", differ), ("a resume did not restore", figures["unrestored"]),
                                     ("metrics JSONL not every step once", not once)) if bad]
    if failed:
        print(f"soak: FAILED: {'; '.join(failed)}" + (f" (steps logged: {len(steps)}, distinct {len(set(steps))})"
                                                      if not once else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
