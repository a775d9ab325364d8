"""The commands that ask the analytic cost model: `jaxpar estimate` (a training step, or a prefill or
decode step) and `jaxpar plan` (the search, --write, and --verify, which compiles). Nothing here loads
JAX but `plan --verify`, so that an estimate answers at once; jaxpar/cli/commands.py holds the commands
that compile or train.
"""
from __future__ import annotations

import json

from jaxpar.cli.args import model_from, strategy_from_args
from jaxpar.core import validate
from jaxpar.core.schedule import schedule_summary
from jaxpar.core.strategy import OPTION_FIELDS
from jaxpar.cost import SOFTWARE, estimate, format_estimate
from jaxpar.cost.defaults import accelerator_defaults
from jaxpar.cost.inference import format_inference, inference_estimate
from jaxpar.devices import MAX_DEVICES, simulate_cpu_devices
from jaxpar.errors import ConfigError
from jaxpar.planning import planner
from jaxpar.planning.inference import format_inference_plan, plan_inference as search


def cmd_estimate(args) -> int:
    model = model_from(args.model)
    strategy = strategy_from_args(args)
    if strategy.num_devices < 1:
        if not args.devices:
            raise ConfigError(f"mesh {strategy.name} has a -1 axis: give --devices N to resolve it")
        strategy = strategy.resolved(args.devices)
    given = {f.name for f in OPTION_FIELDS if getattr(args, f.name, None) is not None}
    strategy, defaults = accelerator_defaults(strategy, args.global_batch, given)
    if args.phase != "train":
        return estimate_inference(args, model, strategy, defaults)
    validate.check(model, strategy, batch=args.global_batch, seq=args.seq, padded_zero=True)
    est = estimate(model, strategy, args.hardware, args.global_batch, args.seq, SOFTWARE[args.software])
    print(f"software {args.software}; options {strategy.describe_options()}")
    for line in defaults:
        print(f"  default: {line}")
    if strategy.size("pipeline") > 1:
        print(schedule_summary(strategy, model.units))
    print(format_estimate(est))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=1)
    return 0


def estimate_inference(args, model, strategy, defaults) -> int:
    """`estimate --phase prefill|decode`: jaxpar/cost/inference.py for --global-batch sequences of a
    --seq-token prompt and --gen-len new tokens."""
    validate.check_phases(strategy)
    strategy = strategy.phase(args.phase)  # a mesh file's [prefill] / [decode] layout, if it gives one
    validate.check_generation(model, strategy, args.global_batch, args.seq, args.gen_len, args.phase)
    est = inference_estimate(model, strategy, args.hardware, args.global_batch, args.seq, args.gen_len, args.phase,
                             SOFTWARE[args.software])
    print(f"software {args.software}; options {strategy.describe_options()}")
    for line in defaults:
        print(f"  default: {line}")
    print(format_inference(est))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=1)
    return 0


def cmd_plan(args) -> int:
    if getattr(args, "phase", "train") != "train":
        return plan_inference(args)
    results, considered, valid = planner.plan(model_from(args.model), args.hardware, args.devices,
                                              args.seq, args.global_batch, args.top, SOFTWARE[args.software],
                                              args.objective)
    print(planner.format_plan(results, considered, valid, args.software, args.objective))
    if note := planner.scores_note(model_from(args.model), results, SOFTWARE[args.software], args.global_batch,
                                   args.seq):
        print(note)
    if args.verify:
        verify_plans(args, model_from(args.model), results)
    if args.write:
        paths = planner.write_plans(results, args.write)
        print(f"wrote {len(paths)} mesh files to {args.write} (jaxpar estimate/train/comm --mesh PATH)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(planner.to_json(results, considered, valid), f, indent=1)
    return 0


def verify_plans(args, model, results) -> None:
    """`plan --verify`: compile each listed plan on simulated devices (jaxpar/planning/verify.py)."""
    from jaxpar.planning.verify import TOLERANCE, format_checks, verify_plan  # deferred: JAX, only for --verify

    simulate_cpu_devices(min(args.devices, MAX_DEVICES))
    print(f"\nverify: each plan's step compiled for jaxpar on XLA:CPU, predicted vs compiled (flag over {TOLERANCE:.0%})")
    flagged = 0
    for i, (_, st) in enumerate(results, 1):
        checks, report = verify_plan(model, st, args.global_batch, args.seq)
        flagged += sum(c.flagged for c in checks)
        print(format_checks(i, planner.describe(st), checks, report))
    print(f"verify: {flagged} figure(s) over {TOLERANCE:.0%}" if flagged else
          f"verify: every figure within {TOLERANCE:.0%}")


def plan_inference(args) -> int:
    """`plan --phase prefill|decode`: jaxpar/planning/inference.py's search, printed as a table."""
    for flag in ("verify", "write"):
        if getattr(args, flag):
            raise ConfigError(f"plan --{flag} is for training layouts; not with --phase {args.phase}")
    results, considered, valid = search(model_from(args.model), args.hardware, args.devices, args.phase,
                                        args.global_batch, args.seq, args.gen_len, args.top, SOFTWARE[args.software])
    print(format_inference_plan(results, considered, valid, args.phase, args.software))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"considered": considered, "valid": valid,
                       "plans": [est.to_json() | {"mesh": dict(st.mesh), "attention": st.options.attention}
                                 for est, st in results]}, f, indent=1)
    return 0
