"""The `jaxpar` command line. Heavy imports wait until after `--devices` is applied, because the
simulated-device flag must be set before JAX starts its backend."""
from __future__ import annotations

import argparse
import json
import os
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
    """One flag per field of jaxpar.strategy.Options (the one options schema), with its help and choices."""
    from jaxpar.strategy import OPTION_FIELDS  # noqa: PLC0415 (no JAX import)
    g = p.add_argument_group("strategy flags (override the mesh file's [options])")
    for f in OPTION_FIELDS:
        flag, choices, help_ = "--" + f.name.replace("_", "-"), f.metadata["choices"], f.metadata["help"]
        if isinstance(f.default, bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name == "zero" or isinstance(f.default, int):
            g.add_argument(flag, type=int, choices=choices, metavar=None if choices else "N", help=help_)
        else:
            g.add_argument(flag, choices=choices, help=help_)


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process runs (see jaxpar/distributed.py; SLURM, Open MPI and TPU pods "
                             "are detected without flags, `jaxpar launch` sets them for local runs)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 <= I < N")
    g.add_argument("--init-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for the coordinator and the other processes (default 300, as JAX; "
                        "large jobs start their processes over minutes)")
    g.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                   help="a process silent this long is declared dead and the others stop (default 30)")


def strategy_from_args(args, spec: str | None = None):
    from jaxpar.strategy import OPTION_FIELDS, parse_strategy  # noqa: PLC0415
    strategy = parse_strategy(spec or args.mesh)
    return strategy.with_options(**{f.name: getattr(args, f.name, None) for f in OPTION_FIELDS})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description="Hybrid parallelism for LLMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model under a strategy")
    add_model_mesh(t)
    t.add_argument("--steps", type=int, default=50)
    t.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    t.add_argument("--seq", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine decay)")
    t.add_argument("--warmup", type=int, default=10, help="learning-rate warmup steps")
    t.add_argument("--data", default="synthetic", help="'synthetic' or a .bin file of uint16/uint32 token ids")
    t.add_argument("--metrics", help="write one JSON object per step to this .jsonl file")
    t.add_argument("--tensorboard", metavar="DIR", help="write the per-step scalars (loss, grad norm, step time, "
                   "tokens/s, model FLOP/s, MFU) as TensorBoard event files to DIR")
    t.add_argument("--hardware", help="device profile (h100-sxm, ...) whose peak FLOP/s gives the MFU metric")
    t.add_argument("--profile", help="write a jax.profiler trace of steps 2-4 to this directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--ckpt-dir", help="checkpoint directory (orbax; asynchronous saves)")
    t.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (0: only at the end)")
    t.add_argument("--ckpt-keep", type=int, default=3, help="keep the newest N checkpoints")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir, "
                   "on this run's mesh and strategy (resharding as needed)")
    t.add_argument("--stop-after", type=int, help="stop after this many steps (as if preempted); the "
                   "learning-rate schedule still spans --steps")
    add_strategy_flags(t)
    add_distributed_flags(t)

    e = sub.add_parser("estimate", help="analytic FLOPs / memory / communication / time of one step")
    add_model_mesh(e)
    e.add_argument("--hardware", required=True, help="profile name (h100-sxm, a100-80gb, tpu-v5p, ...) or TOML path")
    e.add_argument("--seq", type=int, default=4096)
    e.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    e.add_argument("--json", help="write the estimate as one JSON object to this file")
    add_strategy_flags(e)

    pl = sub.add_parser("plan", help="rank strategies for a model on N devices of a hardware type")
    pl.add_argument("--model", required=True)
    pl.add_argument("--hardware", required=True)
    pl.add_argument("--devices", type=int, required=True, help="devices in the cluster (nothing is simulated)")
    pl.add_argument("--seq", type=int, default=4096)
    pl.add_argument("--global-batch", type=int, default=256)
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--json")

    analysis_note = ("--devices defaults to the mesh's device count, capped at 2048 (the most XLA:CPU compiles); "
                     "bigger meshes are compiled at reduced data parallelism and rescaled (see jaxpar/analysis/comm.py)")
    c = sub.add_parser("comm", help="compile one training step and tally its collectives, FLOPs and memory",
                       description=analysis_note)
    add_model_mesh(c)
    add_analysis_flags(c)
    c.add_argument("--abstract", action="store_true", help="compile from shapes only, no arrays allocated (analysis always does; kept for scripts)")
    c.add_argument("--json", help="write the report as one JSON object to this file")
    add_strategy_flags(c)
    add_distributed_flags(c)

    cp = sub.add_parser("compare", help="the communication of several strategies side by side",
                        description=analysis_note)
    add_model_mesh(cp, meshes=True)
    add_analysis_flags(cp)
    cp.add_argument("--run-steps", type=int, default=0, metavar="K",
                    help="also train K steps per strategy from the same initial parameters and report "
                         "|loss - 1-device loss| and the step time")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--lr", type=float, default=3e-3)
    cp.add_argument("--json", help="write {model, reports: [...]} as one JSON object to this file")
    cp.add_argument("--plot", help="write a PNG of bytes per device per step by kind and mesh axes")
    add_strategy_flags(cp)

    la = sub.add_parser("launch", help="run a command as N local processes on CPU (multi-process development)",
                        description="Start N processes of `jaxpar COMMAND ...`, each with D simulated CPU "
                                    "devices, joined by jax.distributed (gloo collectives). Signals are "
                                    "forwarded; if one process fails the others are stopped.",
                        usage="jaxpar launch --processes N [--devices-per-process D] -- COMMAND [ARGS ...]")
    la.add_argument("--processes", type=int, required=True, metavar="N", help="processes to start")
    la.add_argument("--devices-per-process", type=int, default=1, metavar="D",
                    help="simulated CPU devices in each process (default 1)")
    la.add_argument("--grace", type=float, default=2.0, metavar="S",
                    help="seconds a process gets to stop (after a forwarded signal, or when another "
                         "process failed) before it is killed")
    la.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                    help="a jaxpar command and its flags (train, comm)")
    return parser


def add_analysis_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, help="global batch in sequences (default: the smallest valid one, "
                   "one sequence per data-parallel rank and micro-batch)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's max_seq, at most 2048)")


def cmd_train(args) -> int:
    from jaxpar import distributed  # noqa: PLC0415
    from jaxpar.data import make_source  # noqa: PLC0415
    from jaxpar.metrics import Sinks  # noqa: PLC0415
    from jaxpar.train import Preempted, TrainConfig, Trainer, train  # noqa: PLC0415
    from jaxpar.models.config import parse_model  # noqa: PLC0415
    import jax  # noqa: PLC0415

    model = parse_model(args.model)
    strategy = strategy_from_args(args)
    tc = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, seed=args.seed, lr=args.lr,
                     warmup=args.warmup)
    trainer = Trainer(model, strategy, tc)
    source = make_source(args.data, model.vocab, args.seed)
    main = distributed.is_main()
    sinks = Sinks(args.metrics, args.tensorboard) if main else Sinks()  # paths checked before any compile
    peak_flops = None
    if args.hardware:
        from jaxpar.cost.hardware import load_hardware  # noqa: PLC0415
        peak_flops = load_hardware(args.hardware).peak_flops * trainer.mesh.size
    ckpt = state = None
    start = 0
    if args.resume and not args.ckpt_dir:
        raise ConfigError("--resume needs --ckpt-dir")
    if args.ckpt_dir:
        from jaxpar.checkpoint import Checkpointer  # noqa: PLC0415
        ckpt = Checkpointer(args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep)
        if args.resume:
            state, start, message = ckpt.restore(trainer)
            if main:
                print(message)
    if main:
        print(f"model {model.name}: {model.layers} layers, d_model={model.d_model}, pattern={model.pattern}")
        print(f"strategy {trainer.strategy.describe()}; options: {trainer.strategy.describe_options()}")
        if trainer.strategy.size("pipeline") > 1:
            from jaxpar.schedule import schedule_summary  # noqa: PLC0415
            print(schedule_summary(trainer.strategy, model.units))
    bar = None
    if main and not args.no_progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    last: dict = {}

    def on_step(step: int, m: dict) -> None:
        last.update(m)
        if args.profile and step == 1:
            jax.profiler.start_trace(args.profile)
        if args.profile and step == 4:
            jax.profiler.stop_trace()
        if peak_flops:
            m["mfu"] = m["model_flops_per_s"] / peak_flops
        sinks.write(m)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")

    try:
        state = train(trainer, source, on_step=on_step, state=state, start=start, stop=args.stop_after,
                      checkpointer=ckpt)
        if ckpt is not None:
            done = min(args.stop_after or args.steps, args.steps)
            if done > start and (args.ckpt_every <= 0 or done % args.ckpt_every):
                ckpt.maybe_save(done, state, trainer, force=True)
            ckpt.close()
    except Preempted as stopped:
        ckpt.close()
        if main:
            print(f"\n{stopped}")
        return 128 + 15  # as if terminated by SIGTERM: the scheduler sees an unfinished run
    finally:
        if bar is not None:
            bar.close()
        sinks.close()
    if main and last:
        print(f"final loss {last['loss']:.4f}  step {last['step_time_s'] * 1e3:.1f} ms  "
              f"{last['tokens_per_s']:.0f} tokens/s")
    return 0


def cmd_estimate(args) -> int:
    from jaxpar import validate  # noqa: PLC0415
    from jaxpar.cost import estimate, format_estimate  # noqa: PLC0415
    from jaxpar.models.config import parse_model  # noqa: PLC0415

    model = parse_model(args.model)
    strategy = strategy_from_args(args)
    if strategy.num_devices < 1:
        if not args.devices:
            raise ConfigError(f"mesh {strategy.name} has a -1 axis: give --devices N to resolve it")
        strategy = strategy.resolved(args.devices)
    validate.check(model, strategy, batch=args.global_batch, seq=args.seq)
    est = estimate(model, strategy, args.hardware, args.global_batch, args.seq)
    print(format_estimate(est))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=1)
    return 0


def cmd_plan(args) -> int:
    from jaxpar import planner  # noqa: PLC0415
    from jaxpar.models.config import parse_model  # noqa: PLC0415

    results, considered, valid = planner.plan(parse_model(args.model), args.hardware, args.devices,
                                              args.seq, args.global_batch, args.top)
    print(planner.format_plan(results, considered, valid))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(planner.to_json(results, considered, valid), f, indent=1)
    return 0


def analysis_devices(args, strategies) -> int:
    """Devices to simulate for compile-only analysis: --devices, or the biggest mesh's device count
    capped at what XLA:CPU compiles (bigger meshes are analysed at reduced data parallelism). In a
    process whose JAX backend already started (a notebook, the tests) its devices are used."""
    from jaxpar.analysis.comm import DEVICE_LIMIT  # noqa: PLC0415
    from jaxpar.devices import backend_started, simulate_cpu_devices  # noqa: PLC0415

    if getattr(args, "multi_process", False):  # every process's devices, compiled in each process
        import jax  # noqa: PLC0415
        return jax.device_count()
    if args.devices:
        if args.devices > DEVICE_LIMIT:
            raise ConfigError(f"--devices {args.devices}: XLA:CPU compiles for at most {DEVICE_LIMIT} devices; "
                              "give the full mesh sizes instead and it is analysed at reduced data parallelism")
        return args.devices
    for s in strategies:
        if s.num_devices < 1:
            raise ConfigError(f"mesh {s.name} has a -1 axis: give --devices N to resolve it")
    n = min(max(s.num_devices for s in strategies), DEVICE_LIMIT)
    if backend_started():
        import jax  # noqa: PLC0415
        return min(n, jax.device_count())
    simulate_cpu_devices(n)
    return n


def analysis_config(args, model, strategies, **extra):
    """TrainConfig for analysis: --batch/--seq, or defaults valid for every strategy."""
    import math  # noqa: PLC0415

    from jaxpar.train import TrainConfig  # noqa: PLC0415
    from jaxpar.validate import data_parallel_size  # noqa: PLC0415

    def per_step(s) -> int:
        o = s.options
        return data_parallel_size(s.resolved(args.devices) if s.num_devices < 1 else s) * o.grad_accum * (
            o.microbatches if s.size("pipeline") > 1 else 1)

    batch = args.batch or math.lcm(*(per_step(s) for s in strategies))
    return TrainConfig(batch=batch, seq=args.seq or min(model.max_seq, 2048), **extra)


def cmd_comm(args) -> int:
    from jaxpar.models.config import parse_model  # noqa: PLC0415

    model = parse_model(args.model)
    strategy = strategy_from_args(args)
    n = analysis_devices(args, [strategy])
    tc = analysis_config(args, model, [strategy])
    import jax  # noqa: PLC0415

    from jaxpar.analysis import comm  # noqa: PLC0415
    from jaxpar.analysis.report import format_table  # noqa: PLC0415
    report = comm.analyze_strategy(model, strategy, tc, jax.devices()[:n])
    if jax.process_index():
        return 0
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def cmd_compare(args) -> int:
    from jaxpar.models.config import parse_model  # noqa: PLC0415

    if args.run_steps < 0:
        raise ConfigError(f"--run-steps must be >= 0, got {args.run_steps}")
    model = parse_model(args.model)
    strategies = [strategy_from_args(args, spec) for spec in args.meshes]
    n = analysis_devices(args, strategies)
    tc = analysis_config(args, model, strategies, steps=max(args.run_steps, 1), seed=args.seed, lr=args.lr)
    import jax  # noqa: PLC0415

    from jaxpar.analysis import comm  # noqa: PLC0415
    from jaxpar.analysis.report import compare, plot  # noqa: PLC0415
    reports = comm.compare_strategies(model, strategies, tc, jax.devices()[:n], run_steps=args.run_steps)
    print(compare(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "reports": reports}, f, indent=1)
    if args.plot:
        plot(reports, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def cmd_launch(args) -> int:
    from jaxpar.launch import launch  # noqa: PLC0415
    return launch(args.processes, args.devices_per_process, args.rest, grace_s=args.grace)


COMMANDS = {"train": cmd_train, "estimate": cmd_estimate, "plan": cmd_plan, "comm": cmd_comm,
            "compare": cmd_compare, "launch": cmd_launch}


def join_cluster(args) -> bool:
    """Join a multi-process run if the flags or the environment describe one (jaxpar/distributed.py)."""
    from jaxpar import distributed  # noqa: PLC0415

    cluster = distributed.cluster_from(args.coordinator, args.num_processes, args.process_id)
    if cluster is None:
        return False
    if args.devices:
        raise ConfigError("--devices simulates devices in one process; in a multi-process run each process "
                          "brings its own devices (jaxpar launch --devices-per-process D)")
    distributed.initialize(cluster, timeout_s=args.init_timeout, heartbeat_s=args.heartbeat_timeout)
    return True


def main(argv: list[str] | None = None) -> int:
    from jaxpar import distributed  # noqa: PLC0415

    args = build_parser().parse_args(argv)
    args.multi_process = False
    try:
        if hasattr(args, "coordinator"):
            args.multi_process = join_cluster(args)
        if getattr(args, "devices", None) and args.command not in ("plan", "estimate"):
            from jaxpar.devices import simulate_cpu_devices  # noqa: PLC0415
            simulate_cpu_devices(args.devices)
        return COMMANDS[args.command](args)
    except ConfigError as e:
        return fail(f"jaxpar: error: {e}", 2, distributed.joining())
    except Exception as e:
        if distributed.joining() and (message := distributed.peer_failure(e)) is not None:
            return fail(f"jaxpar: error: {message}", 3, True)
        raise


def fail(message: str, code: int, multi_process: bool) -> int:
    """Print `message`; in a multi-process run leave at once: a normal interpreter exit would wait
    in jax.distributed's shutdown barrier for processes that will never reach it."""
    print(message, file=sys.stderr, flush=True)
    if multi_process:
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
