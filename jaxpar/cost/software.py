"""What the software stack does that neither the model config nor the mesh says.

The same mesh costs differently under different implementations; `Software`'s fields name the differences
that matter to the cost model, each with its meaning and source (`trait`; `describe` prints them), with a
preset for jaxpar itself and one for each stack whose published runs calibrate the model. A preset is data:
a new stack is one more `Software(...)` in `SOFTWARE`. `jaxpar_program` is the one question "is this
jaxpar's own program?" of the cost model: its program's adjustments to the textbook apply (its activation
inventory, its pipelines' weight copies and head, its overlap options); otherwise the stack is costed by
its traits. What each stack runs (`axes`, `zeros`, `remats`, `pp_schedules`) is what `plan --software`
searches and `refusal` checks. docs/cost-model.md has the stories behind the traits.
"""
from __future__ import annotations

import dataclasses
import functools

from jaxpar.core.strategy import AXES, Strategy, resolve_kernel
from jaxpar.cost.params import per_model
from jaxpar.errors import ConfigError


def trait(default, help: str):
    """A `Software` field with its one-line meaning and source."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True, slots=True)
class Software:
    name: str = trait("jaxpar", "the stack's name (`--software`)")
    platforms: tuple[str, ...] = trait(("gpu", "tpu"), "the hardware platforms the stack runs on: its preset "
                                       "prices no other (a stack's traits on hardware it never ran on are "
                                       "nobody's program, and no published run calibrates them)")
    jaxpar_program: bool = trait(True, "the step is jaxpar's own JAX program as XLA compiles it: its program's "
                                       "adjustments apply (inventory_jax, program_memory, program_comm, program_pipeline, overlap)")
    dropout: bool = trait(False, "dropout masks and dropped copies join the activation inventory (Megatron GPT: "
                                 "Korthikanti et al. 2022)")
    causal: bool = trait(False, "count only the lower triangle of the scores (a causal kernel that skips masked "
                                "blocks); False counts the full s x s, as dense masked attention computes")
    pp_scatter_gather: bool = trait(False, "a stage sends 1/t of its boundary activation and the receiver "
                                           "all-gathers it over tensor (Narayanan et al. 2021, sec. 4.1)")
    pp_1f1b: bool = trait(False, "the pipeline runs 1F1B, a stage holding S micro-batches' activations, not M "
                                 "(Megatron; Narayanan et al. 2021)")
    rerun_outputs: bool = trait(False, "full recompute reruns a layer's last projection too (PyTorch's checkpoint: "
                                       "Megatron); XLA drops it, nothing reads its output (flops.py)")
    moe_padded: bool = trait(True, "MoE dispatch into static per-expert buffers of the group capacity (jaxpar.ops.moe);"
                                   " False: only the routed copies (Megatron's grouped GEMM and token dispatcher)")
    param_gather_bytes: int = trait(4, "bytes per element of a parameter all-gather: jaxpar gathers its float32 "
                                       "masters; Megatron's distributed optimizer and FSDP2 the bf16 weights (2)")
    serve_weight_bytes: int = trait(4, "bytes per parameter a generation step reads: bf16 serving stores 2; "
                                       "jaxpar's generate its strategy's dtype (inference.weight_bytes)")
    pp_head_spread: bool = trait(True, "the head and loss of a pipeline run on every stage, ceil(M/S) micro-batches "
                                       "each (jaxpar/pipeline/gpipe.py); False: the last stage, all M (Megatron)")
    pp_end_stages: bool = trait(False, "the embedding on the first stage and the head on the last (Megatron-LM's "
                                       "pre_process / post_process; torchtitan's split; memory.embedding_copies)")
    fused_attention: bool = trait(False, "a fused (flash) attention kernel: no scores in HBM, QK^T recomputed "
                                         "backward (Dao et al. 2022; Dao 2023); jaxpar's follows its attention_kernel")
    fused_mlp: bool = trait(False, "the SwiGLU one fused kernel keeping only its input (Megatron-Core's "
                                   "--bias-swiglu-fusion, torch.compile, XLA's fusions; memory.fused_swiglu)")
    autodiff_remat: bool = trait(False, "remat by autodiff (jax.checkpoint: MaxText), which saves only what the "
                                        "backward reads (memory.residuals_only); False: PyTorch's checkpointing")
    sac_every_other_mm: bool = trait(False, "under remat dots the stack saves every other matmul output (torchtitan's "
                                            "op-level SAC, parallelize_llama `_custom_policy`)")
    loss_logit_bytes: int = trait(4, "bytes per logit alive at the loss's peak: Megatron's fused vocab-parallel "
                                     "cross entropy 4; torchtitan's uncompiled F.cross_entropy 12")
    pp_fsdp_gathered: bool = trait(False, "under a pipeline FSDP keeps each stage's weights gathered and gradients "
                                          "unsharded for the step (torchtitan: reshard_after_forward off under PP)")
    tp_overlap: float = trait(0.0, "the share of tensor all-gathers and reduce-scatters decomposed into their GEMMs "
                                   "(Megatron-Core --tp-comm-overlap; Wang et al. 2023), inside a node only")
    dp_overlap: float = trait(0.0, "the share of gradient reductions issued bucket by bucket under the backward, and "
                                   "parameter gathers with the next forward (--overlap-grad-reduce; Li et al. 2020)")
    pp_overlap: float = trait(0.0, "the share of stage-to-stage sends issued beside the next micro-batch's compute "
                                   "(Megatron-Core --overlap-p2p-comm)")
    ep_overlap: float = trait(0.0, "the share of expert all-to-alls hidden under another micro-batch's compute "
                                   "(DeepSeek-V3's DualPipe, arXiv 2412.19437 sec. 3.2.1); 0 in every preset")
    flat_params: bool = trait(False, "FSDP gathers and reduce-scatters each block as one flat buffer (FSDP2 per "
                                     "fully_shard group, FSDP1's FlatParameter, Megatron-FSDP's units)")
    grad_buckets: bool = trait(False, "the step's one-off reductions and gathers in buckets of max(40M, 1M x ranks) "
                                      "parameters (Megatron-Core's DDP under --overlap-grad-reduce)")
    fp8_gathers: bool = trait(False, "under dtype=float8 FSDP gathers float8 weights (torchtitan's "
                                     "enable_fsdp_float8_all_gather, torchao's float8 README)")
    async_tp: bool = trait(False, "tensor parallelism as collective matmuls under --overlap collective_matmul "
                                  "(torchtitan's async TP, MaxText's and XLA's collective matmul)")
    distributed_optimizer: bool = trait(False, "the recipes shard the optimizer state over data (Megatron "
                                               "--use-distributed-optimizer): estimate defaults to zero=1")
    sequence_parallel: bool = trait(False, "tensor parallelism always shards the norms' sequence (Megatron-Core's "
                                           "recipes, torchtitan's TP plan): estimate defaults to it where tensor > 1")
    attention_kernel: str = trait("", "flash2: FlashAttention-2 at the profile's flash2_efficiency (PyTorch SDPA, "
                                      "flash-attn 2); \"\": a kernel tuned for the hardware, at the matmul efficiency")
    weight_bytes: int = trait(4, "bytes per parameter of the weights kept between steps: jaxpar's float32 masters; "
                                 "Megatron's bf16 weights (2; Float16OptimizerWithFloat16Params)")
    optimizer_bytes: int = trait(8, "bytes per parameter of the optimizer state: AdamW's two float32 moments, plus "
                                    "the float32 master copy where the weights are bf16 (12)")
    state_over_context: bool = trait(False, "the ZeRO-sharded state split over the context ranks too (Megatron's "
                                            "distributed optimizer over data x context, torchtitan, MaxText)")
    fsdp_over_context: bool = trait(False, "FSDP spans the context ranks even at fsdp=1 (torchtitan's fully_shard over "
                                           "dp_shard x cp; MaxText's `embed` rule on context)")
    axes: tuple[str, ...] = trait(AXES, "the mesh axes the stack parallelises over (llm-foundry: data and fsdp)")
    fsdp_pipeline: bool = trait(True, "its FSDP shards weights inside pipeline stages (torchtitan, MaxText, jaxpar); "
                                      "Megatron-FSDP does not compose with PP (Megatron-LM custom_fsdp.md)")
    remats: tuple[str, ...] = trait(("none", "dots_no_batch", "full"),
                                    "its recompute policies (Megatron's --recompute-granularity, torchtitan's "
                                    "activation_checkpoint, MaxText's remat_policy)")
    zeros: tuple[int, ...] = trait((0, 1, 3), "its ZeRO stages (torchtitan 0 and 3: DDP, FSDP2; Megatron-LM 0 and 1; "
                                              "Megatron-Core also 3; MaxText and llm-foundry 0, 1, 3)")
    pp_schedules: tuple[str, ...] = trait(("gpipe", "1f1b"), "its pipeline schedules with one chunk per stage")
    pp_interleaved: tuple[str, ...] = trait(("circular", "1f1b"), "its schedules with v > 1 chunks per stage "
                                                                  "(interleaved 1F1B, MaxText's circular repeats)")
    cp_rotate: str = trait("", "how K and V reach the other context ranks: \"\" as `attention` says; allgather: "
                               "PyTorch's context parallel with rotate method ALL_GATHER (_AllGatherRotater)")
    cp_kv_heads: str = trait("kv", "the heads K and V carry when they travel: kv (GQA kept), or q (torchtitan's "
                                   "llama repeats them to the query heads, repeat_kv)")
    cp_grad_bytes: int = trait(0, "bytes per element of the dK/dV the ring carries: 0 the activations' dtype; 4 "
                                  "where they accumulate in float32 (PyTorch's dkv rotater)")
    cp_hide: str = trait("core", "the attention work context collectives hide under: core, all of it (Liu et al. "
                                 "2023); diagonal, 1/context (PyTorch's rotater waits after the diagonal block)")
    cp_attention: str = trait("", "the context-parallel attention estimate defaults to: ring (Megatron-Core "
                                  "--cp-comm-type p2p, torchtitan), allgather (MaxText); \"\": the user's")
    sources: str = trait("", "where the preset's traits come from")


def describe(software: Software) -> list[str]:
    """One line per trait of `software` that differs from jaxpar's: name = value, meaning and source."""
    base = Software()
    return [f"{f.name} = {getattr(software, f.name)!r}: {f.metadata['help']}"
            for f in dataclasses.fields(Software) if getattr(software, f.name) != getattr(base, f.name)]


JAXPAR = Software()
# Megatron-LM as in its published GPT runs (Narayanan et al. 2021; Korthikanti et al. 2022): dropout,
# 1F1B, scatter/gather between stages, the distributed optimizer's bf16 gathers, routed MoE dispatch
MEGATRON = Software(name="megatron-lm", platforms=("gpu",), jaxpar_program=False, dropout=True, causal=False, pp_scatter_gather=True,
                    pp_1f1b=True, rerun_outputs=True, moe_padded=False,
                    param_gather_bytes=2, serve_weight_bytes=2, pp_head_spread=False, pp_end_stages=True, weight_bytes=2,
                    optimizer_bytes=12, fsdp_pipeline=False, zeros=(0, 1),
                    remats=("none", "selective", "dots", "full"), pp_schedules=("1f1b",), pp_interleaved=("1f1b",))
# Megatron-Core as run for its H100 MFU table (2024-25): Transformer Engine's fused attention, the
# communication overlaps above all on, no dropout (the LLM pre-training recipes set both dropouts to 0)
MEGATRON_CORE = dataclasses.replace(MEGATRON, name="megatron-core", dropout=False, fused_attention=True, causal=True,
                                    fused_mlp=True,
                                    tp_overlap=1.0, dp_overlap=1.0, pp_overlap=1.0, async_tp=True,
                                    distributed_optimizer=True, sequence_parallel=True, state_over_context=True,
                                    flat_params=True, grad_buckets=True,
                                    cp_attention="ring", zeros=(0, 1, 3), sources="Megatron-Core MFU table (published_runs_h100.toml); NeMo and "
                                            "Megatron-Bridge performance summaries; cuDNN fused attention skips "
                                            "masked blocks under is_causal")
# torchtitan (Liang et al. 2024, arXiv 2410.06511; its train_configs): FSDP2 (fully_shard, bf16 parameter
# gathers, float32 gradient reduce-scatter: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)),
# implicit prefetch of the next block's gather and the reduce-scatter beside the backward pass, SDPA
# flash attention (causal), 1F1B / interleaved 1F1B pipelines (torch.distributed.pipelining) with the
# loss on the last stage, activation checkpointing of whole blocks (which reruns the output projection),
# async TP as collective matmul, float8 linears with float8 FSDP gathers (torchao), context parallelism
# by PyTorch's all-gather rotater over K and V repeated to the query heads, float32 dK/dV.
TORCHTITAN = Software(name="torchtitan", platforms=("gpu",), jaxpar_program=False, causal=True, fused_attention=True, fused_mlp=True,
                      pp_1f1b=True, sac_every_other_mm=True, loss_logit_bytes=12, pp_fsdp_gathered=True,
                      remats=("none", "dots", "full"), pp_schedules=("1f1b", "zb-v", "dualpipe-v"),
                      pp_interleaved=("1f1b",), zeros=(0, 3),
                      rerun_outputs=True, moe_padded=False, param_gather_bytes=2, serve_weight_bytes=2,
                      pp_head_spread=False, pp_end_stages=True, dp_overlap=1.0, pp_overlap=0.0, fp8_gathers=True,
                      flat_params=True,
                      async_tp=True,
                      sequence_parallel=True, attention_kernel="flash2", state_over_context=True, fsdp_over_context=True,
                      cp_rotate="allgather", cp_kv_heads="q", cp_grad_bytes=4, cp_hide="diagonal", cp_attention="ring",
                      sources="arXiv 2410.06511 sec. 2-3; torchtitan docs/fsdp.md, float8.md; torchtitan "
                              "config context_parallel_rotate_method, models/llama3 repeat_kv; PyTorch "
                              "distributed/tensor/experimental/_attention.py (_AllGatherRotater, dkv rotater); "
                              "pipeline_parallel_schedule: torch.distributed.pipelining's Schedule1F1B, "
                              "ScheduleZBVZeroBubble, ScheduleDualPipeV")
# MaxText (AI-Hypercomputer/maxtext: configs/base.yml): XLA's SPMD program like jaxpar's, splash (TPU) or
# cuDNN flash (GPU) attention, scanned layers, the residual stream sharded over `tensor` between blocks
# (its logical axis rules put activation_embed on tensor: all-gathers and reduce-scatters, as under sequence
# parallelism), float32 weights (weight_dtype) gathered as stored, the
# latency-hiding scheduler overlapping FSDP gathers and gradient reductions with the layers, its pipeline
# a circular schedule differentiated by autodiff (not 1F1B), MoE with fixed-capacity buffers unless
# megablox (sparse_matmul) is on; XLA drops the rerun of a layer's last projection, as for jaxpar.
MAXTEXT = Software(name="maxtext", jaxpar_program=False, causal=True, fused_attention=True, fused_mlp=True,
                   autodiff_remat=True, remats=("none", "dots_no_batch", "full", "offload"), pp_schedules=("gpipe",),
                   pp_interleaved=("circular",),
                   pp_1f1b=False,
                   rerun_outputs=False, moe_padded=True, param_gather_bytes=4, serve_weight_bytes=2,
                   pp_head_spread=False, dp_overlap=1.0, async_tp=True, sequence_parallel=True, state_over_context=True,
                   fsdp_over_context=True, cp_attention="allgather",
                   sources="maxtext configs/base.yml (weight_dtype, remat_policy, attention, context_parallel_strategy, shard_optimizer_over_data, logical_axis_rules: "
                           "activation_embed on tensor); MaxText README")
# MosaicML llm-foundry (scripts/train/benchmarking/README.md): PyTorch FSDP FULL_SHARD (or SHARD_GRAD_OP),
# Composer's mixed precision DEFAULT (bf16 parameter gathers, float32 gradient reduction), flash attention
# (causal), forward/backward prefetch, full-layer activation checkpointing; no TP or PP.
LLM_FOUNDRY = Software(name="llm-foundry", platforms=("gpu",), jaxpar_program=False, causal=True, fused_attention=True,
                       rerun_outputs=True, param_gather_bytes=2, serve_weight_bytes=2, pp_head_spread=False,
                       dp_overlap=1.0, attention_kernel="flash2", axes=("data", "fsdp"), remats=("none", "full"), flat_params=True,
                       pp_schedules=(), pp_interleaved=(), sources="llm-foundry benchmarking README; Composer FSDP docs (mixed_precision)")
SOFTWARE = {s.name: s for s in (JAXPAR, MEGATRON, MEGATRON_CORE, TORCHTITAN, MAXTEXT, LLM_FOUNDRY)}
# Stacks that run one of the presets above under another name (NeMo and Megatron-Bridge train with Megatron-Core).
ALIASES = {"nemo": "megatron-core", "megatron-bridge": "megatron-core"}
SOFTWARE |= {alias: SOFTWARE[name] for alias, name in ALIASES.items()}
# What each --software choice costs, in one line each (`--help`; the traits and their sources above)
STACKS = {"jaxpar": "jaxpar's own program (default): dense attention, no communication overlap",
          "megatron-lm": "Megatron-LM as in the 2021-22 papers: dropout, 1F1B, no overlap",
          "megatron-core": "fused attention; TP, data and pipeline communication overlapped; the "
                           "distributed optimizer's bf16 gathers",
          "nemo": "NeMo trains with Megatron-Core: its preset",
          "megatron-bridge": "Megatron-Bridge trains with Megatron-Core: its preset",
          "torchtitan": "FSDP2, SDPA flash attention, async TP, float8 linears with float8 gathers",
          "maxtext": "XLA with splash or cuDNN attention, the residual stream sharded over tensor",
          "llm-foundry": "PyTorch FSDP, FlashAttention-2, no TP or PP"}


def refusal(st: Strategy, software: Software) -> str:
    """Why another stack does not run the layout `st` ("" where it does): a mesh axis it does not parallelise
    over (`axes`), FSDP inside pipeline stages where its FSDP does not shard them (`fsdp_pipeline`), a ZeRO
    stage it has no mode for (`zeros`), a pipeline schedule it does not run (`pp_schedules`,
    `pp_interleaved`). jaxpar's own program is checked by jaxpar.core.validate instead."""
    if software.jaxpar_program:
        return ""
    sizes, o = st.sizes, st.options
    if why := mesh_refusal(software, sizes):
        return why
    if software.fsdp_over_context and sizes["context"] > 1 and o.zero not in (None, 3):
        return f"its FSDP spans the context ranks (ZeRO-3 over fsdp x context), not zero={o.zero} over context={sizes['context']}"
    if st.zero not in software.zeros:
        return f"it runs ZeRO stages {', '.join(map(str, software.zeros))}, not zero={st.zero}"
    kinds = software.pp_interleaved if o.pp_repeats > 1 else software.pp_schedules
    if sizes["pipeline"] > 1 and o.pp_schedule not in kinds:
        chunks = f"{o.pp_repeats} chunks per stage" if o.pp_repeats > 1 else "one chunk per stage"
        return f"its pipeline schedules with {chunks} are {', '.join(kinds) or 'none'}, not pp_schedule={o.pp_schedule}"
    return ""


def mesh_refusal(software: Software, sizes: dict[str, int]) -> str:
    """`refusal`'s rules of the mesh alone (the planner's first sieve): the axes and FSDP inside stages."""
    if axes := [f"{a}={n}" for a, n in sizes.items() if n > 1 and a not in software.axes]:
        return f"it parallelises over {', '.join(software.axes)} only, not {', '.join(axes)}"
    if not software.fsdp_pipeline and sizes["fsdp"] > 1 and sizes["pipeline"] > 1:
        return f"its FSDP does not shard pipeline stages (fsdp={sizes['fsdp']} x pipeline={sizes['pipeline']})"
    return ""


def check_platform(software: Software, hardware) -> None:
    """Refused in one line: a stack's preset on hardware it does not run on (`Software.platforms`: Megatron,
    torchtitan and llm-foundry are CUDA programs; on a TPU the stacks that run are jaxpar and MaxText)."""
    if hardware.platform not in software.platforms:
        stacks = [name for name, s in SOFTWARE.items() if hardware.platform in s.platforms and name not in ALIASES]
        raise ConfigError(f"software {software.name} runs on {' and '.join(p.upper() for p in software.platforms)}s, "
                          f"not on {hardware.name} ({hardware.platform.upper()}): --software {' or '.join(stacks)}")


def check_runs(st: Strategy, software: Software) -> None:
    """Refuse, in one line, a layout `software` does not run (`refusal`)."""
    if why := refusal(st, software):
        raise ConfigError(f"{software.name} does not run {st.describe()}: {why}")


def program_kernel(st: Strategy, platform: str) -> str:
    """The attention kernel jaxpar's program runs for `st` on a `platform` (cpu | gpu | tpu) device: the
    strategy's `attention_kernel`, `auto` resolved as the run resolves it (jaxpar.core.strategy.resolve_kernel)."""
    return resolve_kernel(st.options.attention_kernel, st.options.dtype, platform)


@functools.lru_cache(maxsize=64)
def kernel_traits(software: Software, kernel: str) -> Software:
    """`software` with the attention traits of `kernel`: any kernel but dense keeps no scores in HBM,
    recomputes QK^T in its backward pass (jaxpar/ops/blockwise_attention.py, FlashAttention-2's backward)
    and skips fully masked blocks under a causal mask, so it computes the lower triangle only."""
    fused = kernel != "dense"
    return dataclasses.replace(software, fused_attention=fused, causal=fused)


def program_traits(software: Software, st: Strategy, platform: str) -> Software:
    """The traits a step of `software` has under `st` on `platform`: a preset's own, except that
    jaxpar's program's attention traits follow the kernel the run uses (`program_kernel`), and its MoE
    dispatch the `moe_kernel` option (grouped: the routed copies only, jaxpar/ops/moe_grouped.py)."""
    if not software.jaxpar_program:
        return software
    return dispatch_traits(software, program_kernel(st, platform), st.options.moe_kernel == "padded")


@per_model  # on the preset's identity: one replace per preset, kernel and dispatch, not one per estimate
def dispatch_traits(software: Software, kernel: str, padded: bool) -> Software:
    """`kernel_traits` of `software` with its MoE dispatch `padded` (static buffers) or not (routed copies)."""
    traits = kernel_traits(software, kernel)
    return traits if traits.moe_padded == padded else dataclasses.replace(traits, moe_padded=padded)
