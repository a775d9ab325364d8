"""Train llama-tiny under several strategies on 8 simulated CPU devices and compare with 1 device.

    python experiments/demo.py                      # the `make demo` set
    python experiments/demo.py --meshes all         # every 8-device strategy in mesh_configs that fits
                                                    # the model (the others are listed as skipped)
    python experiments/demo.py --quick              # smoke test: a few seconds

Prints one table (strategy, final loss, |loss - 1-device loss|, step time, tokens/s) and writes it
to experiments/results/demo.md (or --out DIR), with the loss curves in demo.png. Every strategy
starts from the same parameters and sees the same batches, so the loss column should agree to
float32 rounding. The last row is a multi-process run: `jaxpar launch` starts 2 processes of 4
devices each (gloo collectives between them) running fsdp8.

--quick: the same path on 2 strategies (fsdp8, dp2-fsdp2-tp2), 3 steps of batch 8 x seq 16,
without the 2-process row (--no-multiprocess), and XLA's backend optimisations off (compiles ~3x
faster, steps run slower: quick timings mean nothing). Any option given explicitly still wins.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import jax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxpar.core import validate  # noqa: E402
from jaxpar.training.data import Synthetic  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import catalogue, parse_strategy  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer, gather, train  # noqa: E402

DEMO = ["dp8", "zero1-dp8", "fsdp8", "tp8", "dp2-fsdp2-tp2", "tp4-sp"]
QUICK = dict(meshes=["fsdp8", "dp2-fsdp2-tp2"], steps=3, batch=8, seq=16, no_multiprocess=True)
RESULTS = ROOT / "experiments" / "results"


def run(model: str, mesh: str, devices: int, tc: TrainConfig, params) -> dict:
    trainer = Trainer(parse_model(model), parse_strategy(mesh), tc, devices=jax.devices()[:devices])
    rows: list[dict] = []
    state = train(trainer, Synthetic(trainer.model_cfg.vocab, tc.seed), state=trainer.state_from_params(params),
                  on_step=lambda s, m: rows.append(m))
    steady = rows[2:] or rows  # skip the compiling step(s)
    step_time = statistics.median(r["step_time_s"] for r in steady)
    return {"mesh": trainer.strategy.describe(), "loss": rows[-1]["loss"], "losses": [r["loss"] for r in rows],
            "step_time_s": step_time, "tokens_per_s": tc.batch * tc.seq / step_time, "state": state}


def run_two_processes(model: str, mesh: str, tc: TrainConfig) -> dict:
    """The same run as 2 processes x 4 devices through `jaxpar launch` (parameters from the seed, which
    gives the 1-device initial parameters on any mesh)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = pathlib.Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2", "--devices-per-process", "4", "--",
               "train", "--model", model, "--mesh", mesh, "--steps", str(tc.steps), "--batch", str(tc.batch),
               "--seq", str(tc.seq), "--lr", str(tc.lr), "--warmup", str(tc.warmup), "--seed", str(tc.seed),
               "--no-progress", "--metrics", str(metrics)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise SystemExit(f"jaxpar launch failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_time = statistics.median(r["step_time_s"] for r in rows[2:] or rows)
    return {"mesh": f"{mesh}, 2 processes x 4", "loss": rows[-1]["loss"], "losses": [r["loss"] for r in rows],
            "step_time_s": step_time, "tokens_per_s": tc.batch * tc.seq / step_time}


def plot(results: list[dict], title: str, path: pathlib.Path) -> None:
    """PNG: loss against step for every row (the curves should lie on top of each other)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], "-", marker=".", label=r["name"], alpha=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # --quick is also read before JAX starts
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--meshes", nargs="+", default=DEMO, help="strategy names, or 'all'")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-multiprocess", action="store_true", help="skip the 2-process jaxpar launch row")
    ap.add_argument("--quick", action="store_true", help="smoke test: a few seconds (see above)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where demo.md and demo.png go")
    args = ap.parse_args()
    if args.quick:  # quick values become the defaults; options given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    tc = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, warmup=5)
    meshes, skipped = args.meshes, {}
    if args.meshes == ["all"]:  # every 8-device strategy that fits this model and batch
        meshes = []
        for s in catalogue():
            if s.num_devices != 8:
                continue
            try:
                validate.check(parse_model(args.model), parse_strategy(s.name).resolved(8), batch=tc.batch, seq=tc.seq)
                meshes.append(s.name)
            except ConfigError as e:
                skipped[s.name] = str(e)

    print(f"{args.model}: {args.steps} steps, batch {args.batch} x seq {args.seq}, on {jax.device_count()} "
          "simulated CPU devices", flush=True)
    params = gather(Trainer(parse_model(args.model), parse_strategy("data=1"), tc,
                            devices=jax.devices()[:1]).init_state().params)
    results = []
    tty = sys.stdout.isatty()
    bar = tqdm([("1 device", "data=1", 1), *((m, m, 8) for m in meshes)], unit="run", disable=not tty,
               dynamic_ncols=True)
    for name, mesh, devices in bar:
        bar.set_description(name)
        if not tty:
            print(f"  training {name} ...", flush=True)
        results.append(dict(run(args.model, mesh, devices, tc, params), name=name))
    ref = results[0]
    if not args.no_multiprocess:
        print("  training fsdp8 as 2 processes x 4 devices (jaxpar launch) ...", flush=True)
        results.append(dict(run_two_processes(args.model, "fsdp8", tc), name="jaxpar launch"))

    header = "| strategy | mesh | final loss | abs(loss - 1-device) | step time (ms) | tokens/s |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['mesh']} | {r['loss']:.5f} | {abs(r['loss'] - ref['loss']):.2e} | "
                     f"{r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} |")
    if skipped:
        lines += ["", *(f"- skipped {name}: {why}" for name, why in skipped.items())]
    table = "\n".join(lines)
    print()
    print(table)
    title = f"{args.model}, {args.steps} steps of batch {args.batch} x seq {args.seq}, 8 simulated CPU devices"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.md").write_text(f"# {title}\n\n{table}\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten to {args.out / 'demo.md'}; no figure: matplotlib is not installed")
    else:
        plot(results, title, args.out / "demo.png")
        print(f"\nwritten to {args.out / 'demo.md'} and demo.png")


if __name__ == "__main__":
    main()
