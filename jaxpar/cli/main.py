"""The `jaxpar` command line: the parser (flags, their types and help) and `main`, which dispatches.

`estimate` and `plan` ask the analytic cost model (jaxpar/cli/commands_cost.py) and never load JAX, so
they answer at once. The commands that compile or train (jaxpar/cli/commands.py) import JAX, Flax and the
trainer, a few seconds that `main` spends only when one of them runs; that module then joins a
multi-process run and simulates `--devices` before JAX's backend starts (importing JAX does not start it).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import sys
import time

import jaxpar
from jaxpar.cli import explain, schedule
from jaxpar.cli.streams import separate_streams
from jaxpar.cli.commands_cost import cmd_estimate, cmd_plan
from jaxpar.core.inputs import (MAX_CLUSTER_DEVICES, MAX_GLOBAL_BATCH, MAX_SEED, NON_NEGATIVE, POSITIVE, SEED,
                                check_outputs, did_you_mean, integer, nonempty, png_path, real, step_range, token_ids)
from jaxpar.core.strategy import CHOICES, GROUPS, OPTION_FIELDS, options_of, takes
from jaxpar.cost.estimate import HBM_HEADROOM
from jaxpar.cost.software import SOFTWARE, STACKS
from jaxpar.errors import ConfigError
from jaxpar.planning.question import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ
from jaxpar.training.config import SCHEDULES, OptimizerConfig, TrainConfig

ANALYTIC = {"estimate": cmd_estimate, "plan": cmd_plan}  # the cost model alone: JAX is never loaded
OPTIONS = {f.name for f in OPTION_FIELDS}


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, `(default: 50)`, unless it has none (None, or off for a
    switch) or its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if any(action.default is none for none in (None, False, argparse.SUPPRESS)) or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`jaxpar train: error: argument --steps: must be >= 1, got -5`)
    raised as ConfigError, so `main` reports them as it reports every other bad input; an unknown flag,
    command or choice is answered with its near matches (`did_you_mean`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # the subcommands' parsers (build_parser)

    def error(self, message: str):
        command = self.prog.removeprefix("jaxpar").strip()
        raise ConfigError(f"{command}: {message}" if command else message)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand's parser, which knows its flags
            parser = self.commands.get(getattr(parsed, "command", None), self)
            command = getattr(parsed, "command", "")
            for x in extras:   # a strategy flag of other commands: say which take it
                option = x.partition("=")[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
                if x.startswith("--") and option in OPTIONS and (others := takes(command, option)):
                    parser.error(f"{x.partition('=')[0]} is not an option of {command}: it shapes what "
                                 f"{', '.join(others)} run{'s' if len(others) == 1 else ''}")
            flags = [s for a in parser._actions for s in a.option_strings]
            words = [x + did_you_mean(x.partition("=")[0], flags, "-") if x.startswith("--") else x for x in extras]
            parser.error(f"unrecognized arguments: {' '.join(words)}")
        return parsed

    def _check_value(self, action, value):
        if value in getattr(action, "estimate_only", ()):
            command = self.prog.removeprefix("jaxpar").strip()
            raise argparse.ArgumentError(action, f"{value} is for `jaxpar estimate` of another stack; {command} takes "
                                                 f"{', '.join(map(str, action.choices))}")
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            raise argparse.ArgumentError(action, e.message + did_you_mean(str(value), action.choices)) from None


def add_model_mesh(p: argparse.ArgumentParser, meshes: bool = False, required: bool = True,
                   model_default: str | None = None) -> None:
    """--model and --mesh (or --meshes) and --devices; `model_default`: what stands for an omitted --model."""
    p.add_argument("--model", required=required and model_default is None, help="preset (llama-tiny, llama3-8b, "
                   "...), preset:key=value,..., a TOML path, or hf:DIR (a Hugging Face LLaMA, Mistral, Mixtral, "
                   "Qwen3-MoE, DeepSeek-V3 or Mamba-2 checkpoint's config.json)" + (f" (default: {model_default})" if model_default else ""))
    if meshes:
        p.add_argument("--meshes", nargs="+", required=True, metavar="MESH", help="strategies to compare")
    else:
        p.add_argument("--mesh", required=required, help="mesh_configs name or TOML path, or inline data=2,tensor=4")
    add_devices(p)


def add_devices(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=POSITIVE, metavar="N", help="simulate N CPU devices (default: all devices JAX sees)")


def add_strategy_flags(p: argparse.ArgumentParser, command: str) -> None:
    """One flag per field of jaxpar.core.strategy.Options that `command` reads (the one options schema), with its
    help and choices (less the values only `estimate` takes, elsewhere), grouped by concern."""
    groups = {name: p.add_argument_group(f"strategy flags: {name} ({what}; over the mesh file's [options])")
              for name, what in GROUPS.items()}
    for f in options_of(command):
        flag, choices, help_ = "--" + f.name.replace("_", "-"), f.metadata["choices"], f.metadata["help"]
        g = groups[f.metadata["group"]]
        if choices and command != "estimate":
            choices = tuple(c for c in choices if c not in f.metadata["estimate_only"])
        if "default" not in help_:  # the flag's own default is None: the mesh file's value stands
            shown = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default or "none"
            help_ += f" (default: the mesh file's, else {shown})"
        if isinstance(f.default, bool):
            action = g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name == "zero" or isinstance(f.default, int):
            action = g.add_argument(flag, type=integer() if choices else POSITIVE, choices=choices,
                                    metavar=None if choices else "N", help=help_)
        else:
            action = g.add_argument(flag, choices=choices, help=help_)
        action.estimate_only = () if command == "estimate" else f.metadata["estimate_only"]


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process runs (see jaxpar/distributed.py; SLURM, Open MPI and TPU pods "
                             "are detected without flags, `jaxpar launch` sets them for local runs)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    g.add_argument("--num-processes", type=POSITIVE, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=NON_NEGATIVE, metavar="I", help="this process's id, 0 <= I < N")
    g.add_argument("--init-timeout", type=POSITIVE, default=300, metavar="S",
                   help="seconds to wait for the coordinator and the other processes (default 300, as JAX; "
                        "large jobs start their processes over minutes)")
    g.add_argument("--heartbeat-timeout", type=POSITIVE, default=30, metavar="S",
                   help="a process silent this long is declared dead and the others stop (default 30)")


def add_software_flag(p) -> None:
    p.add_argument("--software", choices=sorted(SOFTWARE), default="jaxpar", metavar="STACK",
                   help="whose implementation to cost (jaxpar/cost/software.py): "
                        + "; ".join(f"{name}: {what}" for name, what in STACKS.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxpar", description="Hybrid parallelism for LLMs in JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_train, add_eval, add_export, add_estimate, add_plan, add_comm, add_compare, add_generate,
                add_launch, add_data):
        add(sub)
    add_strategy_flags(explain.add_parser(sub), "explain")
    schedule.add_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


def package_version() -> str:
    """The installed distribution's version (a source tree run without installing: the package's own)."""
    try:
        return importlib.metadata.version("jaxpar")
    except importlib.metadata.PackageNotFoundError:
        return jaxpar.__version__


def add_train(sub) -> None:
    t = sub.add_parser("train", help="train a model under a strategy",
                       description="Train, printing what the run is (model, strategy, batch, precision, optimizer, "
                                   "data), the compile time, then a progress bar (or, with --no-progress, a log line "
                                   "every --log-every steps) and a summary; steps count from 1 everywhere. The "
                                   "output and the --metrics fields: docs/running.md.")
    add_model_mesh(t)
    tc = TrainConfig()
    t.add_argument("--steps", type=POSITIVE, default=50, help="optimizer steps; the learning-rate schedule spans them")
    add_batch_seq(t)
    t.add_argument("--seed", type=SEED, default=tc.seed, help=f"seed of the parameters and the synthetic data, "
                   f"0 <= seed <= {MAX_SEED}")
    t.add_argument("--data", type=nonempty, default="synthetic", help="'synthetic' (a bigram rule with 10%% noise: "
                   "no text), a `jaxpar data` directory (its train split, shuffled by --seed), or a raw token file "
                   "named for its width: FILE.u16.bin / FILE.u32.bin")
    add_eval_flags(t)
    add_optimizer_flags(t, tc)
    t.add_argument("--metrics", type=nonempty, help="write one JSON object per step to this .jsonl file (with "
                   "--resume: cut back to the restored step, then appended to)")
    t.add_argument("--tensorboard", type=nonempty, metavar="DIR", help="write the per-step scalars (loss, grad norm, "
                   "lr, tokens, step time, tokens/s, model FLOP/s, MFU) as TensorBoard event files to DIR")
    t.add_argument("--hardware", help="device profile (h100-sxm, ...) whose peak FLOP/s gives the MFU; on CPU "
                   "devices the MFU is nominal: recorded with mfu_nominal=true, not shown")
    t.add_argument("--profile", type=nonempty, metavar="DIR", help="write a jax.profiler trace of --profile-steps "
                   "to DIR")
    t.add_argument("--profile-steps", type=step_range, default="2-4", metavar="A-B", help="the steps --profile "
                   "traces, counted from 1 as the bar counts; they must lie within the run")
    t.add_argument("--no-progress", action="store_true", help="no progress bar: a log line every --log-every "
                   "steps instead (batch jobs, SLURM logs: the default when standard error is not a terminal)")
    t.add_argument("--log-every", type=POSITIVE, default=10, metavar="N", help="with --no-progress (or off a "
                   "terminal): a log line every N steps, and at the last")
    add_checkpoint_flags(t)
    t.add_argument("--overwrite-metrics", action="store_true", help="a fresh run (no --resume) replaces an existing "
                   "--metrics file and --tensorboard event files (without it, it refuses to start)")
    t.add_argument("--hf-checkpoint", type=nonempty, metavar="DIR",
                   help="start from a Hugging Face LLaMA-layout (or Mixtral, Qwen3-MoE, DeepSeek-V3, Mamba-2) "
                        "checkpoint's weights (config.json + *.safetensors; fresh optimizer state); --model hf:DIR "
                        "takes the model from its config.json")
    t.add_argument("--stop-after", type=POSITIVE, help="stop after this many steps (as if preempted); the "
                   "learning-rate schedule still spans --steps")
    add_strategy_flags(t, "train")
    add_distributed_flags(t)


def add_batch_seq(p: argparse.ArgumentParser) -> None:
    """The step's shape as `train` takes it (defaults: TrainConfig's), for train and eval."""
    p.add_argument("--batch", type=POSITIVE, default=TrainConfig.batch, help="global batch, in sequences (all devices)")
    p.add_argument("--seq", type=POSITIVE, default=TrainConfig.seq, help="tokens per sequence")


def add_eval(sub) -> None:
    e = sub.add_parser("eval", help="the held-out loss of a training checkpoint, on any mesh",
                       description="Restore a `train --ckpt-dir` checkpoint's parameters (its model read from it; "
                                   "read-only, so a run may still be writing the directory) onto --mesh and print "
                                   "the mean loss of --eval-batches batches of the validation split of --data, as "
                                   "`train --eval-every` computes it.")
    e.add_argument("--ckpt-dir", required=True, type=nonempty, metavar="DIR", help="a `train --ckpt-dir` directory")
    e.add_argument("--ckpt-step", type=NON_NEGATIVE, metavar="N", help="evaluate step N (default: the newest)")
    e.add_argument("--data", type=nonempty, metavar="DIR", help="a `jaxpar data` directory whose validation split "
                   "to evaluate on (default: the one the checkpoint's run trained on)")
    e.add_argument("--mesh", default="data=-1", help="mesh_configs name or TOML path, or inline data=2,tensor=4 "
                   "(default data=-1: data parallelism over every device)")
    add_devices(e)
    add_batch_seq(e)
    e.add_argument("--eval-batches", type=POSITIVE, default=4, metavar="K", help="batches to average (the first K "
                   "of the validation split, in its own order)")
    e.add_argument("--json", type=nonempty, help="write the step, loss and perplexity as one JSON object to this file")
    add_strategy_flags(e, "eval")
    add_distributed_flags(e)


def add_export(sub) -> None:
    x = sub.add_parser("export", help="a training checkpoint as a Hugging Face checkpoint transformers loads",
                       description="Restore a `train --ckpt-dir` checkpoint's parameters (its model read from it; "
                                   "read-only) and write them as config.json and *.safetensors with their index in "
                                   "the layout transformers reads (Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 or Mamba-2), "
                                   "one tensor at a time (jaxpar/serving/hf_export.py).")
    x.add_argument("ckpt_dir", type=nonempty, metavar="CHECKPOINT_DIR", help="a `train --ckpt-dir` directory")
    x.add_argument("--to", required=True, choices=("hf",), help="the format: hf (Hugging Face transformers)")
    x.add_argument("out_dir", type=nonempty, metavar="OUT_DIR", help="a new (or empty) directory to write")
    x.add_argument("--ckpt-step", type=NON_NEGATIVE, metavar="N", help="export step N (default: the newest)")
    x.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the tensors' dtype")
    x.add_argument("--mesh", default="fsdp=-1", help="where the parameters are restored before they are gathered "
                   "tensor by tensor (default fsdp=-1: sharded over every device)")
    add_devices(x)


def add_eval_flags(t) -> None:
    """Held-out evaluation and document masking, for prepared data (`jaxpar data`)."""
    t.add_argument("--eval-data", type=nonempty, metavar="DIR", help="a `jaxpar data` directory whose validation "
                   "split to evaluate on (default: --data's own, when --data is one)")
    t.add_argument("--eval-every", type=NON_NEGATIVE, default=0, metavar="N", help="evaluate every N steps and at "
                   "the last (0: never); eval_loss and eval_ppl go to the log, --metrics and --tensorboard")
    t.add_argument("--eval-batches", type=POSITIVE, default=4, metavar="K", help="batches of --batch sequences "
                   "per evaluation (the same held-out batches every time)")
    t.add_argument("--document-mask", action="store_true", help="with prepared data: attention stays within each "
                   "document (segment ids from the end-of-text separators; positions restart per document)")


def add_data(sub) -> None:
    d = sub.add_parser("data", help="tokenize and pack text for training (a manifest, shards, the tokenizer)",
                       description="Read text (plain text files, one document each; JSON lines with a text field; "
                                   "Parquet with a text column; files or folders), tokenize it, split it into train "
                                   "and validation by document, and write packed token shards with an end-of-text "
                                   "id after every document, the tokenizer and a manifest (vocabulary, token width, "
                                   "counts, each shard's sha256) to DIR, atomically. `train --data DIR` reads it.")
    d.add_argument("--input", type=nonempty, nargs="+", required=True, metavar="PATH", help="text files or folders")
    d.add_argument("--output", type=nonempty, required=True, metavar="DIR", help="a new directory to write")
    tok = d.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", type=nonempty, metavar="FILE_OR_HF_DIR",
                     help="a Hugging Face tokenizer.json, or a checkpoint directory holding one")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the input (--vocab)")
    d.add_argument("--vocab", type=integer(257, 1 << 24), metavar="N", help="with --train-tokenizer: its vocabulary "
                   "size, the end-of-text token included")
    d.add_argument("--val-fraction", type=real(0.0, 0.5), default=0.05, metavar="F",
                   help="the fraction of documents held out for validation")
    d.add_argument("--text-field", type=nonempty, default="text", help="the JSON lines' and Parquet's text field")
    d.add_argument("--seed", type=SEED, default=0, help="seed of the validation documents' choice")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_optimizer_flags(p: argparse.ArgumentParser, tc: TrainConfig) -> None:
    """The learning rate and the optimizer's settings (jaxpar/training/config.py), their defaults the
    configs' own."""
    o = OptimizerConfig()
    g = p.add_argument_group("optimizer (AdamW after global-norm clipping) and learning-rate schedule")
    g.add_argument("--lr", type=real(0.0, open_lo=True), default=tc.lr, help="peak learning rate")
    g.add_argument("--warmup", type=NON_NEGATIVE, help=f"steps of linear warmup from 0 to --lr (0: none; at most "
                   f"--steps; default {tc.warmup}, the header says when that is longer than the run)")
    g.add_argument("--schedule", choices=SCHEDULES, default=o.schedule, help="after warmup: cosine or linear "
                   "decay to --min-lr-ratio x --lr over the run, or constant at --lr")
    g.add_argument("--min-lr-ratio", type=real(0.0, 1.0), default=o.min_lr_ratio, metavar="R",
                   help="the floor of cosine and linear decay, as a fraction of --lr")
    g.add_argument("--weight-decay", type=real(0.0), default=o.weight_decay, help="AdamW's decoupled weight decay")
    g.add_argument("--b1", type=real(0.0, 1.0), default=o.b1, help="Adam's first-moment decay, in [0, 1)")
    g.add_argument("--b2", type=real(0.0, 1.0), default=o.b2, help="Adam's second-moment decay, in [0, 1)")
    g.add_argument("--clip", type=real(0.0), default=o.clip, help="clip the gradients' global norm to this "
                   "(0: no clipping)")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt-dir", type=nonempty, help="checkpoint directory (orbax; asynchronous saves)")
    p.add_argument("--ckpt-every", type=NON_NEGATIVE, default=0, help="save every K steps (0: only at the end)")
    p.add_argument("--ckpt-keep", type=POSITIVE, default=3, help="keep the newest N checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir, "
                   "on this run's mesh and strategy (resharding as needed)")
    p.add_argument("--resume-step", type=NON_NEGATIVE, metavar="N", help="with --resume: restore step N, not the "
                   "newest (e.g. when the newest is damaged); newer checkpoints are moved to CKPT_DIR/set-aside/")
    p.add_argument("--overwrite-ckpt", action="store_true", help="a fresh run (no --resume) deletes the "
                   "checkpoints already in --ckpt-dir (without it, it refuses to start)")


def add_phase_flags(p, phase_help: str) -> None:
    """--phase (a training step, or generation's prefill or decode) and --gen-len, for the cost commands."""
    p.add_argument("--phase", choices=("train", "prefill", "decode"), default="train", help=phase_help)
    p.add_argument("--gen-len", type=POSITIVE, default=256, help="new tokens per sequence (prefill/decode phases)")


def add_global_batch(p, default: int | None) -> None:
    """--global-batch (sequences) or --global-batch-tokens (a multiple of --seq), not both."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--global-batch", type=integer(1, MAX_GLOBAL_BATCH), default=default, metavar="N",
                   help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    g.add_argument("--global-batch-tokens", type=POSITIVE, metavar="T",
                   help="the global batch in tokens (4194304 for a 4M-token batch); must be a multiple of --seq")


def add_hbm_headroom(p) -> None:
    p.add_argument("--hbm-headroom", type=real(0.0, 0.9), metavar="F",
                   help=f"share of HBM kept free for the runtime's own buffers (XLA scratch, NCCL, allocator); a "
                        f"layout fits within (1 - F) x HBM (default {HBM_HEADROOM:g})")


def add_estimate(sub) -> None:
    e = sub.add_parser("estimate", help="analytic FLOPs / memory / communication / time of one step",
                       description="--run FILE (a `plan --write` run file) asks its question of its mesh file with "
                                   "no other flag; a flag beside --run that sets one of its fields (--model, "
                                   "--hardware, --software, --devices, --seq, --global-batch, --hbm-headroom) must "
                                   "agree with it, and strategy flags apply over its mesh file as over --mesh.")
    add_model_mesh(e, required=False)
    e.add_argument("--run", type=nonempty, metavar="FILE", help="a run file written by `plan --write` (NAME.run.toml): "
                   "the model, hardware, software, devices, seq and global batch of a plan, and its mesh file")
    e.add_argument("--hardware", help="profile name (h100-sxm, a100-80gb, tpu-v5p, ...) or TOML path (required "
                   "without --run)")
    e.add_argument("--seq", type=POSITIVE, help=f"tokens per sequence (default {DEFAULT_SEQ}, at most the model's max_seq)")
    add_global_batch(e, None)
    add_hbm_headroom(e)
    e.add_argument("--json", type=nonempty, help="write the estimate as one JSON object to this file")
    add_phase_flags(e, "a training step (default), or one generation step: prefill of --global-batch prompts of "
                       "--seq tokens, or decode of one token per sequence against a cache of --seq + --gen-len - 1")
    add_software_flag(e)
    e.set_defaults(software=None, hbm_headroom=None)  # None: not given (a --run file's value, else the default)
    add_strategy_flags(e, "estimate")


def add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="rank strategies for a model on N devices of a hardware type")
    pl.add_argument("--model", required=True, help="preset (llama3-8b, ...), preset:key=value,..., a TOML path, or hf:DIR")
    pl.add_argument("--hardware", required=True, help="profile name (h100-sxm, a100-80gb, tpu-v5p, ...) or TOML path")
    pl.add_argument("--devices", type=integer(1, MAX_CLUSTER_DEVICES), required=True, metavar="N",
                    help="devices in the cluster (nothing is simulated)")
    pl.add_argument("--seq", type=POSITIVE, help=f"tokens per sequence (default {DEFAULT_SEQ}, at most the model's max_seq)")
    add_global_batch(pl, DEFAULT_GLOBAL_BATCH)
    add_hbm_headroom(pl)
    pl.set_defaults(hbm_headroom=HBM_HEADROOM)
    pl.add_argument("--top", type=POSITIVE, default=10, help="plans to list (default 10)")
    pl.add_argument("--json", type=nonempty, help="write the plans as one JSON object to this file")
    pl.add_argument("--verify", action="store_true",
                    help="compile each listed plan on simulated CPU devices (at reduced data parallelism beyond "
                         "2048) and print predicted vs compiled bytes per mesh-axis group and memory per device")
    pl.add_argument("--target", default="cpu", metavar="cpu|tpu-TOPOLOGY",
                    help="with --verify: compile with XLA:CPU (default) or for a TPU topology of --devices chips, e.g. "
                         "tpu-v5p:8x8x4 (XLA:TPU ahead of time; needs the tpu-aot extra)")
    pl.add_argument("--objective", choices=("throughput", "energy"), default="throughput",
                    help="rank by tokens/s (default) or by joules per token (the profile's power model)")
    pl.add_argument("--dtype", choices=("bfloat16", "float8"), default="bfloat16",
                    help="the precision the plans compute in (default bfloat16); float8: the stack's float8 "
                         "linears (jaxpar's: its scaled attention and MLP projections, --fp8-recipe) on a profile "
                         "with a float8 peak")
    pl.add_argument("--grad-dtype", choices=CHOICES["grad_dtype"], default="float32",
                    help="the dtype the plans accumulate and reduce gradients in (default float32); bfloat16 for "
                         "another stack's run that reduces in bf16 (NeMo's optim.grad_sync_dtype bf16)")
    pl.add_argument("--write", type=nonempty, metavar="DIR",
                    help="write each plan as a mesh_configs TOML file (plan-01-<name>.toml, ...) and beside it its "
                         "question (plan-01-<name>.run.toml: jaxpar estimate --run FILE) to DIR")
    add_phase_flags(pl, "search training layouts (default), or inference layouts for a prefill of --global-batch "
                        "prompts of --seq tokens or a decode step with --gen-len new tokens (jaxpar/planning/inference.py)")
    add_software_flag(pl)


ANALYSIS_NOTE = ("--devices defaults to the mesh's device count, capped at 2048 (the most XLA:CPU compiles); "
                 "bigger meshes are compiled at reduced data parallelism and rescaled (see jaxpar/analysis/comm.py)")


def add_comm(sub) -> None:
    c = sub.add_parser("comm", help="compile one training step and tally its collectives, FLOPs and memory",
                       description=ANALYSIS_NOTE)
    add_model_mesh(c)
    add_analysis_flags(c)
    c.add_argument("--abstract", action="store_true", help="compile from shapes only, no arrays allocated (analysis always does; kept for scripts)")
    c.add_argument("--json", type=nonempty, help="write the report as one JSON object to this file")
    c.add_argument("--phase", choices=("train", "prefill", "decode"), default="train",
                   help="the step to compile: a training step (default), or generation's prefill or decode step "
                        "(--batch prompts of --seq tokens, --gen-len new tokens)")
    c.add_argument("--gen-len", type=POSITIVE, default=16, help="new tokens per prompt (prefill/decode phases)")
    add_strategy_flags(c, "comm")
    add_distributed_flags(c)


def add_compare(sub) -> None:
    cp = sub.add_parser("compare", help="the communication of several strategies side by side",
                        description=ANALYSIS_NOTE)
    add_model_mesh(cp, meshes=True)
    add_analysis_flags(cp)
    cp.add_argument("--run-steps", type=NON_NEGATIVE, default=0, metavar="K",
                    help="also train K steps per strategy from the same initial parameters and report "
                         "|loss - 1-device loss| and the step time")
    cp.add_argument("--seed", type=SEED, default=0, help="with --run-steps: the parameters' and the data's seed")
    cp.add_argument("--lr", type=real(0.0, open_lo=True), default=3e-3, help="with --run-steps: the peak learning rate")
    cp.add_argument("--json", type=nonempty, help="write {model, reports: [...]} as one JSON object to this file")
    cp.add_argument("--plot", type=png_path, help="write a PNG of bytes per device per step by kind and mesh axes")
    add_strategy_flags(cp, "compare")


def add_launch(sub) -> None:
    la = sub.add_parser("launch", help="run a command as N local processes on CPU (multi-process development)",
                        description="Start N processes of `jaxpar COMMAND ...`, each with D simulated CPU "
                                    "devices, joined by jax.distributed (gloo collectives). Signals are "
                                    "forwarded; if one process fails the others are stopped.",
                        usage="jaxpar launch --processes N [--devices-per-process D] -- COMMAND [ARGS ...]")
    la.add_argument("--processes", type=POSITIVE, required=True, metavar="N", help="processes to start")
    la.add_argument("--devices-per-process", type=POSITIVE, default=1, metavar="D",
                    help="simulated CPU devices in each process (default 1)")
    la.add_argument("--grace", type=real(0.0), default=2.0, metavar="S",
                    help="seconds a process gets to stop (after a forwarded signal, or when another "
                         "process failed) before it is killed")
    la.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                    help="a jaxpar command and its flags (train, comm)")


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate tokens from prompts: sharded prefill and decode with a KV cache",
                       description="Prefill the prompts (left-padded to the longest) and decode one token per "
                                   "sequence per step under a strategy: K/V cache heads over tensor (replicated "
                                   "across tensor ranks when tensor > kv_heads), sequences over the data axes. "
                                   "Prints the new token ids, the time to first token, the per-token latency and "
                                   "tokens/s. Without --checkpoint the parameters are a fresh initialisation. "
                                   "--dtype is the weights' and the cache's dtype too (bfloat16 converts the "
                                   "parameters once as they load); --attention, --attention-kernel and --cp-layout "
                                   "are the prefill's. A mesh file's training options (remat, micro-batches, "
                                   "pipelines, overlap) do not apply.")
    add_model_mesh(g, model_default="with --checkpoint, the model it was written for")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", type=token_ids, metavar="IDS",
                     help="one prompt as comma-separated token ids (1,2,3); repeat for a batch")
    src.add_argument("--prompt-file", type=nonempty, metavar="FILE",
                     help="one prompt per line, token ids separated by commas or spaces")
    src.add_argument("--prompt-text", action="append", type=nonempty, metavar="TEXT",
                     help="one prompt as text, tokenized by --tokenizer (or the checkpoint's run's data); repeat "
                          "for a batch; the continuation is printed as text")
    g.add_argument("--tokenizer", type=nonempty, metavar="FILE_OR_DIR", help="for --prompt-text: a tokenizer.json, "
                   "an HF directory holding one, or a `jaxpar data` directory")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=16, metavar="N", help="tokens to generate per prompt")
    g.add_argument("--temperature", type=real(0.0), default=0.0, help="sampling temperature; 0 (default) is greedy")
    g.add_argument("--top-k", type=NON_NEGATIVE, default=0, metavar="K",
                   help="sample among the K most likely tokens (0: all); needs --temperature > 0")
    g.add_argument("--top-p", type=real(0.0, 1.0, open_lo=True), default=1.0, metavar="P",
                   help="sample among the most likely tokens holding probability P (1: all); needs --temperature > 0")
    g.add_argument("--seed", type=SEED, default=0, help="sampling seed (the same seed gives the same tokens)")
    g.add_argument("--param-seed", type=SEED, default=0, help="without --checkpoint: the parameters' initialisation seed")
    g.add_argument("--checkpoint", type=nonempty, metavar="DIR",
                   help="a `train --ckpt-dir` directory: restore its newest parameters (of the same model) onto this mesh")
    g.add_argument("--checkpoint-step", type=NON_NEGATIVE, metavar="N", help="with --checkpoint: restore step N")
    g.add_argument("--hf-checkpoint", type=nonempty, metavar="DIR",
                   help="a Hugging Face LLaMA-layout (or Mixtral, Qwen3-MoE, DeepSeek-V3, Mamba-2) directory "
                        "(config.json + *.safetensors): load its weights, sharded as they load (--model hf:DIR "
                        "takes the model from its config.json)")
    g.add_argument("--json", type=nonempty, help="write the tokens and timings (with --prompt-text, the decoded "
                   "text too) as one JSON object to this file")
    add_strategy_flags(g, "generate")


def add_analysis_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="cpu", metavar="cpu|tpu-TOPOLOGY",
                   help="the compiler: cpu (default: XLA:CPU on simulated devices) or a TPU topology, e.g. "
                        "tpu-v5e:2x4, tpu-v5p:8x8x4, compiled by XLA:TPU ahead of time on this host (needs "
                        "the tpu-aot extra: libtpu; nothing runs on it)")
    p.add_argument("--batch", type=POSITIVE, help=f"global batch in sequences (default {DEFAULT_GLOBAL_BATCH}, as "
                   "estimate's, rounded up to a multiple of the sequences one step needs: one per data-parallel "
                   "rank, accumulation step and micro-batch)")
    p.add_argument("--seq", type=POSITIVE, help=f"sequence length (default {DEFAULT_SEQ}, as estimate's, at most the "
                   "model's max_seq)")




def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc/self/stat against /proc/uptime,
    in clock ticks), so that `train`'s wall time counts the interpreter's start and the imports; 0 where
    /proc is not there."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter() - (process_age() if argv is None else 0.0)  # a call from Python: from the call
    if argv is None and hasattr(signal, "SIGPIPE"):  # `jaxpar estimate ... | head`: stop quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if argv is None:
        separate_streams()  # a process `jaxpar launch` started: its lines apart from the runtime's
    try:
        args = build_parser().parse_args(argv)
        args.began = began
        check_outputs(args)  # every file a command will write, before it runs
        if args.command in ANALYTIC:
            return ANALYTIC[args.command](args)
        if args.command == "explain":
            return explain.cmd_explain(args)
        if args.command == "schedule":
            return schedule.cmd_schedule(args)
        from jaxpar.cli import commands  # deferred: JAX, Flax and the trainer load only for the commands that use them
        args.imported = time.perf_counter()
        return commands.run(args)
    except ConfigError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C outside training's steps, or a second one inside them
        print("\njaxpar: interrupted (Ctrl-C): stopped at once, nothing saved", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
