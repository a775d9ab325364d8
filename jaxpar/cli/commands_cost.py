"""The commands that ask the analytic cost model: `jaxpar estimate` (a training step, or a prefill or
decode step) and `jaxpar plan` (the search, --write, and --verify, which compiles). Nothing here loads
JAX but `plan --verify`, so that an estimate answers at once; jaxpar/cli/commands.py holds the commands
that compile or train.
"""
from __future__ import annotations

import dataclasses
import json

from jaxpar.cli.args import model_from, strategy_from_args
from jaxpar.core import validate
from jaxpar.core.inputs import MAX_GLOBAL_BATCH
from jaxpar.core.schedule import schedule_summary
from jaxpar.core.strategy import OPTION_FIELDS
from jaxpar.cost import SOFTWARE, estimate, format_estimate
from jaxpar.cost.defaults import accelerator_defaults, priced_zero
from jaxpar.cost.estimate import HBM_HEADROOM
from jaxpar.cost.hardware import load_hardware
from jaxpar.cost.inference import Request, format_inference, inference_estimate
from jaxpar.cost.software import check_platform, check_runs
from jaxpar.devices import MAX_DEVICES, simulate_cpu_devices
from jaxpar.errors import ConfigError
from jaxpar.planning import planner
from jaxpar.planning.inference import format_inference_plan, plan_inference as search
from jaxpar.planning.question import DEFAULT_SHAPE, Question, default_batch, default_seq, read_run


RUN_FLAGS = {"model": "--model", "hardware": "--hardware", "software": "--software", "devices": "--devices",
             "seq": "--seq", "global_batch": "--global-batch", "hbm_headroom": "--hbm-headroom"}


def global_batch_from(args, seq: int) -> int | None:
    """--global-batch, or --global-batch-tokens over --seq (which must divide it); None when neither is given."""
    tokens = getattr(args, "global_batch_tokens", None)
    if tokens is None:
        return args.global_batch
    if tokens % seq:
        below = f"{tokens // seq * seq:,} or " if tokens >= seq else ""
        raise ConfigError(f"--global-batch-tokens={tokens:,} is not divisible by --seq={seq:,}: a global batch is "
                          f"whole sequences (nearest: {below}{(tokens // seq + 1) * seq:,} tokens)")
    return check_global_batch(tokens // seq, f"--global-batch-tokens={tokens:,} / --seq={seq:,}")


def check_global_batch(batch: int, what: str) -> int:
    """A global batch within MAX_GLOBAL_BATCH sequences (the parser bounds --global-batch itself)."""
    if batch > MAX_GLOBAL_BATCH:
        raise ConfigError(f"{what} = {batch:,} sequences per step: at most {MAX_GLOBAL_BATCH:,} (no run takes more)")
    return batch


def question_from(args) -> tuple[Question, str]:
    """`estimate`'s question and mesh: --run FILE's, or the flags' (DEFAULT_SHAPE where --seq or
    --global-batch is not given). Beside --run, a flag that sets one of the run file's fields must agree
    with it (a run file is the whole question; edit it, or ask without it); the strategy flags apply over
    its mesh file as over --mesh."""
    if args.run is None:
        missing = [flag for flag, value in (("--model", args.model), ("--mesh", args.mesh),
                                            ("--hardware", args.hardware)) if value is None]
        if missing:
            raise ConfigError(f"estimate: the following arguments are required: {', '.join(missing)} (or --run FILE)")
        seq = args.seq or default_seq(model_from(args.model).max_seq)
        batch = global_batch_from(args, seq) or default_batch()
        headroom = HBM_HEADROOM if args.hbm_headroom is None else args.hbm_headroom
        return Question(args.model, args.hardware, args.software or "jaxpar", args.devices or 0, seq, batch,
                        headroom), args.mesh
    if args.mesh is not None:
        raise ConfigError(f"estimate: --run {args.run} names its mesh file; give --run or --mesh, not both")
    question, mesh = read_run(args.run)
    given = {field: getattr(args, field) for field in RUN_FLAGS} | {"global_batch": global_batch_from(args, question.seq)}
    for field, value in given.items():
        theirs = getattr(question, field)
        if value is not None and value != theirs:
            raise ConfigError(f"estimate --run {args.run}: {RUN_FLAGS[field]} {value} disagrees with the run file's "
                              f"{field} = {theirs!r}; drop the flag, or edit the file")
    check_global_batch(question.global_batch, f"run file {args.run}: global_batch")
    if question.software not in SOFTWARE:
        raise ConfigError(f"run file {args.run}: software = {question.software!r} is not one of {', '.join(sorted(SOFTWARE))}")
    return question, mesh


def shape_defaults(args) -> list[str]:
    """The line saying that the question's sequence and batch are the default question's, if they are."""
    batch = args.global_batch if args.global_batch is not None else getattr(args, "global_batch_tokens", None)
    unset = [flag for flag, value in (("--seq", args.seq), ("--global-batch", batch)) if value is None]
    return [f"{' and '.join(unset)} not given: the default question, {DEFAULT_SHAPE}"] if unset and not args.run else []


def cmd_estimate(args) -> int:
    question, mesh = question_from(args)
    model, software = model_from(question.model), SOFTWARE[question.software]
    check_platform(software, load_hardware(question.hardware))   # first: no other refusal of a stack that is not there
    strategy = strategy_from_args(args, mesh)
    if strategy.num_devices < 1:
        if not question.devices:
            raise ConfigError(f"mesh {strategy.name} has a -1 axis: give --devices N to resolve it")
        strategy = strategy.resolved(question.devices)
    elif args.run and strategy.num_devices != question.devices:
        raise ConfigError(f"run file {args.run}: devices = {question.devices} but mesh {mesh} has {strategy.num_devices}")
    elif question.devices and strategy.num_devices != question.devices:
        raise ConfigError(f"--devices {question.devices} contradicts mesh {strategy.describe()}, which has "
                          f"{strategy.num_devices} devices; drop --devices, or give the mesh a -1 axis to fill them")
    if not args.run and global_batch_from(args, question.seq) is None:  # the default, a multiple the layout splits
        question = dataclasses.replace(question, global_batch=default_batch(validate.sequences_per_step(strategy)))
    given = {f.name for f in OPTION_FIELDS if getattr(args, f.name, None) is not None}
    strategy, defaults = accelerator_defaults(strategy, question.global_batch, given, software, args.phase)
    if args.phase != "train":
        return estimate_inference(args, question, model, strategy, defaults)
    validate.check(model, strategy, batch=question.global_batch, seq=question.seq, padded_zero=True,
                   program=software.jaxpar_program)
    check_runs(strategy, software)
    est = estimate(model, strategy, question.hardware, question.global_batch, question.seq, software,
                   headroom=question.hbm_headroom)
    if args.run:
        print(f"run file {args.run}: the question of plan mesh file {mesh}")
    zero, zero_line = priced_zero(strategy, software)
    print(f"software {question.software}; options {strategy.describe_options(zero)}")
    for line in shape_defaults(args) + defaults + zero_line:
        print(f"  default: {line}")
    if strategy.size("pipeline") > 1:
        print(schedule_summary(strategy, model.run_units))
    print(format_estimate(est, planner.remat_label(strategy, est)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=1)
    return 0


def estimate_inference(args, question: Question, model, strategy, defaults) -> int:
    """`estimate --phase prefill|decode`: jaxpar/cost/inference.py for --global-batch sequences of a
    --seq-token prompt and --gen-len new tokens."""
    validate.check_phases(strategy)
    strategy = strategy.phase(args.phase)  # a mesh file's [prefill] / [decode] layout, if it gives one
    batch, seq, software = question.global_batch, question.seq, SOFTWARE[question.software]
    validate.check_generation(model, strategy, batch, seq, args.gen_len, args.phase)
    est = inference_estimate(model, strategy, question.hardware, Request(args.phase, batch, seq, args.gen_len), software)
    print(f"software {question.software}; options {strategy.describe_options()}")
    for line in shape_defaults(args) + defaults:
        print(f"  default: {line}")
    print(format_inference(est))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=1)
    return 0


def cmd_plan(args) -> int:
    if args.target != "cpu" and not args.verify:
        raise ConfigError(f"plan --target {args.target} is the compiler of --verify: add --verify")
    model = model_from(args.model)
    args.seq = args.seq or default_seq(model.max_seq)
    args.global_batch = global_batch_from(args, args.seq)
    if getattr(args, "phase", "train") != "train":
        return plan_inference(args)
    question = Question(args.model, args.hardware, args.software, args.devices, args.seq, args.global_batch,
                        args.hbm_headroom)
    check_platform(SOFTWARE[args.software], load_hardware(args.hardware))
    print(question.header(model, load_hardware(args.hardware)))
    misses = planner.Misses()
    results, considered, valid = planner.plan(model, args.hardware, args.devices, args.seq, args.global_batch,
                                              args.top, SOFTWARE[args.software], args.objective, args.hbm_headroom,
                                              getattr(args, "dtype", "bfloat16"), getattr(args, "grad_dtype", "float32"),
                                              misses)
    if not results:
        raise ConfigError(planner.nothing_fits(misses, considered, valid))
    print(planner.format_plan(results, considered, valid, args.software, args.objective))
    if note := planner.scores_note(model, results, SOFTWARE[args.software], args.global_batch, args.seq):
        print(note)
    failed = verify_plans(args, model, results) if args.verify else 0
    if args.write:
        paths = planner.write_plans(results, args.write, question)
        print(f"wrote {len(paths)} plans to {args.write}: each a mesh file (jaxpar train/comm/estimate --mesh PATH) "
              "and beside it NAME.run.toml, its question (jaxpar estimate --run PATH)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(planner.to_json(results, considered, valid, args.objective), f, indent=1)
    return 1 if failed else 0


def verify_plans(args, model, results) -> int:
    """`plan --verify`: compile each listed plan on simulated devices, or with `--target tpu-...` for a TPU
    topology of --devices chips (jaxpar/planning/verify.py, jaxpar/analysis/target.py); the figures over the
    tolerance that no named gap accounts for (`plan` exits 1 when there are any)."""
    from jaxpar.analysis import target  # deferred: JAX, only for --verify
    from jaxpar.planning.verify import TOLERANCE, format_checks, verify_plan  # deferred: JAX, only for --verify

    simulate_cpu_devices(min(args.devices, MAX_DEVICES))
    devices = None if target.parse_target(args.target) is None else target.devices(args.target, args.devices)
    compiler = "XLA:CPU" if devices is None else f"XLA:TPU for {args.target.removeprefix(target.PREFIX)}"
    print(f"\nverify: each plan's step compiled for jaxpar on {compiler}, predicted vs compiled (flag over {TOLERANCE:.0%})")
    flagged = 0
    for i, (est, st) in enumerate(results, 1):
        checks, report = verify_plan(model, st, args.global_batch, args.seq, devices)
        flagged += sum(c.flagged for c in checks)
        print(format_checks(i, planner.describe(st, est), checks, report))
    print(f"verify: FAILED: {flagged} figure(s) over {TOLERANCE:.0%} that no named gap accounts for" if flagged else
          f"verify: every figure within {TOLERANCE:.0%}, after the named gaps")
    return flagged


def plan_inference(args) -> int:
    """`plan --phase prefill|decode`: jaxpar/planning/inference.py's search, printed as a table."""
    for flag in ("verify", "write"):
        if getattr(args, flag):
            raise ConfigError(f"plan --{flag} is for training layouts; not with --phase {args.phase}")
    request = Request(args.phase, args.global_batch, args.seq, args.gen_len)
    results, considered, valid = search(model_from(args.model), args.hardware, args.devices, request, args.top,
                                        SOFTWARE[args.software])
    print(format_inference_plan(results, considered, valid, args.phase, args.software))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"considered": considered, "valid": valid,
                       "plans": [est.to_json() | {"mesh": dict(st.mesh), "attention": st.options.attention}
                                 for est, st in results]}, f, indent=1)
    return 0
