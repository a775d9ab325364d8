"""The `jaxpar` command line. Heavy imports wait until after `--devices` is applied, because the
simulated-device flag must be set before JAX starts its backend."""
from __future__ import annotations

import argparse
import json
import sys

from jaxpar.errors import ConfigError


def add_model_mesh(p: argparse.ArgumentParser, meshes: bool = False) -> None:
    p.add_argument("--model", required=True, help="preset (llama-tiny, llama3-8b, ...), preset:key=value,... or a TOML path")
    if meshes:
        p.add_argument("--meshes", nargs="+", required=True, metavar="MESH", help="strategies to compare")
    else:
        p.add_argument("--mesh", required=True, help="mesh_configs name or TOML path, or inline data=2,tensor=4")
    p.add_argument("--devices", type=int, help="simulate N CPU devices (default: all devices JAX sees)")


def add_strategy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("strategy flags (override the mesh file's [options])")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (master weights stay float32)")
    g.add_argument("--remat", help="none | full | dots | dots_no_batch")
    g.add_argument("--zero", type=int, choices=[0, 1, 3], help="0 replicated DP, 1 sharded optimizer state, 3 FSDP")
    g.add_argument("--sequence-parallel", action="store_true", default=None, help="shard norms/residuals' sequence over tensor")
    g.add_argument("--attention", choices=["dense", "ring", "allgather"])
    g.add_argument("--cp-layout", choices=["contiguous", "zigzag"])
    g.add_argument("--microbatches", type=int, help="pipeline micro-batches")
    g.add_argument("--pp-schedule", choices=["gpipe", "circular"])
    g.add_argument("--grad-accum", type=int, help="gradient-accumulation steps per optimizer step")


STRATEGY_FLAGS = ("dtype", "remat", "zero", "sequence_parallel", "attention", "cp_layout", "microbatches",
                  "pp_schedule", "grad_accum")


def strategy_from_args(args, spec: str | None = None):
    from jaxpar.strategy import parse_strategy  # noqa: PLC0415
    strategy = parse_strategy(spec or args.mesh)
    return strategy.with_options(**{k: getattr(args, k, None) for k in STRATEGY_FLAGS})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description="Hybrid parallelism for LLMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model under a strategy")
    add_model_mesh(t)
    t.add_argument("--steps", type=int, default=50)
    t.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    t.add_argument("--seq", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--data", default="synthetic", help="'synthetic' or a .bin file of uint16/uint32 token ids")
    t.add_argument("--metrics", help="write one JSON object per step to this .jsonl file")
    t.add_argument("--profile", help="write a jax.profiler trace of steps 2-4 to this directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_strategy_flags(t)
    return parser


def cmd_train(args) -> int:
    from jaxpar.data import make_source  # noqa: PLC0415
    from jaxpar.train import TrainConfig, Trainer, train  # noqa: PLC0415
    from models.config import parse_model  # noqa: PLC0415
    import jax  # noqa: PLC0415

    model = parse_model(args.model)
    strategy = strategy_from_args(args)
    tc = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, seed=args.seed, lr=args.lr)
    trainer = Trainer(model, strategy, tc)
    source = make_source(args.data, model.vocab, args.seed)
    main = jax.process_index() == 0
    if main:
        print(f"model {model.name}: {model.layers} layers, d_model={model.d_model}, pattern={model.pattern}")
        print(f"strategy {trainer.strategy.describe()} zero={trainer.strategy.zero} "
              f"options={trainer.strategy.options}")
    metrics_file = open(args.metrics, "w") if args.metrics and main else None
    bar = None
    if main and not args.no_progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    last: dict = {}

    def on_step(step: int, m: dict) -> None:
        last.update(m)
        if args.profile and step == 1:
            jax.profiler.start_trace(args.profile)
        if args.profile and step == 4:
            jax.profiler.stop_trace()
        if metrics_file:
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")

    try:
        train(trainer, source, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
    if main and last:
        print(f"final loss {last['loss']:.4f}  step {last['step_time_s'] * 1e3:.1f} ms  "
              f"{last['tokens_per_s']:.0f} tokens/s")
    return 0


COMMANDS = {"train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "devices", None):
            from jaxpar.devices import simulate_cpu_devices  # noqa: PLC0415
            simulate_cpu_devices(args.devices)
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
