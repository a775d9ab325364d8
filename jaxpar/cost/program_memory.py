"""jaxpar's own program's activation memory: what XLA's buffers hold at the peak of the step that jaxpar
compiles, where it departs from the textbook accounting of jaxpar/cost/memory.py (Korthikanti et al.
2022's inventory of a PyTorch layer). `estimate` uses it for software with `jaxpar_program`.

Each adjustment once, with what it is and where it is checked against XLA's memory analysis
(`Trainer.lower_step(...).memory_analysis()`):
    inventory       what JAX's autodiff keeps per layer (jaxpar/cost/inventory_jax.py: float32 norm
                    copies, softmax exp and probabilities, Mamba-2's shifted conv inputs, the MoE's static
                    dispatch buffers) in place of Korthikanti's; tests/test_cost_vs_xla.py, every case
    working set     one layer's full inventory at work in its backward pass whatever the remat policy:
                    XLA copies a layer's slice of the stacked scan residuals out before differentiating
                    it; tests/test_cost_vs_xla.py
    scores          dense attention: the float32 gradient of one layer's scores (d softmax and d scores
                    are the largest buffers of a layer's backward), h/t x s_kv x 4 bytes per token, and
                    the boolean causal mask, once (hoisted out of the layer loop); tests/test_cost_vs_xla.py.
                    A fused kernel keeps none (`kernel`): blockwise holds one block pair's float32 score
                    tiles (`tile_bytes`), cuDNN and splash keep theirs in on-chip memory
    pipelines       GPipe / circular (`pipeline_bytes`, `pipeline_embedding_bytes`) and 1F1B
                    (`one_f_one_b_bytes`) hold their schedules' carries, not M or S micro-batches'
                    inventories; with FSDP the gathered stage weights (`fsdp_stage_bytes`); each stage the
                    head of its share of the micro-batches; tests/test_verify_scale.py (llama3-70b's top
                    plans), tests/test_cost_vs_xla.py's pipeline cases
    gathered experts  ZeRO-3 without remat: every MoE layer's gathered routed experts (`fsdp_experts_bytes`);
                    tests/test_cost_vs_xla.py::test_fsdp_experts_stay_gathered_until_the_backward_pass
    gathered head   ZeRO-3 over fsdp, no pipeline: at the head's backward, the top of the activation peak,
                    the LM head gathered whole and its whole float32 gradient before the reduction over
                    fsdp (`fsdp_head_bytes`; not on XLA:TPU); tests/test_cost_vs_xla.py's large-vocabulary case
"""
from __future__ import annotations

from jaxpar.cost.flops import expert_rows, unit_policy
from jaxpar.cost.held import head_and_norm
from jaxpar.cost.inventory_jax import BOOL, F32, jax_attention_inventory, jax_mamba_inventory, jax_moe_inventory
from jaxpar.cost.memory import (ACTIVATION_BYTES, GRAD_BYTES, PARAM_BYTES, Memory, batch_bytes, host_bytes, logit_bytes,
                                mtp_bytes, stage_bytes, state_bytes, step_tokens, working_bytes)
from jaxpar.cost.params import block_counts, zero_split
from jaxpar.cost.shape import block_slots, chunk_layers
from jaxpar.ops.tiles import BLOCK_K, BLOCK_Q
from jaxpar.core.schedule import schedule_of
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def memory(m: ModelConfig, st: Strategy, global_batch: int, seq: int, kernel: str = "dense",
           platform: str = "cpu") -> Memory:
    """Bytes per device of one training step of jaxpar's program: the textbook model and optimizer state
    (jaxpar/cost/memory.py: jaxpar's is the textbook's) and this module's activations under the attention
    `kernel` the run uses (jaxpar.cost.software.program_kernel), compiled for `platform` (cpu | gpu | tpu)."""
    params, grads, opt = state_bytes(m, st)
    return Memory(params, grads, opt, activation_bytes(m, st, global_batch, seq, kernel=kernel, platform=platform),
                  host_bytes(m, st, global_batch, seq))


def inventories(m: ModelConfig, st: Strategy, seq: int, score_keys: float | None = None,
                fused: bool = False) -> tuple[tuple, tuple, tuple]:
    """(attention, Mamba-2, MoE) inventories of jaxpar's layers (empty where the model has none): dense
    attention keeps the scores of `score_keys` keys (default `seq`), a `fused` kernel none; ring attention
    per K/V block after the first its carries; MoE at the static buffers' rows per token (flops.expert_rows)."""
    c = st.sizes["context"]
    na, nm, ne = block_counts(m)
    # ring: the c - 1 steps after the first fold keep their inputs (the first fold's are the layer's own
    # K/V and constant statistics; jaxpar.ops.attention.ring_attention)
    blocks = c - 1 if st.options.attention == "ring" and c > 1 else 0
    keys = 0 if fused else seq if score_keys is None else score_keys
    rows = expert_rows(m, seq, c, padded=True)
    return (jax_attention_inventory(m, keys, blocks, fused) if na else (), jax_mamba_inventory(m) if nm else (),
            jax_moe_inventory(m, keys, blocks, rows, fused) if ne else ())


def tile_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int) -> float:
    """The blockwise kernel's working tiles in its backward pass (jaxpar/ops/blockwise_attention.py
    `_pair_grads`): the float32 scores, probabilities, dP and dS of one (query block, key block) pair,
    [b, h/t, block_q, block_k] each."""
    return 4 * b_loc * m.heads / st.sizes["tensor"] * min(BLOCK_Q, seq) * min(BLOCK_K, seq) * F32


def activation_bytes(m: ModelConfig, st: Strategy, global_batch: int, seq: int,
                     score_keys: float | None = None, kernel: str = "dense", platform: str = "cpu") -> float:
    """Activation bytes per device at the peak of the backward pass of jaxpar's program:
    stored = this stage's layers' kept bytes per token x tokens (a pipeline: its schedule's carries)
           + one layer's full inventory at work in the backward pass (the working set, module docstring)
           + dense attention: one layer's float32 score gradient and the causal mask; blockwise: its tiles
           + the float32 logits of the head this device runs (under ZeRO-3 its gathered weight and whole
             gradient too: `fsdp_head_bytes`), its multi-token prediction modules' (memory.mtp_bytes), and
             the int32 batch (`batch_bytes`).
    `score_keys`: the keys each query's stored scores span (default `seq`); 0 leaves the [heads, s, s]
    scores out, so the difference is what they cost (jaxpar.planning.planner.scores_note). The layer unit
    keeps what its own policy keeps (flops.unit_policy): `selective` none's inventory less the attention
    core's scores, which it recomputes (one layer's are still at work in its backward); `offload` nothing
    on the device (jaxpar.cost.memory.host_bytes)."""
    sz, o = st.sizes, st.options
    t, stages, remat = sz["tensor"], sz["pipeline"], unit_policy(o.remat)
    na, _, ne = block_counts(m)
    b_loc, micro, tokens = step_tokens(st, global_batch, seq)
    ring = o.attention == "ring" and sz["context"] > 1
    fused = kernel != "dense" and not ring
    invs = inventories(m, st, seq, score_keys, fused)
    kept = inventories(m, st, seq, 0, fused) if o.remat == "selective" else invs   # the core's scores recomputed
    per_layer = stage_bytes(m, kept, st, remat)
    transient = tokens * working_bytes(invs, st)
    if stages > 1 and o.pp_schedule == "1f1b":   # the units' policy, in the stages' vmap
        inner = "full" if remat == "dots_no_batch" else remat        # (no dot without a batch dim there)
        stored, transient = one_f_one_b_bytes(m, st, b_loc, seq, transient, stage_bytes(m, kept, st, inner) * tokens)
    elif stages > 1:
        stored, transient = pipeline_bytes(m, st, tokens, per_layer, transient)
        stored += pipeline_embedding_bytes(m, st, b_loc, seq)
    else:
        stored = 0.0 if o.remat == "offload" else per_layer * tokens   # offload: memory.host_bytes
    in_shard_map = sz["expert"] > 1 or sz["context"] > 1 or t > 1   # jaxpar.ops.moe.moe_experts
    if ne and remat == "none" and st.zero == 3 and sz["fsdp"] > 1 and stages == 1 and in_shard_map:
        stored += ne * fsdp_experts_bytes(m, st)
    scores = 0.0
    if (na or ne) and fused:
        scores = tile_bytes(m, st, b_loc / micro, seq) if kernel == "blockwise" else 0.0
    elif (na or ne) and not ring:  # per token: h/t query heads x s keys
        scores = tokens * m.heads / t * (seq if score_keys is None else score_keys) * (F32 + BOOL)
    head = (logit_bytes(m, st, b_loc, seq) + mtp_bytes(m, st, invs, b_loc, seq)
            + (fsdp_head_bytes(m, st, platform) if stages == 1 else 0.0))
    if stages > 1:  # jaxpar/pipeline/gpipe.py: each stage the head of ceil(M/S) micro-batches
        head *= 1 / (micro * stages) if o.pp_schedule == "1f1b" else -(-micro // stages) / micro   # 1F1B: 1/S of one
    return stored + transient + scores + head + batch_bytes(st, global_batch, seq)


def pipeline_bytes(m: ModelConfig, st: Strategy, tokens: float, per_layer: float,
                   layer_transient: float) -> tuple[float, float]:
    """(stored, transient) bytes per device of jaxpar's GPipe / circular pipeline (jaxpar/pipeline/gpipe.py), whose
    one scan runs T = v*M + S - 1 iterations, bubbles included, each rematerialised as a whole under the
    policy. Stored: what each of the T iterations saves. Under `full`, and under `dots_no_batch` too (the
    vmap over the stages gives every weight dot a batch dim, so that policy saves none of them), only the
    iteration's input, one residual [mb, s, d] (split over tensor under SP); under `none` and `dots` its
    k unit slots' inventories (`per_layer` is the stage's v*k slots'). Plus, with FSDP inside the stages,
    each device's gathered copy of its stage's v*k unit slots (compute dtype, its tensor shard) and its
    float32 gradient accumulator, alive the whole step. Transient: the recomputed chunk in an
    iteration's backward, its k unit slots' inventories (remat `none` inside the chunk). Checked against
    XLA's memory analysis of llama3-70b's top plans (`plan --verify`, tests/test_verify_scale.py)."""
    sz, o = st.sizes, st.options
    sched = schedule_of(st, m.run_units)
    act = ACTIVATION_BYTES[o.dtype]
    if o.remat in ("full", "dots_no_batch"):
        stored = sched.iterations * tokens * m.d_model * act / (sz["tensor"] if o.sequence_parallel else 1)
    else:
        stored = per_layer * tokens * sched.iterations / sched.repeats
    return stored + fsdp_stage_bytes(m, st), layer_transient * chunk_layers(sched, m)


def one_f_one_b_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int, layer_transient: float,
                      stage_kept: float = 0.0) -> tuple[float, float]:
    """(stored, transient) activation bytes per device of jaxpar's 1F1B (jaxpar/pipeline/one_f_one_b.py): stored
    are its 2vS-1 stashed stage inputs (one residual [mb, s, d] each, whatever M is), the embedding output
    and its cotangent (the batch's) and one micro-batch's lookup partial sums, and with FSDP the gathered stage weights
    (`fsdp_stage_bytes`); transient the recomputed chunk's inventory in a tick's backward: its k unit
    slots' layers under remat "none", else what the units' policy keeps of them (`stage_kept`: the stage's
    v chunks', one micro-batch) and one layer's inventory at work (jaxpar/pipeline/stages.py)."""
    sz = st.sizes
    act = ACTIVATION_BYTES[st.options.dtype]
    stages = sz["pipeline"]
    sched = schedule_of(st, m.run_units)
    tokens = b_loc / st.options.microbatches * seq / sz["context"]
    residual = m.d_model * act / (sz["tensor"] if st.options.sequence_parallel else 1)
    repeats = st.options.pp_repeats   # interleaved 1F1B: 2vS-1 slots
    # the embedding output and its cotangent, the whole batch's (split over tensor under SP), and one
    # micro-batch's lookup partial sums at a time (jaxpar/pipeline/one_f_one_b.py looks micro-batches up in turn)
    embedding = 2 * b_loc * seq / sz["context"] * residual + tokens * m.d_model * act
    stored = (2 * stages * repeats - 1) * tokens * residual + embedding
    stored += fsdp_stage_bytes(m, st) + fsdp_outside_bytes(m, st)
    if st.options.remat == "none":
        return stored, layer_transient * chunk_layers(sched, m)
    return stored, stage_kept / repeats + layer_transient


def fsdp_outside_bytes(m: ModelConfig, st: Strategy) -> float:
    """With FSDP inside jaxpar's 1F1B: the embedding table and the LM head (its tensor shard) gathered whole
    over fsdp before the loop for every tick's lookup and head (jaxpar/pipeline/one_f_one_b.py `_prologue`),
    in float32 as the gather moves the stored parameter; alive the whole loop."""
    if st.sizes["fsdp"] == 1:
        return 0.0
    return (m.vocab * m.d_model / st.sizes["tensor"] + head_and_norm(m, st.sizes["tensor"])[0]) * PARAM_BYTES


def pipeline_embedding_bytes(m: ModelConfig, st: Strategy, b_loc: float, seq: int) -> float:
    """jaxpar's pipelines look the whole accumulation step's batch up at once, before the schedule: the
    vocab-parallel lookup's partial sums [b, s, d] before their reduction over `tensor` and, backward, the
    output gradient gathered for the table's scatter-add, each un-split over `tensor` (llama3-70b
    TP4 PP8 DP2, 128 sequences of 8k per device: two 32 GiB float32 buffers in XLA:CPU's peak, which
    promotes the bf16 sums). jaxpar/pipeline/one_f_one_b.py looks the micro-batches up in turn instead."""
    return 2 * b_loc * seq / st.sizes["context"] * m.d_model * ACTIVATION_BYTES[st.options.dtype]


def fsdp_stage_bytes(m: ModelConfig, st: Strategy) -> float:
    """With FSDP inside a jaxpar pipeline's stages: each device's gathered copy of its stage's v*k unit slots
    (its tensor shard) in float32, as the all-gather moves the stored parameter and the cast to the compute
    dtype follows it (jaxpar/cost/program_comm.py), and its float32 gradient accumulator, alive the whole
    loop. The accumulator is the gradient the ZeRO-3 shard (memory.state_bytes' `grads`) is cut from after
    the loop, so only what it holds beyond that shard is counted here. XLA:CPU's buffers at the peak of
    llama3-70b fsdp2 x pipeline16 x tensor2 (1F1B v=5): the MLP's gathered float32 [5, 8192, 14336] arrays
    beside as many float32 accumulators, no shard yet."""
    sz = st.sizes
    if sz["fsdp"] == 1:
        return 0.0
    sched = schedule_of(st, m.run_units)
    slots = 0.0   # elements of a stage's v chunks of unit slots: every block's, by kind
    for block, n in zip(("attention", "mamba", "moe"), block_slots(sched.run_slots, m.runs)):
        if n:
            sharded, kept = zero_split(m, block, 3)
            slots += n * (sharded.per_device(sz["tensor"], sz["expert"]) + kept.per_device(sz["tensor"], sz["expert"]))
    return sched.repeats * slots * (PARAM_BYTES + GRAD_BYTES * (1 - 1 / sz["fsdp"]))


def fsdp_experts_bytes(m: ModelConfig, st: Strategy) -> float:
    """Per MoE layer, jaxpar's program under ZeRO-3 without remat: the routed experts' weights gathered over
    fsdp (float32, as stored) are the expert kernel's shard_map operands, which its transpose reads, so
    every layer's gathered copy lives until the backward pass (seen in XLA's memory analysis: moe-tiny
    d_model=128, fsdp=4 x expert=2; jaxpar/cost/comm_data.fsdp_gathers: not gathered again backward).
    Dense weights, and the experts where the kernel runs without shard_map (fsdp alone), are gathered
    again in the backward pass instead. (The gather happens where the layer scan slices the stacked
    weights, outside any region a jax.checkpoint around the kernel controls.)"""
    routed, _ = zero_split(m, "moe", 3, experts=True)
    return routed.per_device(st.sizes["tensor"], st.sizes["expert"]) * F32


def fsdp_head_bytes(m: ModelConfig, st: Strategy, platform: str = "cpu") -> float:
    """ZeRO-3 over fsdp: the LM head's [d_model, vocab/t] weight gathered whole (compute dtype) and its whole
    float32 gradient, the dot's output before the reduction over fsdp leaves a shard, both alive at the
    head's backward, which opens the backward pass while every layer's activations are still kept (PyTorch's
    FSDP memory accounting has the same term: a unit's unsharded parameters and gradients; XLA:CPU's buffer
    assignment, llama-tiny d_model=1024 vocab=16384 fsdp8: a 64 MiB all-gather or all-reduce output beside the
    64 MiB gradient at the peak). A layer's own gathered weights are far smaller than its activations and sit
    inside the working set; the head's grow with the vocabulary (llama3-8b: 1 GiB of weight, 2 GiB of
    gradient per tensor shard). Not on `platform` tpu: XLA:TPU decomposes FSDP gathers and reduce-scatters
    around big matmuls (jaxpar/cost/compiler.py TPU_GAPS "decomposed-collectives"), and its pod-scale
    compiles (experiments/study_tpu_compile.py (B)) hold no whole head or gradient at the peak. On gpu the
    term is XLA:CPU's reading (no GPU compile checks it)."""
    if st.zero != 3 or st.sizes["fsdp"] == 1 or platform == "tpu":
        return 0.0
    return m.d_model * m.vocab / st.sizes["tensor"] * (ACTIVATION_BYTES[st.options.dtype] + F32)
