"""Every constraint between a model, a strategy and a batch, checked in one place before compiling.

Each failure raises ConfigError with a message naming the constraint and the values, e.g.
"tensor=4 does not divide heads=6". `check` runs them all; the kernels call the pieces they rely
on (`check_token_layout`), never the reverse. Constraints internal to one config live with it:
`ModelConfig.validate` (model fields) and `jaxpar.core.strategy.make_options` (option types and choices).
This module imports no model or kernel code (see docs/design.md, "Layers").
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.core.rules import DATA_AXES
from jaxpar.core.schedule import ZERO_BUBBLE, chunks_per_stage, schedule_of
from jaxpar.core.strategy import CHOICES, Strategy

if TYPE_CHECKING:
    from jaxpar.models.config import ModelConfig


def _divides(axis_desc: str, n: int, what: str, value: int) -> None:
    if n > 1 and value % n:
        raise ConfigError(f"{axis_desc}={n} does not divide {what}={value}")


def data_parallel_size(strategy: Strategy) -> int:
    n = 1
    for a in DATA_AXES:
        n *= strategy.size(a)
    return n


def sequences_per_step(strategy: Strategy) -> int:
    """What a global batch must be a multiple of: one sequence per data-parallel rank, accumulation step
    and (with a pipeline) micro-batch. `strategy` must be resolved."""
    o = strategy.options
    return data_parallel_size(strategy) * o.grad_accum * (o.microbatches if strategy.size("pipeline") > 1 else 1)


def check(model: ModelConfig, strategy: Strategy, *, batch: int, seq: int, padded_zero: bool = False,
          program: bool = True) -> None:
    """Raise ConfigError for the first violated constraint. `strategy` must be resolved.
    `padded_zero` (estimate, plan): ZeRO-1 / FSDP over a data size that does not divide d_model is
    allowed, as padded flat shards (Megatron's distributed optimizer; jaxpar/cost/memory.py counts the
    padding); the trainer shards ZeRO state on the model dim, so a run needs the division.
    `program` False (an estimate of another stack, jaxpar/cost/software.py): the constraints of jaxpar's
    own program (its 1F1B head's sequence split, its precisions, how its overlap options are built) do not apply."""
    model.validate()
    check_options_apply(strategy)
    s, o = strategy.sizes, strategy.options
    if program:
        check_program_dtype(o.dtype, o.grad_dtype)
        check_fp8(model, strategy)
    elif o.fp8_gather or o.fp8_sp_gather:
        name = "fp8_gather" if o.fp8_gather else "fp8_sp_gather"
        raise ConfigError(f"{name} is jaxpar's own program's float8 all-gather; another stack's estimate gathers "
                          f"float8 where its preset does (jaxpar/cost/software.py): drop --{name.replace('_', '-')}")
    tp, cp, pp = s["tensor"], s["context"], s["pipeline"]

    # --- sequence and batch -----------------------------------------------------------------
    if seq < 1 or seq > model.max_seq:
        raise ConfigError(f"seq={seq} must be between 1 and the model's max_seq={model.max_seq}")
    if batch < 1:
        raise ConfigError(f"batch={batch} must be >= 1")
    dp = data_parallel_size(strategy)
    dp_desc = "x".join(f"{a}={s[a]}" for a in DATA_AXES if s[a] > 1) or "data"
    if batch % sequences_per_step(strategy):
        extra = f" x grad_accum={o.grad_accum}" if o.grad_accum > 1 else ""
        extra += f" x microbatches={o.microbatches}" if pp > 1 and o.microbatches > 1 else ""
        raise ConfigError(f"batch={batch} is not divisible by the data-parallel size {dp_desc} ({dp}){extra}")

    check_zero(model, strategy, padded_zero)

    # --- tensor parallelism -----------------------------------------------------------------
    _divides("tensor", tp, "vocab", model.vocab)
    if model.has_attention:
        _divides("tensor", tp, "heads", model.heads)
        check_kv_heads(model, tp)
    if "A" in model.layer_kinds:
        _divides("tensor", tp, "mlp_dim", model.mlp_dim)
    if model.has_moe:
        check_moe(model, strategy)
    if model.has_mamba:
        check_mamba(model, tensor=tp, context=cp, seq=seq, cp_layout=o.cp_layout)
    if o.sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel shards the sequence over `tensor`, but the mesh has tensor=1")
    if o.sequence_parallel:
        _divides("context x tensor", cp * tp, "seq", seq)
    if o.overlap != "none" and program:
        check_overlap(model, strategy, seq)
    if o.fsdp_prefetch and program:
        check_fsdp_prefetch(strategy)
    check_remat(model, strategy)

    # --- context parallelism ------------------------------------------------------------------
    if model.has_attention and (cp > 1 or o.attention != "dense"):
        check_context_parallel(seq, cp, o.cp_layout, o.attention, model.heads, model.kv_heads, tp)
    elif cp > 1:
        _divides("context", cp, "seq", seq)
    if model.has_attention:
        check_attention_kernel(strategy)

    # --- pipeline -----------------------------------------------------------------------------
    if program and pp > 1 and o.pp_schedule in ZERO_BUBBLE:
        raise ConfigError(f"pp_schedule={o.pp_schedule} is priced for the stacks that run it (jaxpar estimate or plan "
                          "--software torchtitan; jaxpar schedule draws it); jaxpar's program runs gpipe, circular "
                          "and 1f1b")
    check_pipeline(model, strategy)
    pp, sp = strategy.size("pipeline"), o.sequence_parallel
    piece = seq // (cp * (tp if sp else 1))   # jaxpar/pipeline/one_f_one_b.py spreads it over the stages for the head
    if program and pp > 1 and o.pp_schedule == "1f1b" and piece % pp:
        raise ConfigError(f"pp_schedule=1f1b spreads each device's sequence piece over the stages for the head: seq={seq} "
                          f"/ ({'context x tensor' if sp else 'context'} = {cp * (tp if sp else 1)}) = {piece} tokens "
                          f"must be divisible by pipeline={pp}")


def check_program_dtype(dtype: str, grad_dtype: str = "float32") -> None:
    """jaxpar's program computes in float32, bfloat16 or float8 (scaled projections, jaxpar/ops/fp8.py) and
    keeps float32 gradients; bfloat16 gradients are other stacks' precision, for their estimates."""
    if grad_dtype != "float32":
        raise ConfigError(f"grad_dtype={grad_dtype} prices other stacks' gradient reductions (estimate/plan "
                          "--software megatron-core, ...); jaxpar's program accumulates float32 gradients")


def check_fp8(model: ModelConfig, strategy: Strategy) -> None:
    """dtype=float8 scales the projections' GEMMs (jaxpar/ops/fp8.py); the collective-matmul rings compute
    pieces of a GEMM whose scales need the whole operand, so they are not combined with it. Blockwise
    1x128 tiles of an expert's hidden row split over tensor: whole tiles on each shard, or one tile per row."""
    o = strategy.options
    if o.dtype != "float8":
        for name, on in (("fp8_recipe", o.fp8_recipe != "tensorwise"), ("fp8_gather", o.fp8_gather),
                         ("fp8_sp_gather", o.fp8_sp_gather)):
            if on:
                raise ConfigError(f"{name}={getattr(o, name)} has no effect: it applies to float8 GEMMs, but "
                                  f"dtype={o.dtype} (add --dtype float8, or drop it)")
        return
    if o.fp8_gather:
        check_fp8_gather(model, strategy)
    if o.fp8_sp_gather:
        check_fp8_sp_gather(model, strategy)
    if o.overlap != "none":
        raise ConfigError(f"dtype=float8 scales each projection over its whole operands; overlap={o.overlap} "
                          "splits them into ring pieces: use --overlap none with float8")
    width, tp = model.moe_mlp_dim, strategy.size("tensor")
    if o.fp8_recipe == "blockwise" and model.has_moe and tp > 1 and width > 128 and (width // tp) % 128:
        raise ConfigError(f"fp8_recipe=blockwise scales expert rows in 1x128 tiles: the expert width {width} / "
                          f"tensor={tp} = {width // tp} per shard must be a multiple of 128 (or the width at most 128)")


def check_fp8_gather(model: ModelConfig, strategy: Strategy) -> None:
    """fp8_gather all-gathers the float8 attention (q, k, v, o) and MLP weights of Transformer blocks over
    fsdp (jaxpar/ops/fp8.py `Layouts`): it needs ZeRO-3 over an fsdp axis, and a model of such blocks only
    (latent attention, experts and Mamba-2 weights are not gathered in float8)."""
    fsdp = strategy.size("fsdp")
    if strategy.zero != 3 or fsdp == 1:
        raise ConfigError(f"fp8_gather gathers FSDP-sharded weights in float8, but zero={strategy.zero} with "
                          f"fsdp={fsdp} gathers none: use an fsdp axis > 1 with zero=3, or drop --fp8-gather")
    if strategy.options.remat not in ("none", "full"):
        raise ConfigError(f"fp8_gather with remat={strategy.options.remat}: a policy that recomputes part of a unit "
                          "gathers float8 weights again where the cost model does not count them yet: use --remat "
                          "none or full with --fp8-gather")
    check_fp8_gather_scope(model, strategy, "fp8_gather")


def check_fp8_sp_gather(model: ModelConfig, strategy: Strategy) -> None:
    """fp8_sp_gather all-gathers the column-parallel projections' input over tensor in float8 (jaxpar/ops/fp8.py
    `gathered_input`): it needs sequence parallelism over tensor > 1, the tensorwise recipe (whose one scale
    serves the forward and the weight gradient, so the gathered copy serves both), no pipeline, and a model
    of attention + MLP blocks (GQA) only."""
    o, tp = strategy.options, strategy.size("tensor")
    if not o.sequence_parallel or tp == 1:
        raise ConfigError(f"fp8_sp_gather gathers the sequence-parallel input over tensor, but tensor={tp} with "
                          f"sequence_parallel={o.sequence_parallel}: use --sequence-parallel with tensor > 1")
    if o.fp8_recipe != "tensorwise":
        raise ConfigError(f"fp8_sp_gather reads one gathered float8 input in the forward and the weight gradient, "
                          f"which needs one scale per tensor; fp8_recipe={o.fp8_recipe} scales them apart: use "
                          "--fp8-recipe tensorwise")
    check_fp8_gather_scope(model, strategy, "fp8_sp_gather")


def check_fp8_gather_scope(model: ModelConfig, strategy: Strategy, name: str) -> None:
    """The float8 gathers (`name`) are built for attention + MLP blocks (A, GQA) outside a pipeline, whose
    stages gather their float32 weights before their loop, not per projection."""
    flag = "--" + name.replace("_", "-")
    if strategy.size("pipeline") > 1:
        raise ConfigError(f"{name} with pipeline={strategy.size('pipeline')}: a pipeline gathers each stage's "
                          f"float32 weights before its loop, not per projection: drop {flag}")
    other = "latent attention" if model.mla else ", ".join(sorted(set(model.layer_kinds) - {"A"}))
    if other:
        raise ConfigError(f"{name} gathers in float8 for attention + MLP blocks (A) only; the model has {other} "
                          f"blocks, whose weights are not gathered in float8: drop {flag}")


def check_kv_heads(model: ModelConfig, tensor: int) -> None:
    """K/V heads over `tensor`: sharded when tensor divides kv_heads; replicated across tensor ranks
    (Megatron's rule, jaxpar.core.sharding.model_layout) when tensor is a multiple of kv_heads, so each rank
    computes every K/V head and its query heads read theirs."""
    if tensor > model.kv_heads and tensor % model.kv_heads:
        raise ConfigError(f"tensor={tensor} > kv_heads={model.kv_heads} replicates K/V heads across tensor ranks, "
                          "which needs tensor to be a multiple of kv_heads")
    if tensor <= model.kv_heads:
        _divides("tensor", tensor, "kv_heads", model.kv_heads)


# ---- options that the layout ignores -------------------------------------------------------------

def check_options_apply(strategy: Strategy, layouts: tuple[Strategy, ...] = ()) -> None:
    """Refuse an option set away from its default that changes nothing on this mesh: the pipeline's
    options without a pipeline axis, context parallelism's without a context axis (an option at its
    default is never refused, whoever set it). `layouts`: generate's phase layouts, of which any one
    may use an option (a prefill's context axis uses `attention`)."""
    o, layouts = strategy.options, layouts or (strategy,)
    if max(st.size("pipeline") for st in layouts) == 1:
        if o.microbatches > 1:
            raise ConfigError(f"microbatches={o.microbatches} needs a pipeline axis > 1 (use grad_accum "
                              "for gradient accumulation without a pipeline)")
        if o.pp_stages != "":
            raise ConfigError(f"option pp_stages={o.pp_stages!r} splits layers over pipeline stages, but the mesh "
                              "has pipeline=1")
        for name, default in (("pp_schedule", "gpipe"), ("pp_repeats", 1)):
            if getattr(o, name) != default:
                raise ConfigError(f"{name}={getattr(o, name)} has no effect: it schedules a pipeline, but the mesh "
                                  f"has pipeline=1 (drop it, or add a pipeline axis)")
    if max(st.size("context") for st in layouts) == 1:
        for name, default, what in (("attention", "dense", "how attention splits the sequence over context"),
                                    ("cp_layout", "contiguous", "the token layout over context")):
            if getattr(o, name) != default:
                raise ConfigError(f"{name}={getattr(o, name)} has no effect: it sets {what}, but the mesh has "
                                  f"context=1 (drop it, or add a context axis)")


# ---- collective matmul ---------------------------------------------------------------------------

def check_overlap(model: ModelConfig, strategy: Strategy, seq: int) -> None:
    """overlap=collective_matmul[_bidir] (jaxpar/ops/collective_matmul.py). It decomposes the all-gather
    of the residual stream before a column-parallel projection and the reduce-scatter after a
    row-parallel one: those exist under tensor parallelism with sequence parallelism only (without SP
    the projection's input is replicated and its output all-reduced: nothing to gather)."""
    o, tp, cp = strategy.options, strategy.size("tensor"), strategy.size("context")
    if tp == 1:
        raise ConfigError(f"overlap={o.overlap} decomposes tensor parallelism's collectives, but the mesh has tensor=1")
    if not o.sequence_parallel:
        raise ConfigError(f"overlap={o.overlap} needs sequence_parallel=true (tensor={tp}): without sequence "
                          "parallelism there is no all-gather before the column-parallel projections nor "
                          "reduce-scatter after the row-parallel ones to decompose")
    if not model.has_attention:
        raise ConfigError(f"overlap={o.overlap} applies to the attention and MLP projections, and model "
                          f"{model.name} (pattern={model.pattern!r}) has no attention blocks")
    if strategy.size("pipeline") > 1:
        raise ConfigError(f"overlap={o.overlap} with pipeline={strategy.size('pipeline')} is not supported yet: "
                          "the collective-matmul shard_map has not been made to run inside the pipeline's "
                          "vmap over stages")
    chunk = seq // (cp * tp)
    if o.overlap == "collective_matmul_bidir" and chunk % 2:
        raise ConfigError(f"overlap=collective_matmul_bidir sends half of each device's sequence chunk each way "
                          f"round the ring, so the chunk must be even: seq={seq} / (context x tensor = {cp * tp}) "
                          f"= {chunk} tokens")


# ---- context parallelism -------------------------------------------------------------------------

def check_fsdp_prefetch(strategy: Strategy) -> None:
    """fsdp_prefetch (jaxpar/ops/fsdp_prefetch.py) gathers sharded weights one layer ahead inside the layer
    scan, and recomputes each layer in its hand-written backward pass."""
    o = strategy.options
    if strategy.zero != 3:
        raise ConfigError(f"fsdp_prefetch gathers FSDP-sharded weights ahead of use, but zero={strategy.zero} keeps "
                          "them whole: it needs fsdp > 1 (zero=3)")
    if o.remat != "full":
        raise ConfigError(f"fsdp_prefetch saves each layer's input and recomputes the layer in the backward pass "
                          f"(remat=full), so remat={o.remat} cannot be honoured: set remat=full")
    if strategy.size("pipeline") > 1:
        raise ConfigError(f"fsdp_prefetch with pipeline={strategy.size('pipeline')}: the pipeline gathers its "
                          "stage weights once per step already (jaxpar/pipeline/gpipe.py)")


def check_remat(model: ModelConfig, strategy: Strategy) -> None:
    """remat=selective recomputes the attention core (models/transformer.py), which a model without attention
    blocks does not have; remat=offload names each layer unit's input inside the layer scan for host memory
    (jaxpar/ops/layer_scan.py OFFLOADED), while a pipeline schedule saves its stage inputs itself, on the device."""
    remat, pp = strategy.options.remat, strategy.size("pipeline")
    if remat == "selective" and not model.has_attention:
        raise ConfigError(f"remat=selective recomputes the attention core, but {model.name} (pattern={model.pattern!r}) "
                          "has no attention block: use remat=none or full")
    if remat == "offload" and pp > 1:
        raise ConfigError(f"remat=offload keeps the layer scan's unit inputs in host memory, but pipeline={pp} "
                          "saves its stage inputs on the device (jaxpar/pipeline/): use remat=full or selective")


def check_token_layout(seq_len: int, context: int, layout: str) -> None:
    """A token layout along a sequence split over `context` shards (jaxpar.ops.attention)."""
    if layout not in CHOICES["cp_layout"]:
        raise ConfigError(f"cp_layout={layout!r} is not one of {' | '.join(CHOICES['cp_layout'])}")
    if context < 1:
        raise ConfigError(f"context={context} must be >= 1")
    if layout == "zigzag" and seq_len % (2 * context):
        raise ConfigError(f"cp_layout=zigzag needs seq divisible by 2 x context: "
                          f"seq={seq_len}, context={context} (2 x context = {2 * context})")
    if layout == "contiguous" and seq_len % context:
        raise ConfigError(f"context={context} does not divide seq={seq_len} (cp_layout=contiguous)")


def check_context_parallel(seq_len: int, context: int, layout: str, attention: str,
                           heads: int, kv_heads: int, tensor: int) -> None:
    """Attention over a sequence sharded on `context` (jaxpar.ops.attention)."""
    if attention not in CHOICES["attention"]:
        raise ConfigError(f"attention={attention!r} is not one of {' | '.join(CHOICES['attention'])}")
    if attention == "dense" and context > 1:
        raise ConfigError(f"attention=dense cannot shard the sequence: context={context}; "
                          "use --attention ring or allgather")
    check_token_layout(seq_len, context, layout)
    if heads % kv_heads:
        raise ConfigError(f"kv_heads={kv_heads} does not divide heads={heads} (GQA groups)")
    if heads % tensor:
        raise ConfigError(f"tensor={tensor} does not divide heads={heads}")
    if kv_heads % tensor:
        raise ConfigError(f"tensor={tensor} does not divide kv_heads={kv_heads}")


def check_attention_kernel(strategy: Strategy) -> None:
    """The option `attention_kernel` against the strategy (jaxpar.ops.attention). cuDNN's flash kernel takes
    16-bit inputs only; its causal mask and splash's (jaxpar/ops/splash_attention.py) compare indices, which
    are not the tokens' positions once context parallelism splits (and may reorder) the sequence."""
    o, cp = strategy.options, strategy.size("context")
    if o.attention_kernel not in ("cudnn", "splash"):
        return
    if o.attention_kernel == "cudnn" and o.program_dtype != "bfloat16":   # float8: attention in bf16
        raise ConfigError(f"attention_kernel=cudnn needs dtype=bfloat16 (cuDNN's flash kernel takes 16-bit inputs), "
                          f"got dtype={o.dtype}; use --attention-kernel blockwise or auto")
    if cp > 1:
        who = "cuDNN masks" if o.attention_kernel == "cudnn" else "splash attention's masks work"
        raise ConfigError(f"attention_kernel={o.attention_kernel} with context={cp} is not supported: {who} by index, "
                          "and context parallelism needs masks by position; use --attention-kernel blockwise")


def check_backend(strategy: Strategy, platform: str) -> None:
    """What the run's devices must be (`platform`: a JAX device's platform, cpu | gpu | tpu): cuDNN's kernel
    runs on NVIDIA GPUs only; splash is a Mosaic TPU kernel, run in Pallas interpret mode on other backends,
    which is the CPU test path but on a GPU would be a sequential loop of tiny ops (refused). Separate from
    `check`, which the planner also runs for hardware it is not on."""
    kernel = strategy.options.attention_kernel
    if kernel == "cudnn" and platform != "gpu":
        raise ConfigError(f"attention_kernel=cudnn needs an NVIDIA GPU, but the devices are {platform}; "
                          "use --attention-kernel blockwise (or auto, which picks it there)")
    if kernel == "splash" and platform == "gpu":
        raise ConfigError("attention_kernel=splash is a TPU (Mosaic) kernel: on a GPU it would run in Pallas "
                          "interpret mode, a sequential loop of tiny ops; use --attention-kernel cudnn or auto")


# ---- Mamba-2 ---------------------------------------------------------------------------------------

def check_mamba(cfg: ModelConfig, tensor: int, context: int, seq: int, cp_layout: str = "contiguous") -> None:
    """Constraints between a Mamba-2 model and a strategy (jaxpar/models/mamba.py, jaxpar/ops/mamba_cp.py).

    Heads and groups are sharded together over `tensor`; under context parallelism each shard
    holds 1 (contiguous) or 2 (zigzag) pieces of the sequence, and a piece must be at least as
    long as the conv halo (d_conv - 1 tokens), which comes from one neighbouring piece.
    """
    if tensor > 1 and cfg.ssm_heads % tensor:
        raise ConfigError(f"tensor={tensor} does not divide ssm heads={cfg.ssm_heads} "
                          f"(expand*d_model/ssm_head_dim = {cfg.d_inner}/{cfg.ssm_head_dim})")
    if tensor > 1 and cfg.ngroups % tensor:
        raise ConfigError(f"tensor={tensor} does not divide ngroups={cfg.ngroups} "
                          "(B/C groups are sharded with their heads)")
    if context > 1:
        pieces = context * (2 if cp_layout == "zigzag" else 1)
        desc = f"context={context}" if pieces == context else f"2 x context={pieces} (zigzag)"
        if seq % pieces:
            raise ConfigError(f"{desc} does not divide seq={seq}")
        if seq // pieces < cfg.d_conv - 1:
            raise ConfigError(f"seq={seq} split into {pieces} pieces ({desc}) gives {seq // pieces} tokens "
                              f"per piece, fewer than the conv halo d_conv-1 = {cfg.d_conv - 1}")


# ---- mixture of experts ----------------------------------------------------------------------------

def check_moe(model: ModelConfig, strategy: Strategy) -> None:
    """A model with MoE blocks on a strategy (jaxpar/ops/moe.py, models/moe.py). The `expert` axis is
    also a batch axis, so the batch's divisibility is checked with the others in `check`."""
    tp = strategy.size("tensor")
    if model.top_k > model.experts:
        raise ConfigError(f"top_k={model.top_k} must be <= experts={model.experts}")
    check_expert_parallel(model.experts, strategy.size("expert"))
    # (the shared experts' width, shared_experts x expert_mlp_dim, is then divisible too)
    _divides("tensor", tp, "expert_mlp_dim" if model.expert_mlp_dim else "expert_mlp_dim (= mlp_dim)",
             model.moe_mlp_dim)
    if model.capacity_factor > 0 and strategy.size("context") > 1 and strategy.options.cp_layout == "zigzag":
        raise ConfigError(f"capacity_factor={model.capacity_factor} with cp_layout=zigzag: capacity drops tokens in "
                          "sequence order, and the zigzag layout permutes the sequence, so other tokens would be "
                          "dropped than on one device; use cp_layout=contiguous or a dropless model "
                          "(capacity_factor=0)")


def check_zero(model: ModelConfig, strategy: Strategy, padded_zero: bool) -> None:
    """Parameter sharding (ZeRO, jaxpar.core.rules): stage 3 over fsdp or the expert group, stage 1 over the
    data axes; `padded_zero` as in `check`."""
    s, zero = strategy.sizes, strategy.zero
    if zero == 3 and s["fsdp"] == 1 and s["expert"] == 1:
        raise ConfigError("zero=3 shards parameters over the fsdp axis, but the mesh has fsdp=1 (and expert=1: "
                          "without fsdp, ZeRO-3 shards over the expert group)")
    if zero in (0, 1) and s["fsdp"] > 1:
        raise ConfigError(f"zero={zero} keeps parameters replicated, but the mesh has fsdp={s['fsdp']} "
                          "(fsdp shards parameters: use zero=3, or put those devices on `data`)")
    if zero == 3 and s["fsdp"] == 1:
        check_expert_zero3(model, strategy, padded_zero)
    elif zero == 3 and not padded_zero:
        _divides("fsdp", s["fsdp"], "d_model", model.d_model)
    if zero == 1 and not padded_zero:
        _divides("data x fsdp", s["data"] * s["fsdp"], "d_model", model.d_model)


def check_expert_zero3(model: ModelConfig, strategy: Strategy, padded_zero: bool) -> None:
    """ZeRO-3 over the expert group (jaxpar.core.rules.zero3_axes: `embed` on data x expert, no fsdp axis):
    the model dim divides over those devices; fsdp_prefetch, which gathers over `fsdp` alone, is refused."""
    axes = "data x expert"
    size = strategy.size("data") * strategy.size("expert")
    if not padded_zero:
        _divides(axes, size, "d_model", model.d_model)
    if strategy.options.fsdp_prefetch:
        raise ConfigError(f"fsdp_prefetch with zero=3 over the expert group ({axes} = {size}, fsdp=1): the "
                          "prefetch gathers over fsdp only; put the ZeRO-3 devices on an fsdp axis")


def check_expert_parallel(experts: int, expert_axis: int) -> None:
    """Experts split evenly over the `expert` mesh axis (jaxpar.ops.moe)."""
    if expert_axis > 1 and experts % expert_axis:
        raise ConfigError(f"expert={expert_axis} does not divide experts={experts}")


# ---- pipeline ------------------------------------------------------------------------------------

def check_pipeline(model: ModelConfig, strategy: Strategy) -> None:
    """Raise ConfigError for a pipeline configuration that cannot run (`strategy` resolved; the batch in
    `check`). Any unit count on any stage count (jaxpar/core/schedule.py) if every chunk gets a unit; `pp_stages`
    lists one positive count per chunk summing to the units. Circular needs M >= S (a micro-batch takes S
    iterations to come back to stage 0 for its next repeat); interleaved 1F1B (pp_repeats > 1) takes the
    micro-batches in groups of S. Context parallelism runs inside the stages (attention and Mamba-2)."""
    o = strategy.options
    pp = strategy.size("pipeline")
    if pp == 1:
        check_options_apply(strategy)  # the pipeline's options, set without a pipeline
        return
    if o.pp_repeats > 1 and o.pp_schedule not in ("circular", "1f1b"):
        raise ConfigError(f"pp_repeats={o.pp_repeats} needs pp_schedule=circular or 1f1b ({o.pp_schedule} runs "
                          f"{chunks_per_stage(o.pp_schedule, 1)} chunk(s) per stage)")
    if o.pp_schedule == "dualpipe-v" and o.microbatches < 2 * pp:
        raise ConfigError(f"pp_schedule=dualpipe-v needs microbatches >= 2 x pipeline (DualPipe's dualpipev.py): "
                          f"microbatches={o.microbatches}, pipeline={pp}")
    if o.pp_repeats > 1 and o.pp_schedule == "1f1b" and o.microbatches % pp:
        raise ConfigError(f"interleaved 1F1B (pp_repeats={o.pp_repeats}) takes micro-batches in groups of pipeline={pp}: "
                          f"microbatches={o.microbatches} must be a multiple of {pp}")
    units = model.units
    repeats = chunks_per_stage(o.pp_schedule, o.pp_repeats)
    if units < pp * repeats:
        raise ConfigError(f"pipeline={pp} x repeats={repeats} = {pp * repeats} stage chunks need at least "
                          f"{pp * repeats} stacked layer units, the model has {units} (layers={model.layers}, "
                          f"pattern={model.pattern!r})")
    sched = schedule_of(strategy, model.run_units)  # parses pp_stages: ConfigError naming it
    if sched.kind == "circular" and sched.repeats > 1 and o.microbatches < pp:
        raise ConfigError(f"the circular schedule needs microbatches >= pipeline: microbatches={o.microbatches} "
                          f"< pipeline={pp} (a micro-batch must leave the last stage before stage 0 "
                          "needs it for the next repeat)")


# ---- hosts ---------------------------------------------------------------------------------------

def check_hosts(strategy: Strategy, hosts, axes: tuple[str, ...]) -> None:
    """Tensor-parallel groups stay inside one host unless `[mesh.dcn] tensor` asks otherwise.

    Tensor parallelism all-reduces activations several times per layer: across hosts far slower than
    inside one. `hosts` holds each mesh position's host."""
    tp = strategy.size("tensor")
    if tp == 1 or dict(strategy.dcn).get("tensor", 1) > 1:
        return
    groups = np.moveaxis(np.asarray(hosts), axes.index("tensor"), -1).reshape(-1, tp)
    crossing = groups[np.any(groups != groups[:, :1], axis=1)]
    if len(crossing):
        per_host = groups.size // len(np.unique(groups))
        raise ConfigError(f"tensor={tp} groups span hosts {sorted(set(crossing[0].tolist()))} (each host "
                          f"has {per_host} devices): keep tensor <= {per_host}, or ask for cross-host "
                          f"tensor parallelism with [mesh.dcn] tensor = {math.ceil(tp / per_host)}")


# ---- generation ----------------------------------------------------------------------------------

def check_generate(model: ModelConfig, strategy: Strategy, prompts: list[list[int]], max_new_tokens: int) -> None:
    """`max_new_tokens` after each prompt (token ids): the tokens, `check_phases`, `check_generation`."""
    if not prompts:
        raise ConfigError("generate needs at least one prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i} is empty: a prompt needs at least one token id")
        bad = [t for t in prompt if not 0 <= t < model.vocab]
        if bad:
            raise ConfigError(f"prompt {i} has token id {bad[0]} outside the model's vocabulary [0, {model.vocab})")
    check_phases(strategy)
    for phase in ("prefill", "decode"):
        layout = strategy.phase(phase)
        try:
            check_generation(model, layout, len(prompts), max(len(p) for p in prompts), max_new_tokens, phase)
        except ConfigError as e:
            if not strategy.phases:
                raise
            raise ConfigError(f"the {phase} layout {layout.describe()}: {e}") from None


def check_phases(strategy: Strategy) -> None:
    """A strategy's [prefill] and [decode] layouts (jaxpar.core.strategy.load_toml) run on the same devices
    (generate reshards weights and cache between them): equal device counts (a -1 axis always fits); and
    no option that neither layout uses (`check_options_apply`)."""
    layouts = tuple(strategy.phase(p) for p in ("prefill", "decode"))
    for layout in layouts:
        check_options_apply(layout, layouts)
    counts = {p: strategy.phase(p).num_devices for p in ("prefill", "decode")}
    if min(counts.values()) > 0 and counts["prefill"] != counts["decode"]:
        raise ConfigError(f"mesh {strategy.name}: the prefill layout {strategy.phase('prefill').describe()} has "
                          f"{counts['prefill']} devices and the decode layout {strategy.phase('decode').describe()} "
                          f"{counts['decode']}: generate reshards between them on the same devices, so both "
                          "meshes need the same device count")


def check_generation(model: ModelConfig, strategy: Strategy, batch: int, longest: int, max_new_tokens: int,
                     phase: str = "decode") -> None:
    """A generation run's sizes and one phase's layout (also what `estimate --phase prefill|decode`
    costs). Prompts are left-padded to the longest, so the longest prompt plus the new tokens must fit
    the model's max_seq. K/V heads as in training (`check_kv_heads`). A prefill may split the prompt
    over `context` (padded to a multiple of the pieces); a decode step repeats on every context rank."""
    model.validate()
    s, o = strategy.sizes, strategy.options
    tp, cp = s["tensor"], s["context"]
    if o.dtype == "float8":
        raise ConfigError("dtype=float8 is a training recipe (scaled GEMMs with their backward, jaxpar/ops/fp8.py); "
                          "generation computes in float32 or bfloat16")
    if model.has_moe:
        if model.capacity_factor > 0:
            raise ConfigError(f"generate: capacity_factor={model.capacity_factor} drops tokens by their order within "
                              "a sequence, so a one-token decode step would route differently from the full "
                              f"forward (model {model.name}); generate needs dropless routing (capacity_factor=0)")
        check_moe(model, strategy)
        if cp > 1 and phase == "decode":
            raise ConfigError(f"generate: a decode step on context={cp} with mixture-of-experts layers is not "
                              "supported: the expert kernel splits each sequence over context, and a decode step "
                              "has one token per sequence; give the mesh file a [decode] layout without context")
    if s["pipeline"] > 1:
        raise ConfigError(f"generate: pipeline={s['pipeline']}: pipelined decoding is not implemented yet; use the "
                          "data, fsdp, context (prefill) and tensor axes")
    if o.sequence_parallel:
        raise ConfigError("generate: sequence_parallel shards the sequence over tensor, but a decode step has one "
                          "token per sequence; drop --sequence-parallel")
    if cp > 1 and phase == "prefill" and model.has_attention:
        if o.attention == "dense":
            raise ConfigError(f"generate: a context-parallel prefill (context={cp}) needs a context-parallel "
                              "attention kernel: attention=dense cannot shard the sequence; use --attention ring "
                              "or allgather")
        if tp > model.kv_heads:
            raise ConfigError(f"generate: a context-parallel prefill (context={cp}) with tensor={tp} > "
                              f"kv_heads={model.kv_heads} is not supported: the ring and all-gather kernels shard "
                              "K/V heads like the query heads; keep tensor <= kv_heads in the prefill layout")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if longest + max_new_tokens > model.max_seq:
        raise ConfigError(f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} = "
                          f"{longest + max_new_tokens} exceeds the model's max_seq={model.max_seq}")
    dp = data_parallel_size(strategy)
    if batch % dp:
        desc = "x".join(f"{a}={s[a]}" for a in DATA_AXES if s[a] > 1)
        raise ConfigError(f"batch={batch} prompts is not divisible by the data-parallel size {desc} ({dp}): "
                          "each data-parallel rank decodes the same number of sequences")

    # --- parameters and heads ---------------------------------------------------------------------
    if strategy.zero == 3 and s["fsdp"] == 1:
        raise ConfigError("zero=3 shards parameters over the fsdp axis, but the mesh has fsdp=1")
    if strategy.zero == 3:
        _divides("fsdp", s["fsdp"], "d_model", model.d_model)
    if s["fsdp"] > 1 and strategy.zero != 3:
        raise ConfigError(f"zero={strategy.zero} keeps parameters replicated, but the mesh has fsdp={s['fsdp']}")
    _divides("tensor", tp, "vocab", model.vocab)
    if model.has_attention:
        _divides("tensor", tp, "heads", model.heads)
        _divides("tensor", tp, "mlp_dim", model.mlp_dim)
        check_kv_heads(model, tp)
    if model.has_mamba:
        check_mamba(model, tensor=tp, context=1, seq=1)
