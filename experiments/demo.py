"""Train llama-tiny under several strategies on 8 simulated CPU devices and compare with 1 device.

    python experiments/demo.py                      # the `make demo` set
    python experiments/demo.py --meshes all         # every 8-device strategy in mesh_configs (bench)

Prints one table (strategy, final loss, |loss - 1-device loss|, step time, tokens/s) and writes it
to experiments/results/demo.md. Every strategy starts from the same parameters and sees the same
batches, so the loss column should agree to float32 rounding. The last row is a multi-process run:
`jaxpar launch` starts 2 processes of 4 devices each (gloo collectives between them) running fsdp8.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from jaxpar.data import Synthetic  # noqa: E402
from jaxpar.strategy import catalogue, parse_strategy  # noqa: E402
from jaxpar.train import TrainConfig, Trainer, gather, train  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402

DEMO = ["dp8", "zero1-dp8", "fsdp8", "tp8", "dp2-fsdp2-tp2", "tp4-sp"]


def run(model: str, mesh: str, devices: int, tc: TrainConfig, params) -> dict:
    trainer = Trainer(parse_model(model), parse_strategy(mesh), tc, devices=jax.devices()[:devices])
    rows: list[dict] = []
    state = train(trainer, Synthetic(trainer.model_cfg.vocab, tc.seed), state=trainer.state_from_params(params),
                  on_step=lambda s, m: rows.append(m))
    steady = rows[2:] or rows  # skip the compiling step(s)
    step_time = statistics.median(r["step_time_s"] for r in steady)
    return {"mesh": trainer.strategy.describe(), "loss": rows[-1]["loss"], "step_time_s": step_time,
            "tokens_per_s": tc.batch * tc.seq / step_time, "state": state}


def run_two_processes(model: str, mesh: str, tc: TrainConfig) -> dict:
    """The same run as 2 processes x 4 devices through `jaxpar launch` (parameters from the seed, which
    gives the 1-device initial parameters on any mesh)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = pathlib.Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--processes", "2", "--devices-per-process", "4", "--",
               "train", "--model", model, "--mesh", mesh, "--steps", str(tc.steps), "--batch", str(tc.batch),
               "--seq", str(tc.seq), "--lr", str(tc.lr), "--warmup", str(tc.warmup), "--seed", str(tc.seed),
               "--no-progress", "--metrics", str(metrics)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"jaxpar launch failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_time = statistics.median(r["step_time_s"] for r in rows[2:] or rows)
    return {"mesh": f"{mesh}, 2 processes x 4", "loss": rows[-1]["loss"], "step_time_s": step_time,
            "tokens_per_s": tc.batch * tc.seq / step_time}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--meshes", nargs="+", default=DEMO, help="strategy names, or 'all'")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-multiprocess", action="store_true", help="skip the 2-process jaxpar launch row")
    args = ap.parse_args()
    meshes = [s.name for s in catalogue() if s.num_devices == 8] if args.meshes == ["all"] else args.meshes
    tc = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, warmup=5)

    print(f"{args.model}: {args.steps} steps, batch {args.batch} x seq {args.seq}, on {jax.device_count()} "
          "simulated CPU devices")
    params = gather(Trainer(parse_model(args.model), parse_strategy("data=1"), tc,
                            devices=jax.devices()[:1]).init_state().params)
    ref = run(args.model, "data=1", 1, tc, params)
    results = [dict(ref, name="1 device")]
    for mesh in meshes:
        print(f"  training {mesh} ...", flush=True)
        results.append(dict(run(args.model, mesh, 8, tc, params), name=mesh))
    if not args.no_multiprocess:
        print("  training fsdp8 as 2 processes x 4 devices (jaxpar launch) ...", flush=True)
        results.append(dict(run_two_processes(args.model, "fsdp8", tc), name="jaxpar launch"))

    header = "| strategy | mesh | final loss | abs(loss - 1-device) | step time (ms) | tokens/s |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['mesh']} | {r['loss']:.5f} | {abs(r['loss'] - ref['loss']):.2e} | "
                     f"{r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} |")
    table = "\n".join(lines)
    print()
    print(table)
    out = pathlib.Path(__file__).resolve().parent / "results" / "demo.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(f"# {args.model}, {args.steps} steps, 8 simulated CPU devices\n\n{table}\n")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
