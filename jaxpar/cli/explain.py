"""`jaxpar explain PARAM --model M --mesh S`: the parser of the command and the command, which prints one
parameter's path from its declaration to its PartitionSpec and its collectives (jaxpar/planning/explain.py).

The parser imports nothing heavy, as the rest of jaxpar/cli/main.py's: the command loads JAX and the
model only when it runs. Nothing is compiled and no device is used: the mesh is abstract."""
from __future__ import annotations

import argparse
import json

from jaxpar.cli.args import model_from, strategy_from_args
from jaxpar.core import validate
from jaxpar.core.inputs import POSITIVE, nonempty
from jaxpar.errors import ConfigError
from jaxpar.planning.question import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ, default_batch, default_seq


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `explain` on the subparsers `sub`; returns its parser (for the strategy flags)."""
    p = sub.add_parser("explain", help="follow one parameter from its declaration to its PartitionSpec "
                                       "and the collectives a training step issues for it",
                       description="Print a parameter's logical names, the rule each name meets "
                                   "(jaxpar/core/rules.py), its PartitionSpec on the mesh, the bytes each "
                                   "device holds, and the collectives a training step issues for it, forward, "
                                   "backward and in the optimizer, with the file:line of each step.")
    p.add_argument("param", help="a parameter path, or its tail: attn.wq, mlp.w_up, embedding, "
                                 "runs.0.blocks.0.attn.wq")
    p.add_argument("--model", required=True, help="preset (llama-tiny, llama3-8b, ...), preset:key=value,..., "
                   "a TOML path, or hf:DIR")
    p.add_argument("--mesh", required=True, help="mesh_configs name or TOML path, or inline data=2,tensor=4")
    p.add_argument("--devices", type=POSITIVE, metavar="N", help="fills a -1 mesh axis (nothing is simulated)")
    p.add_argument("--batch", type=POSITIVE, help=f"global batch in sequences (default {DEFAULT_GLOBAL_BATCH}, as "
                   "estimate's, rounded up to a multiple of the sequences one step needs)")
    p.add_argument("--seq", type=POSITIVE, help=f"sequence length (default {DEFAULT_SEQ}, at most the model's max_seq)")
    p.add_argument("--json", type=nonempty, help="also write the explanation as one JSON object to this file")
    return p


def cmd_explain(args) -> int:
    from jaxpar.planning import explain  # deferred: JAX and the model load only when explain runs, not with the parser

    model = model_from(args.model)
    strategy = strategy_from_args(args)
    if any(n == -1 for _, n in strategy.mesh):
        if not args.devices:
            raise ConfigError(f"mesh {strategy.name} has a -1 axis; give --devices N to fill it")
        strategy = strategy.resolved(args.devices)
    batch = args.batch or default_batch(validate.sequences_per_step(strategy))
    seq = args.seq or default_seq(model.max_seq)
    validate.check(model, strategy, batch=batch, seq=seq)
    e = explain.explain(model, args.model, strategy, args.param, batch=batch, seq=seq)
    print(explain.render(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(explain.as_json(e), f, indent=1)
    return 0
