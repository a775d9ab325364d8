"""What each `jaxpar` command that compiles or trains does (train, comm, compare, generate, launch), once
jaxpar/cli/main.py has parsed its flags. `run` first joins a multi-process run and simulates `--devices`:
both must happen before JAX's backend starts, and importing JAX does not start it. `estimate` and `plan`
ask only the analytic cost model and live in jaxpar/cli/commands_cost.py, which never loads JAX.
Every input is checked before anything compiles or trains: flag values by the parser's types
(jaxpar/core/inputs.py), configs by their loaders, combinations by jaxpar/core/validate.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import traceback
from typing import NoReturn

import jax

from jaxpar import distributed
from jaxpar.collectives import human_bytes
from jaxpar.analysis import comm, target
from jaxpar.analysis.overlap import format_overlap
from jaxpar.analysis.report import compare, format_table, plot
from jaxpar.cli import train_log
from jaxpar.cli.args import hf_params, model_from, strategy_from_args
from jaxpar.cli.launch import launch
from jaxpar.core.inputs import read_prompt_file
from jaxpar.core.validate import data_parallel_size, sequences_per_step
from jaxpar.cost.hardware import load_hardware
from jaxpar.devices import MAX_DEVICES, backend_started, cpu_without_accelerator, simulate_cpu_devices
from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.planning.question import DEFAULT_SHAPE, default_batch, default_seq
from jaxpar.serving import hf_export
from jaxpar.serving.generate import Generator, Sampling
from jaxpar.training.checkpoint import Checkpointer, restore_params, saved_meta
from jaxpar.training import corpus
from jaxpar.training import tokenizer as tokenizers
from jaxpar.training.data import make_source
from jaxpar.training.loader import Dataset, PreparedSource
from jaxpar.training import metrics
from jaxpar.training.metrics import Sinks
from jaxpar.training.config import OptimizerConfig, TrainConfig
from jaxpar.training.tokenizer import Tokenizer
from jaxpar.training.trainer import Preempted, PreemptionNotice, Trainer, TrainState, train


def run(args) -> int:
    """Run the command `args` names: join the multi-process run that the flags or the environment
    describe (jaxpar/distributed.py), simulate `--devices`, then the command. A process that joined a
    run leaves at once when the command fails (`leave_on`)."""
    try:
        args.multi_process = hasattr(args, "coordinator") and join_cluster(args)
        if getattr(args, "devices", None):
            simulate_cpu_devices(args.devices)
        elif not args.multi_process:
            cpu_without_accelerator()
        return COMMANDS[args.command](args)
    except Exception as e:
        if not distributed.joining():
            raise
        leave_on(e)


def join_cluster(args) -> bool:
    """Join a multi-process run if the flags or the environment describe one (jaxpar/distributed.py)."""
    cluster = distributed.cluster_from(args.coordinator, args.num_processes, args.process_id)
    if cluster is None:
        return False
    if args.devices:
        raise ConfigError("--devices simulates devices in one process; in a multi-process run each process "
                          "brings its own devices (jaxpar launch --devices-per-process D)")
    distributed.initialize(cluster, timeout_s=args.init_timeout, heartbeat_s=args.heartbeat_timeout)
    return True


def leave_on(e: Exception) -> NoReturn:
    """A process of a multi-process run stops on `e`: exit 2 for bad input, 3 when another process died,
    1 for a bug (with its traceback). The launcher or the scheduler stops the others."""
    if isinstance(e, ConfigError):
        distributed.leave(f"jaxpar: error: {e}", 2)
    if (message := distributed.peer_failure(e)) is not None:
        distributed.leave(f"jaxpar: error: {message}", 3)
    traceback.print_exc()
    distributed.leave(f"jaxpar: error: process {jax.process_index()} failed: {type(e).__name__}: {e}", 1)


def train_config(args) -> TrainConfig:
    """The run's TrainConfig from the train flags, the optimizer's settings in their own config."""
    optimizer = OptimizerConfig(b1=args.b1, b2=args.b2, weight_decay=args.weight_decay, clip=args.clip,
                                schedule=args.schedule, min_lr_ratio=args.min_lr_ratio)
    if args.warmup is not None and args.warmup > args.steps:
        raise ConfigError(f"--warmup {args.warmup} is longer than the run (--steps {args.steps}): the learning rate "
                          f"would never reach --lr {args.lr:g}; give --warmup <= {args.steps}")
    warmup = TrainConfig.warmup if args.warmup is None else args.warmup
    return TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, seed=args.seed, lr=args.lr,
                       warmup=warmup, optimizer=optimizer)


def cmd_train(args) -> int:
    check_checkpoint_flags(args)
    if distributed.is_main():  # a fresh run overwrites no metrics unasked (paths checked writable by cli.main)
        metrics.check(args.metrics, args.tensorboard, resume=args.resume, overwrite=args.overwrite_metrics)
    model = model_from(args.model)
    trainer = Trainer(model, strategy_from_args(args), train_config(args))
    if args.document_mask:
        trainer.use_document_mask()
    trainer.check_host_memory()
    source = make_source(args.data, model.vocab, args.seed, args.batch)
    held_out = eval_source(args, model.vocab, source)
    main = distributed.is_main()
    hardware = load_hardware(args.hardware) if args.hardware else None
    stop = min(args.stop_after or args.steps, args.steps)
    train_log.check_profile_steps(args, 0, stop)
    data = str(source.data.root.resolve()) if isinstance(source, PreparedSource) else None
    ckpt = open_checkpoints(args, main, data) if args.ckpt_dir is not None else None
    state, start = resume(args, ckpt, trainer, stop, main) if args.resume else (None, 0)
    if start >= stop:
        limit = f"--steps {args.steps}" if stop == args.steps else f"--stop-after {args.stop_after}"
        if main:
            print(f"nothing to do: checkpoint step {start} >= {limit}")
        ckpt.close()
        return 0
    if start:  # resumed: is the --profile window still ahead?
        try:
            train_log.check_profile_steps(args, start, stop)
        except ConfigError:
            ckpt.close()
            raise
    # a resumed run's metrics are cut back to the restored step, then appended to (jaxpar/training/metrics.py)
    sinks = (Sinks(args.metrics, args.tensorboard, resumed_at=start if args.resume else None,
                   overwrite=args.overwrite_metrics) if main else Sinks())
    if state is None and args.hf_checkpoint is not None:  # a fresh run starting from pretrained weights
        state = trainer.state_from_params(hf_params(args.hf_checkpoint, model, trainer.abstract_params))
        if main:
            print(f"parameters from the Hugging Face checkpoint {args.hf_checkpoint} (fresh optimizer state)")
    if main:
        print("\n".join(train_log.header(trainer, args.data, hardware, start, stop)))
    _, compile_s = train_log.timed("compiling the training step", trainer.compile, main)
    init_s = 0.0
    if state is None:  # before the bar starts, so that no step's time or ETA includes its compilation
        state, init_s = train_log.timed("initialising the parameters and optimizer state in their shards",
                                        trainer.init_state, main)
    log = train_log.StepLog(args, trainer, sinks, hardware, show=main)
    evaluate = evaluator(args, trainer, held_out, log, stop) if held_out is not None else None
    code = run_steps(args, trainer, source, log, state, start, ckpt, evaluate)
    if main and code == 0:
        wall, imports = time.perf_counter() - args.began, args.imported - args.began  # from the process's start
        print(log.summary(train_log.Phases(wall, imports, compile_s, init_s)))
    return code


def run_steps(args, trainer: Trainer, source, log: train_log.StepLog, state, start: int, ckpt, evaluate=None) -> int:
    """Steps start + 1 .. --stop-after (or --steps), the last saved with --ckpt-dir; on a preemption
    notice (SIGTERM, or a first Ctrl-C) the step in flight is saved and the exit status is 128 + the
    signal's number (143, 130), as if the signal had stopped the process."""
    stop = min(args.stop_after or args.steps, args.steps)
    log.begin(start, stop)
    try:
        with PreemptionNotice():  # SIGTERM or Ctrl-C: finish the step, save (with --ckpt-dir), stop
            state = train(trainer, source, on_step=log, state=state, start=start, stop=args.stop_after,
                          checkpointer=ckpt, on_save=log.saved, evaluate=evaluate)
        if ckpt is not None:
            if stop > start and (args.ckpt_every <= 0 or stop % args.ckpt_every):
                if ckpt.maybe_save(stop, state, trainer, force=True):
                    log.saved(stop)
            ckpt.close()
    except Preempted as stopped:
        if ckpt is not None:
            ckpt.close()
        if log.show:
            print(f"\n{stopped}")
        return 128 + stopped.signum  # as if the signal had stopped it: the scheduler sees an unfinished run
    finally:
        log.close()
        log.sinks.close()
    return 0


def eval_source(args, vocab: int, source) -> PreparedSource | None:
    """--eval-every's held-out rows: the validation split of --eval-data, else of --data's directory, in
    its own order (the same batches at every evaluation); --document-mask's source check."""
    prepared = isinstance(source, PreparedSource)
    if args.document_mask:
        if not prepared:
            raise ConfigError(f"--document-mask needs prepared data (a `jaxpar data` directory), not --data {args.data}")
        source.document_mask = True
    if not args.eval_every:
        if args.eval_data is not None:
            raise ConfigError(f"--eval-data {args.eval_data} needs --eval-every N (N >= 1)")
        return None
    if args.eval_data is None and not prepared:
        raise ConfigError(f"--eval-every {args.eval_every} needs held-out text: --eval-data DIR, or --data a "
                          "`jaxpar data` directory (whose validation split is used)")
    data = Dataset(args.eval_data, vocab) if args.eval_data is not None else source.data
    if not data.tokens("val"):
        raise ConfigError(f"--eval-every: {data.root} has no validation split (prepared with --val-fraction 0)")
    held = PreparedSource(data, "val", 0, args.batch, shuffle=False)
    held.document_mask = args.document_mask
    return held


def evaluator(args, trainer: Trainer, held_out: PreparedSource, log: train_log.StepLog, stop: int):
    """`train`'s evaluate hook: every --eval-every steps and at the last, --eval-batches held-out batches,
    also shown on the console."""
    def evaluate(step: int, state) -> dict:
        if step % args.eval_every and step != stop:
            return {}
        fields = trainer.evaluate(state, held_out, args.eval_batches)
        if log.show:
            (print if log.bar is None else log.bar.write)(
                f"step {step}: eval_loss {fields['eval_loss']:.4f}  eval_ppl {fields['eval_ppl']:.2f}")
        return fields
    return evaluate


def cmd_eval(args) -> int:
    """`jaxpar eval`: a checkpoint's held-out loss on --mesh, its model read from the checkpoint, over the
    first --eval-batches batches of --data's validation split (the batches `train --eval-every` reads)."""
    meta, step = saved_meta(args.ckpt_dir, args.ckpt_step, "--ckpt-dir")
    model = ModelConfig(**meta["model"])
    if args.data is None and "data" not in meta:
        raise ConfigError(f"--ckpt-dir {args.ckpt_dir}: its run trained on no `jaxpar data` directory; give --data DIR")
    data = Dataset(args.data or meta["data"], model.vocab)
    if not data.tokens("val"):
        raise ConfigError(f"--data {data.root} has no validation split (prepared with --val-fraction 0)")
    strategy = strategy_from_args(args)
    if strategy.num_devices < 1:
        strategy = strategy.resolved(jax.device_count())
    trainer = Trainer(model, strategy, TrainConfig(batch=args.batch, seq=args.seq, seed=meta.get("seed", 0)))
    params, message = restore_params(trainer, args.ckpt_dir, step)
    held = PreparedSource(data, "val", 0, args.batch, shuffle=False)
    fields = trainer.evaluate(TrainState(params, None, None), held, args.eval_batches)
    result = {"step": step, "model": model.name, "strategy": strategy.describe(), "batches": args.eval_batches,
              "batch": args.batch, "seq": args.seq, **fields}
    if distributed.is_main():
        print(message)
        print(f"step {step}: eval_loss {fields['eval_loss']:.4f}  eval_ppl {fields['eval_ppl']:.2f}  "
              f"({args.eval_batches} batches of {args.batch} x {args.seq} tokens from {data.root}'s validation split)")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def check_checkpoint_flags(args) -> None:
    """The checkpoint flags' combinations, before anything is built (an empty --ckpt-dir and
    --stop-after < 1 are refused by the parser's types: jaxpar/core/inputs.py)."""
    overwrite, resume_step = getattr(args, "overwrite_ckpt", False), getattr(args, "resume_step", None)
    for flag, given in (("--resume", args.resume), ("--overwrite-ckpt", overwrite)):
        if given and args.ckpt_dir is None:
            raise ConfigError(f"{flag} needs --ckpt-dir")
    if args.resume and overwrite:
        raise ConfigError("--resume and --overwrite-ckpt contradict each other: --overwrite-ckpt deletes the "
                          "checkpoints --resume would continue from")
    if resume_step is not None and not args.resume:
        raise ConfigError(f"--resume-step {resume_step} needs --resume")


def open_checkpoints(args, main: bool, data: str | None = None) -> Checkpointer:
    """--ckpt-dir's checkpointer (recording `data`, the run's `jaxpar data` directory). A fresh run (no
    --resume) refuses a directory that holds checkpoints, so that no run overwrites another's by accident;
    --overwrite-ckpt deletes them first."""
    ckpt = Checkpointer(args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep, data=data)
    if not args.resume and (found := ckpt.steps()):
        if not getattr(args, "overwrite_ckpt", False):
            raise ConfigError(f"--ckpt-dir {ckpt.dir} already holds checkpoints of steps "
                              f"{', '.join(map(str, found))}; add --resume to continue from step {found[-1]}, "
                              "or --overwrite-ckpt to delete them and start afresh")
        ckpt.delete_all()
        if main:
            print(f"--overwrite-ckpt: deleted the checkpoints of steps {', '.join(map(str, found))} in {ckpt.dir}")
    return ckpt


def resume(args, ckpt: Checkpointer, trainer: Trainer, stop: int, main: bool):
    """--resume: (state, step) from the newest checkpoint (or --resume-step's), resharded onto this
    run's mesh. Checkpoints newer than that step are moved aside, not deleted: this run writes those
    steps again, and a damaged newest checkpoint stays for inspection."""
    state, start, message = ckpt.restore(trainer, getattr(args, "resume_step", None))
    if main:
        print(message)
    if start < stop and (moved := ckpt.set_aside_after(start)) and main:
        print(f"newer checkpoints moved aside (kept, not deleted), as this run will write those steps "
              f"again: {', '.join(map(str, moved))}")
    return state, start


def analysis_devices(args, strategies) -> int:
    """Devices to simulate for compile-only analysis: --devices, or the biggest mesh's device count
    capped at what XLA:CPU compiles (bigger meshes are analysed at reduced data parallelism). In a
    process whose JAX backend already started (a notebook, the tests) its devices are used."""
    if getattr(args, "multi_process", False):  # every process's devices, compiled in each process
        return jax.device_count()
    if args.devices:  # already simulated by cli.main (which refuses more than devices.MAX_DEVICES)
        return args.devices
    for s in strategies:
        if s.num_devices < 1:
            raise ConfigError(f"mesh {s.name} has a -1 axis: give --devices N to resolve it")
    n = min(max(s.num_devices for s in strategies), MAX_DEVICES)
    if backend_started():
        return min(n, jax.device_count())
    simulate_cpu_devices(n)
    return n


def analysis_config(args, model, strategies, **extra):
    """TrainConfig for analysis: --batch/--seq, or the default question's (planning/question.py), the batch
    rounded up to a multiple every strategy's step can split."""
    multiple = math.lcm(*(sequences_per_step(s.resolved(args.devices) if s.num_devices < 1 else s) for s in strategies))
    batch = args.batch or default_batch(multiple)
    return TrainConfig(batch=batch, seq=args.seq or default_seq(model.max_seq), **extra)


def analysis_shape(args, tc) -> str:
    """The step `comm` and `compare` compiled: its batch and sequence, and whether they were defaults."""
    unset = [flag for flag, value in (("--batch", args.batch), ("--seq", args.seq)) if value is None]
    return (f"batch {tc.batch} sequences x seq {tc.seq} = {tc.batch * tc.seq:,} tokens per step"
            + (f" ({' and '.join(unset)} not given: the default question of estimate, plan, comm and compare, "
               f"{DEFAULT_SHAPE})" if unset else ""))


def cmd_comm(args) -> int:
    model = model_from(args.model)
    strategy = strategy_from_args(args)
    n = analysis_devices(args, [strategy])
    if args.phase != "train" and args.target != "cpu":
        raise ConfigError(f"comm --phase {args.phase} compiles on CPU devices only; --target {args.target} is for training steps")
    if args.phase != "train":
        report = comm_generation(args, model, strategy, jax.devices()[:n])
    else:
        tc = analysis_config(args, model, [strategy])
        report = comm.analyze_strategy(model, strategy, tc, target.devices(args.target, n))
    if jax.process_index():
        return 0
    if args.phase == "train":
        print(analysis_shape(args, tc))
    print(format_table(report))
    print(format_overlap(report["overlap"]))
    widened = args.target == "cpu" and strategy.options.program_dtype == "bfloat16"
    report["bf16_collectives_in_float32"] = widened
    if widened:
        print("note: XLA:CPU runs bfloat16 collectives in float32 (its float normalization; the cost model's "
              "Compiler.promote_bf16): their bytes above are twice what XLA:GPU and XLA:TPU move, which "
              "`jaxpar estimate` prices")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def comm_generation(args, model, strategy, devices) -> dict:
    """`comm --phase prefill|decode`: one generation step of --batch prompts of --seq tokens (defaults: the
    default question's, the prompt short enough that --gen-len new tokens fit max_seq), compiled and tallied."""
    strategy = strategy.resolved(len(devices)) if strategy.num_devices < 1 else strategy
    batch = args.batch or default_batch(data_parallel_size(strategy))
    prompt = args.seq or min(default_seq(model.max_seq), model.max_seq - args.gen_len)
    gen = Generator(model, strategy, [[0] * prompt] * batch, args.gen_len, devices=devices[:strategy.num_devices])
    t0 = time.perf_counter()
    steps = dict(zip(("prefill", "decode"), gen.compiled_steps()))
    name = f"{model.name} {args.phase} (batch {batch}, prompt {prompt}, cache {prompt + args.gen_len - 1})"
    report = comm.analyze_compiled(steps[args.phase], gen.phase(args.phase).mesh, name, time.perf_counter() - t0)
    report["phase"] = args.phase
    return report


def cmd_compare(args) -> int:
    if args.run_steps < 0:
        raise ConfigError(f"--run-steps must be >= 0, got {args.run_steps}")
    model = model_from(args.model)
    strategies = [strategy_from_args(args, spec) for spec in args.meshes]
    n = analysis_devices(args, strategies)
    tc = analysis_config(args, model, strategies, steps=max(args.run_steps, 1), seed=args.seed, lr=args.lr)
    reports = comm.compare_strategies(model, strategies, tc, target.devices(args.target, n), run_steps=args.run_steps)
    print(analysis_shape(args, tc))
    print(compare(reports))
    if args.run_steps and jax.devices()[0].platform == "cpu":
        print(f"step time: {n} simulated CPU devices sharing this host's {os.cpu_count()} cores, not accelerators "
              "(a comparison between strategies at best; jaxpar estimate predicts an accelerator's)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "reports": reports}, f, indent=1)
    if args.plot:
        plot(reports, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def cmd_data(args) -> int:
    """`jaxpar data`: prepare text for training (jaxpar/training/corpus.py) and say what was written."""
    if args.train_tokenizer and args.vocab is None:
        raise ConfigError("--train-tokenizer needs --vocab N (the trained tokenizer's vocabulary size)")
    if args.vocab is not None and not args.train_tokenizer:
        raise ConfigError(f"--vocab {args.vocab} sizes a trained tokenizer; --tokenizer's vocabulary is its own")
    done = corpus.prepare(args.input, args.output, tokenizer=args.tokenizer, vocab=args.vocab,
                          val_fraction=args.val_fraction, field=args.text_field, seed=args.seed,
                          progress=not args.no_progress)
    m = done.manifest
    tokens = sum(split["tokens"] for split in m["splits"].values())
    print(f"wrote {done.path}: {len(m['inputs'])} files; tokenizer {m['tokenizer_source']} ({m['vocab']} ids, "
          f"{m['dtype']}, end-of-text {m['eot_token']} = {m['eot']})")
    for name, split in m["splits"].items():
        print(f"  {name}: {split['documents']} documents, {split['tokens']:,} tokens in {len(split['shards'])} shards")
    print(f"{tokens:,} tokens in {done.seconds:.1f} s ({tokens / done.seconds:,.0f} tokens/s)")
    return 0


def text_prompts(args) -> tuple[list[list[int]], Tokenizer | None]:
    """The prompts as token ids, and for --prompt-text the tokenizer that encodes them and decodes the
    continuation (--tokenizer: a tokenizer.json, an HF directory, or a `jaxpar data` directory; else that
    of the `jaxpar data` directory the --checkpoint's run trained on)."""
    if args.prompt_text is None:
        if args.tokenizer is not None:
            raise ConfigError(f"--tokenizer {args.tokenizer} is for --prompt-text; --prompt and --prompt-file are ids")
        return (args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file)), None
    tokenizer = args.tokenizer or (args.checkpoint and saved_meta(args.checkpoint, args.checkpoint_step)[0].get("data"))
    if not tokenizer:
        raise ConfigError("--prompt-text needs --tokenizer (a tokenizer.json, an HF directory holding one, or the "
                          "`jaxpar data` directory the model was trained on; a --checkpoint of a run on one names it)")
    tok = tokenizers.load(tokenizer)
    prompts = [tok.encode(text) for text in args.prompt_text]
    if empty := [text for text, ids in zip(args.prompt_text, prompts) if not ids]:
        raise ConfigError(f"--prompt-text {empty[0]!r} encodes to no tokens")
    return prompts, tok


def generation_model(args):
    """--model, else the model a --checkpoint was written for (its metadata)."""
    if args.model is not None:
        return model_from(args.model)
    if args.checkpoint is None:
        raise ConfigError("generate needs --model M, or --checkpoint DIR (a `train --ckpt-dir`, whose model it reads)")
    meta, _ = saved_meta(args.checkpoint, args.checkpoint_step)
    return ModelConfig(**meta["model"])


def cmd_generate(args) -> int:
    model = generation_model(args)
    strategy = strategy_from_args(args)
    prompts, tok = text_prompts(args)
    if args.checkpoint_step is not None and args.checkpoint is None:
        raise ConfigError(f"--checkpoint-step {args.checkpoint_step} needs --checkpoint")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise ConfigError(f"--top-k {args.top_k} / --top-p {args.top_p} shape sampling, but --temperature 0 is greedy "
                          "decoding; give --temperature > 0")
    if args.top_k > model.vocab:
        raise ConfigError(f"--top-k {args.top_k} exceeds the model's vocab={model.vocab}")
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    gen = Generator(model, strategy, prompts, args.max_new_tokens, sampling)  # every check, before compiling
    if args.hf_checkpoint is not None:
        if args.checkpoint is not None:
            raise ConfigError("--checkpoint and --hf-checkpoint both give the parameters: choose one")
        params = gen.place_params(hf_params(args.hf_checkpoint, model, gen.abstract_params))
        source = f"parameters: Hugging Face checkpoint {args.hf_checkpoint}"
    elif args.checkpoint is not None:
        params, source = gen.restore_params(args.checkpoint, args.checkpoint_step)
    else:
        params, source = gen.init_params(args.param_seed), f"parameters: fresh initialisation (seed {args.param_seed})"
    kv = f"; K/V heads x{gen.kv_copies} across tensor ranks" if gen.kv_copies > 1 else ""
    print(f"model {model.name}: {model.layers} layers, d_model={model.d_model}, pattern={model.pattern}")
    print(f"strategy {gen.describe()}{kv}; {source}")
    held = gen.bytes_per_device()
    print(f"weights in {gen.weight_dtype.name}: {human_bytes(held['weights'])} per device, cache "
          f"{human_bytes(held['cache'])} per device")
    print(f"compiled prefill and decode in {gen.compile():.1f} s")
    result = gen.generate(params, prompts)
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens.tolist())):
        print(f"prompt {i} ({len(prompt)} tokens) -> {' '.join(map(str, new))}")
        if tok is not None:
            print(f"  {tok.decode(prompt)!r} -> {tok.decode(new)!r}")
    latency = (f"per-token latency {result.per_token_latency_s * 1e3:.1f} ms" if result.decode_step_s
               else "no decode step (--max-new-tokens 1)")
    print(f"time to first token {result.time_to_first_token_s * 1e3:.1f} ms  {latency}  "
          f"{result.tokens_per_s:.0f} tokens/s ({result.tokens.size} tokens, batch {len(prompts)})")
    if gen.resharded:
        print(f"resharded weights and cache from the prefill to the decode layout in {result.reshard_s * 1e3:.1f} ms")
    if args.json:
        report = {"model": model.name, "mesh": dict(gen.strategy.sizes), "devices": gen.mesh.size,
                  "prefill_mesh": dict(gen.prefill.strategy.sizes), "decode_mesh": dict(gen.decode.strategy.sizes),
                  "batch": len(prompts), "prompt_lengths": [len(p) for p in prompts],
                  "max_new_tokens": args.max_new_tokens, "sampling": dataclasses.asdict(sampling),
                  "kv_head_copies": gen.kv_copies, "params": source, "weights_dtype": gen.weight_dtype.name,
                  "bytes_per_device": held, **result.to_json()}
        if tok is not None:  # --prompt-text: the prompts and their continuations as text too
            report["text"] = [{"prompt": tok.decode(p), "continuation": tok.decode(new)}
                              for p, new in zip(prompts, result.tokens.tolist())]
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def cmd_launch(args) -> int:
    return launch(args.processes, args.devices_per_process, args.rest, grace_s=args.grace)


def cmd_export(args) -> int:
    """`jaxpar export CKPT --to hf OUT`: a checkpoint's parameters, restored sharded on --mesh, written as a
    Hugging Face checkpoint one gathered tensor at a time (jaxpar/serving/hf_export.py)."""
    meta, step = saved_meta(args.ckpt_dir, args.ckpt_step, "CHECKPOINT_DIR")
    model = ModelConfig(**meta["model"])
    hf_export.check(model, args.out_dir)   # refused before anything is restored
    strategy = strategy_from_args(args)
    if strategy.num_devices < 1:
        strategy = strategy.resolved(jax.device_count())
    trainer = Trainer(model, strategy, TrainConfig(batch=strategy.num_devices, seq=8, seed=meta.get("seed", 0)))
    params, message = restore_params(trainer, args.ckpt_dir, step)
    tok = meta.get("data") and pathlib.Path(meta["data"], "tokenizer.json")
    tok = tokenizers.load(str(tok)) if tok and tok.is_file() else None   # the run's `jaxpar data` tokenizer
    files = hf_export.export(model, hf_export.params_leaf(params), args.out_dir, args.dtype, tok)
    if distributed.is_main():
        if model.mtp_depth:
            print(f"note: the model's {model.mtp_depth} multi-token prediction module(s) are not exported "
                  "(transformers' DeepseekV3ForCausalLM has none)", file=sys.stderr)
        print(message)
        print(f"step {step} of {model.name} written to {args.out_dir} as {hf_export.architecture(model)} "
              f"({args.dtype}): {', '.join(files)}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "comm": cmd_comm, "compare": cmd_compare,
            "generate": cmd_generate, "launch": cmd_launch, "data": cmd_data}
