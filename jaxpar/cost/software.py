"""What the software stack does that neither the model config nor the mesh says.

The same mesh costs differently under different implementations; these switches name the
differences that matter for the cost model, with presets for jaxpar itself, for Megatron-LM (the
published runs the model is calibrated on) and for Megatron-Core. A preset is data: a new stack is
one more `Software(...)` in `SOFTWARE`.

    jaxpar_program     the step is jaxpar's own JAX program as XLA compiles it: the one question "is this
                       jaxpar's program?" of the cost model. Its program's adjustments to the textbook
                       figures apply (its activation inventory, jaxpar/cost/inventory_jax.py and
                       program_memory.py; its pipelines' per-shard weight copies, head spread and
                       boundary all-reduces, jaxpar/cost/program_comm.py and program_pipeline.py; its overlap
                       options, jaxpar/cost/overlap.py); False: another stack, costed by its traits below
    dropout            the model trains with dropout: masks and dropped copies join the activation
                       inventory (Megatron GPT: attention-probability and hidden dropout, Korthikanti 2022)
    causal             count only the lower triangle of attention scores (a causal kernel that skips
                       masked blocks); False counts the full s x s, as dense masked attention computes
    pp_scatter_gather  a stage sends 1/t of its boundary activation and the receiver all-gathers it
                       over `tensor` (Narayanan et al. 2021, section 4.1); False: the activation goes as
                       it is, split over `tensor` only under sequence parallelism
    pp_1f1b            the pipeline runs one-forward-one-backward (Megatron; Narayanan 2021), so a
                       stage holds activations of S micro-batches, not all M (jaxpar's GPipe/circular
                       schedules are autodiff through a loop: forward for all M, then backward)
    rerun_outputs      full recompute reruns a layer's last projection too (Megatron); XLA drops it,
                       because nothing in the backward pass reads its output (jaxpar/cost/flops.py)
    moe_padded         MoE dispatch into static per-expert buffers of the group capacity (jaxpar.ops.moe:
                       dropless computes and sends E/k times the token copies that exist); False: only
                       the routed copies (Megatron's grouped GEMM and token dispatcher)
    param_gather_bytes bytes per element of the parameter all-gather after a ZeRO-1 update: jaxpar gathers
                       its float32 masters (4); Megatron's distributed optimizer the bf16 weights (2)
    pp_head_spread     the head and loss of a pipeline run on every stage, each on ceil(M/S) micro-batches
                       (jaxpar/pipeline/gpipe.py); False: on the last stage, for all M (Megatron)
    pp_end_stages      the embedding is built on the first pipeline stage and the head on the last, so a
                       stage holds one of an untied model's two vocabulary matrices (Megatron-LM's GPTModel
                       pre_process / post_process; torchtitan's pipeline split); False: on every stage, as
                       jaxpar stages only the layers and MaxText pipelines only its decoder layers
                       (jaxpar/cost/memory.py embedding_copies)
    serve_weight_bytes bytes per parameter a generation step reads: Megatron-style serving stores bf16
                       weights (2); jaxpar's generate stores them in its strategy's dtype
                       (jaxpar.cost.inference.weight_bytes)
    fused_attention    a fused (flash) attention kernel (Dao et al. 2022; Dao 2023): the s x s scores never
                       reach HBM (no score, softmax or score-dropout activations; none stored), and the
                       backward pass recomputes QK^T from the saved softmax statistics (+1 score matmul).
                       For jaxpar's program both follow the run's `attention_kernel` on the target
                       hardware (`program_traits`): every kernel but dense is fused and skips the blocks a
                       causal mask hides

    fused_mlp          the SwiGLU runs as one fused kernel that keeps only its input (gate, up) for the
                       backward pass, so silu(gate) is never stored (jaxpar/cost/memory.py fused_swiglu):
                       Megatron-Core's --bias-swiglu-fusion (on by default), torch.compile's fusion of the
                       elementwise ops (torchtitan's runs compile), XLA's fusions (MaxText); False in eager
                       PyTorch, where the product keeps both its inputs
    autodiff_remat     rematerialisation by autodiff (jax.checkpoint under XLA: MaxText's remat policies),
                       which saves only the values its backward pass reads (jaxpar/cost/memory.py
                       residuals_only): a block's last projection is never stored; False: PyTorch's
                       selective checkpointing, which caches every output its policy names
    sac_every_other_mm under remat `dots` the stack saves every other matmul output of a layer and reruns
                       the rest: torchtitan's op-level selective activation checkpointing ("Saves output of
                       all compute ops, except every second mm", torchtitan parallelize_llama `_custom_policy`;
                       jaxpar/cost/memory.py every_other_matmul, flops.py every_other_matmul_flops)
    loss_logit_bytes   bytes per logit alive at the loss's peak: Megatron's fused vocab-parallel cross entropy
                       keeps the float32 logits and works in place (4); torchtitan's loss is
                       F.cross_entropy(pred.flatten(0, 1).float(), ...), uncompiled ("compiling loss
                       function causes CUDA errors"), with `del pred` before the backward pass: log-softmax's
                       float32 output, its gradient and its input's gradient are alive together (12)
    pp_fsdp_gathered   under a pipeline, FSDP keeps each stage's weights gathered (bf16) and its gradients
                       unsharded (float32) for the whole step (torchtitan: reshard_after_forward off under
                       PP; PyTorch's pipeline stages reduce gradients on the last micro-batch only;
                       jaxpar/cost/memory.py pipeline_fsdp_bytes)
    attention_kernel   "flash2": the stack's attention is FlashAttention-2 (PyTorch SDPA's flash backend,
                       flash-attn 2), which runs at the profile's flash2_efficiency (an Ampere kernel: 35%
                       of an H100); "": a kernel tuned for the hardware (cuDNN, Transformer Engine, splash),
                       at the matmul efficiency
    weight_bytes       bytes per parameter of the weights kept between steps: jaxpar's float32 weights are
                       the optimizer's masters (4); Megatron keeps bf16 weights (2) and the float32 master
                       copy in the optimizer state (Megatron's Float16OptimizerWithFloat16Params)
    optimizer_bytes    bytes per parameter of the optimizer state: AdamW's two float32 moments (8), plus
                       the float32 master copy where the weights are bf16 (12)
    state_over_context the ZeRO-sharded state is split over the context-parallel ranks as well: Megatron's
                       distributed optimizer shards over its data x context group, torchtitan's FSDP over
                       the flattened dp_shard x cp mesh, MaxText's rules put `embed` on its context axis
    fsdp_over_context  the stack's FSDP spans the context ranks even where the data-parallel shard degree is
                       1, so the whole state is sharded over them: torchtitan applies fully_shard over its
                       dp_shard_cp mesh whenever dp_shard or cp is > 1 (torchtitan/models/llama3/infra/
                       parallelize.py), MaxText's logical axis rules put `embed` on `context`; Megatron's
                       distributed optimizer shards only what its ZeRO stage says (False)
    flat_params        FSDP gathers and reduce-scatters each block's weights as one flat buffer: one op per
                       block and pass, not one per weight array (jaxpar/cost/compiler.py flat_weights):
                       torchtitan's FSDP2 (one fully_shard group per TransformerBlock, gathered by one
                       foreach all-gather, reduced by one reduce-scatter: torchtitan docs/fsdp.md),
                       llm-foundry's FSDP1 (one FlatParameter per wrapped block), Megatron-FSDP (its
                       fsdp_unit_modules, a TransformerLayer each, gathered per unit); False for XLA's
                       programs (jaxpar, MaxText), which issue one per array
    grad_buckets       the gradient reductions and parameter gathers issued once per step (ZeRO-0's
                       all-reduces, ZeRO-1's reduce-scatters and gathers) go in buckets of max(40M, 1M x
                       data-parallel ranks) parameters: Megatron-Core's DDP and distributed optimizer
                       under --overlap-grad-reduce (bucket_size default, megatron/core/distributed/
                       distributed_data_parallel.py; jaxpar/cost/compiler.py buckets); False: one per weight
                       array (without the overlap Megatron reduces one contiguous buffer: as few ops)
    fp8_gathers        under dtype=float8 the FSDP all-gathers move float8 weights (1 byte; torchtitan's
                       float8 linears with `enable_fsdp_float8_all_gather`, torchao float8 README)
    async_tp           the stack runs tensor parallelism as collective matmuls when asked (`--overlap
                       collective_matmul`: torchtitan's async TP, PyTorch SymmetricMemory; MaxText's and
                       XLA's collective matmul): its tensor collectives hide under the GEMMs inside a node
    distributed_optimizer  the stack's recipes shard the optimizer state over the data-parallel ranks
                       (Megatron --use-distributed-optimizer, NeMo's default): estimate defaults to zero=1
    sequence_parallel  the stack's tensor parallelism always shards the norms' sequence (Megatron-Core
                       recipes; torchtitan's TP plan shards the sequence between blocks): estimate
                       defaults to sequence parallelism wherever tensor > 1

What the stack runs, which `plan --software` searches (jaxpar/planning/planner.py candidate_options):
    axes          the mesh axes it parallelises over (llm-foundry: FSDP and data parallelism only)
    fsdp_pipeline  its FSDP shards the weights inside pipeline stages (torchtitan's FSDP2 under PP; jaxpar;
                  MaxText's fsdp axis beside its pipeline); False for Megatron: Megatron-FSDP composes with
                  TP, CP and EP but not PP (Megatron-LM docs custom_fsdp.md; issue #1455; "FSDP and PP are
                  mutually exclusive in Megatron's standard path", PR #6081), so a Megatron pipeline shards
                  its state with the distributed optimizer only
    remats        its recompute policies: Megatron's --recompute-granularity selective | full, and selective
                  with --recompute-modules layernorm moe_act (the norms and activations rerun, every
                  matmul output kept: `dots`; Megatron-Core 0.11+); torchtitan's
                  activation_checkpoint mode op (selective per op: every matmul output kept, `dots`) | full;
                  MaxText's remat_policy minimal (dots without batch dimensions) | full | offloaded names;
                  jaxpar's own
    zeros         its ZeRO stages: Megatron-LM 0 and 1 (DDP; --use-distributed-optimizer), Megatron-Core also 3
                  (Megatron-FSDP, --data-parallel-sharding-strategy optim_grads_params); torchtitan 0 and 3
                  (replicate, DDP over data_parallel_replicate_degree; FSDP2's fully_shard over dp_shard: no
                  stage shards the optimizer state alone, docs/fsdp.md); MaxText 0, 1 and 3 (its data axis
                  replicates, shard_optimizer_over_data is ZeRO-1, its fsdp rules shard weights and state);
                  llm-foundry 0, 1 and 3 (FSDP NO_SHARD, SHARD_GRAD_OP, FULL_SHARD: ZeRO-2 priced as ZeRO-1,
                  whose collectives it issues, its sharded gradients not counted in memory);
                  jaxpar 0, 1 and 3. A stack whose FSDP spans the context ranks (`fsdp_over_context`) runs
                  ZeRO-3 over them and nothing else
    pp_schedules  its pipeline schedules with one chunk per stage: Megatron and torchtitan run 1F1B (GPipe's
                  memory is never better), MaxText its circular pipeline differentiated by autodiff (GPipe's
                  order); jaxpar GPipe or its lockstep 1F1B
    pp_interleaved  its schedules with v > 1 chunks per stage: Megatron's and torchtitan's interleaved 1F1B
                  (virtual pipeline stages; Interleaved1F1B), MaxText's circular repeats
                  (num_pipeline_repeats), jaxpar's circular and interleaved 1F1B

Context parallelism (jaxpar/cost/comm_context.py):
    cp_rotate    how K and V reach the other context ranks: "" as the strategy's `attention` option says
                 (jaxpar's kernels: a ring of permutes, or an all-gather with dK/dV reduce-scattered);
                 "allgather": PyTorch's context parallel with rotate method ALL_GATHER (torchtitan's
                 `context_parallel_rotate_method` default; torch/distributed/tensor/experimental/_attention.py
                 `_AllGatherRotater`): one all-gather of K and V per attention call forward and again
                 backward, dK and dV sent around the ring by context hops of the whole local buffer
                 (its dkv rotater), the positions sharded up front (no position traffic)
    cp_kv_heads  the heads K and V carry when they travel: "kv" the key-value heads (GQA kept);
                 "q" every query head of the tensor shard (torchtitan's llama repeats K and V to the
                 query heads, `repeat_kv`, before SDPA)
    cp_grad_bytes  bytes per element of the dK/dV the ring carries: 0 the activations' dtype; 4 where
                 they accumulate in float32 (PyTorch's dkv rotater, convert_to_f32)
    cp_attention the strategy's `attention` that stands for the stack's context parallelism, which `estimate`
                 defaults to where context > 1 and the user named none: "ring" Megatron-Core (--cp-comm-type
                 p2p, its default) and torchtitan (PyTorch's context parallel: a ring of blocks, whose K/V
                 movement `cp_rotate` gives); "allgather" MaxText (context_parallel_strategy = all_gather,
                 its default: K and V all-gathered over the context axis); "" jaxpar's program, whose user
                 chooses the kernel. All three stacks load-balance the causal work over the context ranks by
                 default (Megatron's 2 x cp chunks per sequence; PyTorch's enable_load_balance; MaxText's
                 context_parallel_load_balance), as the cost model prices it for every layout
    cp_hide      the attention work context collectives hide under: "core" all of it (Liu et al. 2023:
                 each hop under the previous block's kernel); "diagonal" a 1/context share: PyTorch's
                 all-gather rotater waits on its gather after the diagonal block, the first of context
                 blocks, and the dK/dV ring's last hop waits after the last block

Overlap: the fraction of a class of collectives the software issues concurrently with independent
compute; time.step_time hides at most that fraction, and never more than the compute there is:
    tp_overlap   tensor/sequence-parallel all-gathers and reduce-scatters decomposed into the GEMMs
                 that consume or produce them (Megatron-Core --tp-comm-overlap over Transformer
                 Engine's userbuffers; Wang et al. 2023, "Overlap communication with dependent
                 computation via decomposition"); 0 when the collective waits between GEMMs. Only
                 inside a node (NVLink, a TPU slice's ICI): userbuffers and SymmetricMemory need
                 peer-to-peer device memory, so a tensor group across InfiniBand or DCN waits
                 (jaxpar/cost/overlap.py)
    dp_overlap   gradient reduce-scatters / all-reduces issued bucket by bucket as the backward pass
                 produces them, and the distributed optimizer's parameter all-gathers issued with the
                 next forward (Megatron-Core --overlap-grad-reduce, --overlap-param-gather; PyTorch
                 DDP buckets, Li et al. 2020); 0: reduced after the backward pass (Megatron-LM 2021)
    pp_overlap   the interleaved schedule's stage-to-stage sends and receives issued asynchronously
                 with the next micro-batch's compute (Megatron-Core --overlap-p2p-comm)
    ep_overlap   the expert all-to-alls (dispatch and combine) issued beside another micro-batch's
                 compute: DeepSeek-V3's DualPipe pairs a forward and a backward chunk so that each one's
                 all-to-alls hide under the other's compute (DeepSeek-AI 2024, arXiv 2412.19437 sec.
                 3.2.1); Megatron-Core's --overlap-moe-expert-parallel-comm does the same for 1F1B
                 micro-batches (Megatron-Bridge docs/training/communication-overlap.md). 0 in every
                 preset: no published run that calibrates a preset trains a mixture of experts
"""
from __future__ import annotations

import dataclasses
import functools

from jaxpar.core.strategy import AXES, Strategy
from jaxpar.cost.params import per_model
from jaxpar.errors import ConfigError
from jaxpar.ops.attention import resolve_kernel


@dataclasses.dataclass(frozen=True, slots=True)
class Software:
    name: str = "jaxpar"
    jaxpar_program: bool = True
    dropout: bool = False
    causal: bool = False
    pp_scatter_gather: bool = False
    pp_1f1b: bool = False
    rerun_outputs: bool = False
    moe_padded: bool = True
    param_gather_bytes: int = 4
    serve_weight_bytes: int = 4
    pp_head_spread: bool = True
    pp_end_stages: bool = False
    fused_attention: bool = False
    fused_mlp: bool = False
    autodiff_remat: bool = False
    sac_every_other_mm: bool = False
    loss_logit_bytes: int = 4
    pp_fsdp_gathered: bool = False
    tp_overlap: float = 0.0
    dp_overlap: float = 0.0
    pp_overlap: float = 0.0
    ep_overlap: float = 0.0
    flat_params: bool = False
    grad_buckets: bool = False
    fp8_gathers: bool = False
    async_tp: bool = False
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    attention_kernel: str = ""
    weight_bytes: int = 4
    optimizer_bytes: int = 8
    state_over_context: bool = False
    fsdp_over_context: bool = False
    axes: tuple[str, ...] = AXES
    fsdp_pipeline: bool = True
    remats: tuple[str, ...] = ("none", "dots_no_batch", "full")
    zeros: tuple[int, ...] = (0, 1, 3)
    pp_schedules: tuple[str, ...] = ("gpipe", "1f1b")
    pp_interleaved: tuple[str, ...] = ("circular", "1f1b")
    cp_rotate: str = ""
    cp_kv_heads: str = "kv"
    cp_grad_bytes: int = 0
    cp_hide: str = "core"
    cp_attention: str = ""
    sources: str = ""


JAXPAR = Software()
# Megatron-LM as in its published GPT runs (Narayanan et al. 2021; Korthikanti et al. 2022): dropout,
# 1F1B, scatter/gather between stages, the distributed optimizer's bf16 gathers, routed MoE dispatch
MEGATRON = Software(name="megatron-lm", jaxpar_program=False, dropout=True, causal=False, pp_scatter_gather=True,
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
TORCHTITAN = Software(name="torchtitan", jaxpar_program=False, causal=True, fused_attention=True, fused_mlp=True,
                      pp_1f1b=True, sac_every_other_mm=True, loss_logit_bytes=12, pp_fsdp_gathered=True,
                      remats=("none", "dots", "full"), pp_schedules=("1f1b",), pp_interleaved=("1f1b",), zeros=(0, 3),
                      rerun_outputs=True, moe_padded=False, param_gather_bytes=2, serve_weight_bytes=2,
                      pp_head_spread=False, pp_end_stages=True, dp_overlap=1.0, pp_overlap=0.0, fp8_gathers=True,
                      flat_params=True,
                      async_tp=True,
                      sequence_parallel=True, attention_kernel="flash2", state_over_context=True, fsdp_over_context=True,
                      cp_rotate="allgather", cp_kv_heads="q", cp_grad_bytes=4, cp_hide="diagonal", cp_attention="ring",
                      sources="arXiv 2410.06511 sec. 2-3; torchtitan docs/fsdp.md, float8.md; torchtitan "
                              "config context_parallel_rotate_method, models/llama3 repeat_kv; PyTorch "
                              "distributed/tensor/experimental/_attention.py (_AllGatherRotater, dkv rotater)")
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
LLM_FOUNDRY = Software(name="llm-foundry", jaxpar_program=False, causal=True, fused_attention=True,
                       rerun_outputs=True, param_gather_bytes=2, serve_weight_bytes=2, pp_head_spread=False,
                       dp_overlap=1.0, attention_kernel="flash2", axes=("data", "fsdp"), remats=("none", "full"), flat_params=True,
                       pp_schedules=(), pp_interleaved=(), sources="llm-foundry benchmarking README; Composer FSDP docs (mixed_precision)")
SOFTWARE = {s.name: s for s in (JAXPAR, MEGATRON, MEGATRON_CORE, TORCHTITAN, MAXTEXT, LLM_FOUNDRY)}
# Stacks that run one of the presets above under another name (NeMo and Megatron-Bridge train with Megatron-Core).
ALIASES = {"nemo": "megatron-core", "megatron-bridge": "megatron-core"}
SOFTWARE |= {alias: SOFTWARE[name] for alias, name in ALIASES.items()}


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


def check_runs(st: Strategy, software: Software) -> None:
    """Refuse, in one line, a layout `software` does not run (`refusal`)."""
    if why := refusal(st, software):
        raise ConfigError(f"{software.name} does not run {st.describe()}: {why}")


def program_kernel(st: Strategy, platform: str) -> str:
    """The attention kernel jaxpar's program runs for `st` on a `platform` (cpu | gpu | tpu) device: the
    strategy's `attention_kernel`, `auto` resolved as the run resolves it (jaxpar.ops.attention.resolve_kernel)."""
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
