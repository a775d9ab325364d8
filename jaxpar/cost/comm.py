"""Predicted collectives of one training step: kind x mesh axes x phase, per device.

Records are the HLO tally's own `jaxpar.collectives.Collective` (kind, axes, count, bytes, wire_bytes, phase),
so a prediction and the compiled program's tally compare field by field. `bytes` is the full
(gathered / pre-scatter / reduced) buffer of each instance, summed over instances; `wire_bytes` is
what one device sends under the ring algorithm (`jaxpar.collectives.wire_factor`). Each parallelism has
one small function (data parallelism, ZeRO and FSDP in jaxpar/cost/comm_data.py), so a formula is easy
to adjust once it is checked against the compiled HLO (tests/test_cost_vs_hlo.py does, for every
8-device strategy on XLA:CPU).
Counts multiply layer executions (scan and pipeline trip counts included). Recomputed forward
collectives (remat `full`) are tallied under `backward`.

What XLA's passes make of the collectives a program asks for differs by backend: jaxpar/cost/compiler.py
states them as data (`Compiler`: GPU, TPU, CPU), and every function below takes one.
"""
from __future__ import annotations

from jaxpar.collectives import Collective, wire_factor  # the HLO tally's record and ring model: shared
from jaxpar.cost.comm_data import data_parallel
from jaxpar.cost.comm_pipeline import one_f_one_b_head, one_f_one_b_recomputed, pipeline_parallel
from jaxpar.cost.compiler import A2A, AG, AR, COMPILERS, GPU, PERMUTE, RS, Compiler, ar_bytes, reductions, site
from jaxpar.cost.flops import expert_rows
from jaxpar.cost.held import DATA_LIKE
from jaxpar.cost.memory import DTYPE_BYTES, GRAD_BYTES, TOKEN_BYTES
from jaxpar.cost.params import attention_block_params, layer_counts, mamba_block_params, mamba_dims
from jaxpar.cost.program_comm import moe_stage_copies
from jaxpar.cost.shape import StepShape, one_f_one_b
from jaxpar.cost.software import JAXPAR, Software
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def record(kind: str, axes: tuple[str, ...], count: float, nbytes: float, phase: str,
           sizes: dict[str, int]) -> Collective:
    """`count` instances of `nbytes` each over the group spanned by `axes`."""
    n = 1
    for a in axes:
        n *= sizes[a]
    total = count * nbytes
    return Collective(kind, axes, round(count), round(total), total * wire_factor(kind, n), phase)


def _cp_passes(st: Strategy, one_f: bool = False) -> tuple[str, ...]:
    """Passes of the context-parallel kernels' collectives: their outputs (moved K/V blocks, halos,
    states) are no dot outputs, so every remat policy recomputes them in the backward pass (and 1F1B's
    chunk recompute, `one_f`, once more)."""
    return ("forward",) + ("backward",) * (int(st.options.remat != "none") + int(one_f))


def _passes(st: Strategy) -> tuple[str, ...]:
    """Phases in which a layer's forward collectives run: forward, plus backward if recomputed."""
    return ("forward", "backward") if st.options.remat == "full" else ("forward",)


# ---- tensor (+ sequence) parallelism: Megatron f/g operators (Shoeybi et al. 2019; Korthikanti 2022) ---

def tp_rings(cc: Compiler, st: Strategy, execs: float, xr: float, forward: int, recomputed: int) -> list[tuple]:
    """Collective-matmul rings (overlap=collective_matmul[_bidir], jaxpar/ops/collective_matmul.py) for
    `execs` layer executions with `forward` rings each: a ring moves the residual activation xr
    (as permuted: bf16 promoted on XLA:CPU) in tensor-1 steps of one chunk, xr/tensor (bidirectional:
    2 permutes of half a chunk a step). Backward, each ring's transpose is a ring (all-gather <->
    reduce-scatter); remat `full` recomputes `recomputed` of the forward rings (those whose results the
    backward reads)."""
    n, dirs = st.size("tensor"), 2 if st.options.overlap == "collective_matmul_bidir" else 1
    ring = [xr / (n * dirs)] * ((n - 1) * dirs)
    back = forward + (recomputed if st.options.remat == "full" else 0)
    return (site(cc, PERMUTE, ("tensor",), execs * forward, ring, "forward")
            + site(cc, PERMUTE, ("tensor",), execs * back, ring, "backward"))


def recomputed_tp(st: Strategy, shape: StepShape, jaxpar_program: bool = True) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer that run again in its backward pass.
    Outside a pipeline, or in another program's (`jaxpar_program` False: Megatron's recomputes per
    layer): remat `full` reruns both gathers and the attention sum (the MLP's is the layer's output:
    dead), the `dots` policies the gathers only (no dot outputs).
    Inside jaxpar's pipeline (jaxpar/pipeline/gpipe.py) each iteration's stage work is rematerialised under the
    policy, and its vmap over the stages (and over the fsdp shards) gives every weight dot a batch dim,
    so `dots_no_batch` saves none of them and recomputes as `full` does: both sums when a stage runs
    k > 1 unit slots per iteration (a slot's output feeds the next slot), one when k = 1 (the chunk's
    output is dead; XLA drops the one-trip slot loop); `dots` keeps every dot output (no sum again).
    Gathers: any policy but `none` reruns both. XLA:CPU counts, checked
    per policy, k and fsdp in tests/test_verify_scale.py and test_cost_vs_hlo.py's remat cases."""
    remat = st.options.remat
    if one_f_one_b(st, shape, jaxpar_program):
        return one_f_one_b_recomputed(st, shape)
    if shape.stages == 1 or not jaxpar_program:
        return (2 if remat != "none" else 0), (1 if remat == "full" else 0)
    sums = (2 if shape.per_chunk > 1 else 1) if remat in ("full", "dots_no_batch") else 0
    return 2 * (remat != "none"), sums


def tp_attention(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float,
                 jaxpar_program: bool = True) -> list[tuple]:
    """Per attention-layer execution (x: the residual activation, xr: as all-reduced).
    Forward: after o-proj and after the MLP down-proj an all-reduce (SP: all-gather of the norm output
    before each, reduce-scatter after). Recompute (remat `full`): the attention one again (the MLP's is
    dead: a layer's output is not needed for its own gradient; SP: both gathers and the attention
    reduce-scatter; under the `dots` policies too the gathers run again, their outputs being no dot
    outputs; under a pipeline: `recomputed_tp`). Backward: the input gradients of q,k,v and of gate,up
    are all-reduced, one sum each with reassociation, one per projection without it (SP:
    reduce-scattered; the gathers' transposes are reduce-scatters and the reduce-scatters' are all-gathers).
    Under overlap=collective_matmul the gathers and scatters are rings (`tp_rings`): q/k/v's gather,
    o's scatter, gate/up's gather and down's scatter; remat recomputes all but down's (dead)."""
    e, sp, out = shape.exec_attention, st.options.sequence_parallel, []
    if st.options.overlap != "none":
        return tp_rings(cc, st, e, xr, forward=4, recomputed=3)
    ax = ("tensor",)
    fwd_kind = RS if sp else AR
    fwd_x = x if (sp and cc.reduce_scatter) else xr
    for _ in range(2):
        if sp:
            out += site(cc, AG, ax, e, [x], "forward")
        out += site(cc, fwd_kind, ax, e, [fwd_x], "forward")
    gathers, sums = recomputed_tp(st, shape, jaxpar_program)
    if sp:
        out += site(cc, AG, ax, e, [x], "backward") * gathers
    out += site(cc, fwd_kind, ax, e, [fwd_x], "backward") * sums
    if sp:
        out += site(cc, AG, ax, e, [x], "backward") + site(cc, AG, ax, e, [x], "backward")
    if cc.reassociate:
        out += site(cc, fwd_kind, ax, e, [fwd_x], "backward") + site(cc, fwd_kind, ax, e, [fwd_x], "backward")
    else:  # q, k, v and gate, up input gradients: all-reduced (sliced afterwards under SP)
        out += site(cc, AR, ax, e, [xr] * 3, "backward") + site(cc, AR, ax, e, [xr] * 2, "backward")
    return out


def tp_mamba(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float,
             jaxpar_program: bool = True) -> list[tuple]:
    """Per Mamba-layer execution: all-reduce after out_proj forward (SP: gather before in_proj,
    reduce-scatter after out_proj), and of in_proj's input gradient backward (in_proj is one packed
    matmul, so one partial sum; SP: the transposes). Recompute adds nothing live (the out_proj sum
    is the layer's output), but 1F1B's chunk recompute (jaxpar/pipeline/one_f_one_b.py) with k > 1 slots."""
    e, sp, ax = shape.exec_mamba, st.options.sequence_parallel, ("tensor",)
    one_f = one_f_one_b(st, shape, jaxpar_program)
    again = site(cc, RS if sp else AR, ax, e, [(x if cc.reduce_scatter else xr) if sp else xr], "backward")
    again = again if one_f and shape.per_chunk > 1 else []   # 1F1B's recompute: live when a slot feeds the next
    if not sp:
        return site(cc, AR, ax, e, [xr], "forward") + site(cc, AR, ax, e, [xr], "backward") + again
    rs = x if cc.reduce_scatter else xr
    regather = site(cc, AG, ax, e, [x], "backward") * (int(st.options.remat != "none") + int(one_f))  # no dot output
    return (site(cc, AG, ax, e, [x], "forward") + site(cc, RS, ax, e, [rs], "forward")
            + site(cc, AG, ax, e, [x], "backward") + site(cc, RS, ax, e, [rs], "backward") + regather + again)


def tp_moe(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, x: float, xr: float) -> list[tuple]:
    """Per MoE-layer execution (models/moe.py, jaxpar/ops/moe.py), the experts' width split over `tensor`.
    Forward: the attention half's all-reduce after o-proj, and one psum of the combined expert output
    [tokens, d] (the combine is linear, so the kernel sums after it, not the E-times-larger buffers);
    shared experts add a row-parallel MLP's. Recompute (remat `full`): the attention one again (the
    experts' sum is the layer's output: dead). Backward: q,k,v's input gradients (as `tp_attention`),
    the tokens' gradient at the kernel's entry and the router weights' gradient [tokens, k] float32
    (each copy's output is a partial sum over `tensor`); shared experts: gate and up's input gradients.
    Under sequence parallelism the attention half is `tp_attention`'s and the norm output entering the
    MoE is gathered over `tensor`; the experts' sum stays an all-reduce (the kernel's psum).
    Under overlap=collective_matmul the attention half's gather and scatter are rings (`tp_rings`: q/k/v's
    gather and o's scatter, both recomputed under remat), and so are q/k/v's input gradients; the MoE's
    input is still gathered (once, for the router and the experts) and its output sliced."""
    e, sp, ax, out = shape.exec_moe, st.options.sequence_parallel, ("tensor",), []
    w = shape.mb * shape.s_loc * m.top_k * 4
    fwd_kind = RS if sp else AR
    fwd_x = x if (sp and cc.reduce_scatter) else xr
    shared = bool(m.shared_experts)
    rings = st.options.overlap != "none"
    gathers = 1 if rings else 2
    if sp:
        out += site(cc, AG, ax, e, [x], "forward") * gathers + site(cc, AG, ax, e, [x], "backward") * gathers
    out += [] if rings else site(cc, fwd_kind, ax, e, [fwd_x], "forward")
    out += site(cc, AR, ax, e, [xr] * (1 + shared), "forward")
    if st.options.remat == "full":
        out += [] if rings else site(cc, fwd_kind, ax, e, [fwd_x], "backward")
    if sp and st.options.remat != "none":  # the gathered inputs again (no dot outputs)
        out += site(cc, AG, ax, e, [x], "backward") * gathers
    if rings:
        out += tp_rings(cc, st, e, xr, forward=2, recomputed=2)
    qkv = [] if rings else [xr] if cc.reassociate else [xr] * 3
    gate_up = ([xr] if cc.reassociate else [xr] * 2) if shared else []
    return out + site(cc, AR, ax, e, qkv, "backward") + site(cc, AR, ax, e, [xr, w] + gate_up, "backward")


def tp_vocab(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """Vocab-sharded embedding and head, once per accumulation step (head outside the pipeline):
    forward the embedding output is summed over `tensor` (SP: reduce-scattered), the head input is
    gathered under SP, the softmax max and sum-exp are all-reduced (T*4 bytes each), and so is the
    label's logit (T*4; only the loss value needs it, so XLA:CPU's combiner merges it with the next
    all-reduce over `tensor`); backward the head input gradient is all-reduced (SP:
    reduce-scattered) and, under SP, the embedding output gradient gathered. Under pipeline parallelism
    the embedding sees every micro-batch but the head only its stage's ceil(M/S) (jaxpar/pipeline/gpipe.py)."""
    tokens = shape.b_loc / shape.accum * shape.s_loc
    head = shape.head_micro * shape.mb * shape.s_loc if shape.stages > 1 else tokens
    x, xr, n = tokens * m.d_model * act, tokens * m.d_model * ar_bytes(cc, act), shape.accum
    hx, hxr = head * m.d_model * act, head * m.d_model * ar_bytes(cc, act)
    sp, ax = st.options.sequence_parallel, ("tensor",)
    rs, hrs = (x, hx) if cc.reduce_scatter else (xr, hxr)
    out = site(cc, RS if sp else AR, ax, n, [rs if sp else xr], "forward")
    out += site(cc, AR, ax, n, [head * 4], "forward") + site(cc, AR, ax, n, [head * 4], "forward")
    out += site(cc, RS if sp else AR, ax, n, [hrs if sp else hxr], "backward")
    if sp:
        out += site(cc, AG, ax, n, [hx], "forward") + site(cc, AG, ax, n, [x], "backward")
    if not (sp and cc.combine):  # under SP and the combiner it rides with the final-norm gradient
        out += site(cc, AR, ax, n, [head * 4], "optimizer" if cc.combine else "forward")
    return out


def sp_norms(cc: Compiler, m: ModelConfig, shape: StepShape, final: bool = True) -> list[tuple]:
    """Under SP the norm weights see sequence shards: their gradients are summed over `tensor`.
    Hoisted: once per step; else in the layer loop, per layer execution, and the final norm's
    after it (with the combiner, together with the label-logit sum; `final` False: the final norm's sum
    is elsewhere, 1F1B's per tick). An MoE block's two norms count as an attention block's (its router
    sees the gathered norm output: replicated, nothing to sum)."""
    ax, d = ("tensor",), m.d_model
    na, nm = layer_counts(m)
    if cc.hoist:
        reps = (na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated
                + m.moe_layers * 2 * d)
        return [(AR, ax, 1, (reps / shape.stages + d) * GRAD_BYTES, "backward")]
    tokens = shape.b_loc / shape.accum * shape.s_loc   # the label logits': a pipeline stage's head micro-batches
    if shape.stages > 1:
        tokens = shape.head_micro * shape.mb * shape.s_loc
    out = site(cc, AR, ax, shape.exec_attention + shape.exec_moe, [d * GRAD_BYTES] * 2, "backward")
    out += site(cc, AR, ax, shape.exec_mamba, [d * GRAD_BYTES], "backward")
    last = [d * GRAD_BYTES] + ([tokens * 4] if cc.combine else [])
    return out + (site(cc, AR, ax, 1, last, "optimizer") if final else [])


def tensor_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU,
                    jaxpar_program: bool = True) -> list[tuple]:
    """Attention layer: 2 per pass (after o-proj, after MLP down); Mamba-2 layer: 1 (after out_proj).
    `jaxpar_program`: the step is jaxpar's program, so a pipeline is its own (jaxpar/pipeline/gpipe.py)."""
    x = shape.mb * shape.s_loc * m.d_model * act
    xr = shape.mb * shape.s_loc * m.d_model * ar_bytes(cc, act)
    out = tp_attention(cc, st, shape, x, xr, jaxpar_program) if shape.exec_attention else []
    out += tp_mamba(cc, st, shape, x, xr, jaxpar_program) if shape.exec_mamba else []
    out += tp_moe(cc, st, shape, m, x, xr) if shape.exec_moe else []
    one_f = one_f_one_b(st, shape, jaxpar_program)
    out += one_f_one_b_head(cc, st, shape, m, act) if one_f else tp_vocab(cc, st, shape, m, act)
    if st.options.sequence_parallel:
        out += sp_norms(cc, m, shape, final=not one_f)
    return out


# ---- context parallelism --------------------------------------------------------------------------

def context_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU,
                     jaxpar_program: bool = True) -> list[tuple]:
    """Attention (jaxpar/ops/context_parallel.py), per layer execution and pass: ring (Liu et al.
    2023): context-1 hops, each a permute of K and one of V (2 ops of the local block's half each),
    and of dK, dV backward; the key positions travel the ring once per step (c-1 int32 permutes);
    all-gather: K and V gathered (2 ops) forward, dK and dV reduce-scattered backward (hand-written:
    reduce-scatters on every backend), the positions gathered once.
    Mamba-2 (jaxpar/ops/mamba_cp.py): per pass one permute of the packed conv halo ((d_conv-1)
    tokens x conv channels; zigzag: two, one from each neighbour) and one all-gather of every
    segment's final SSM state and log-decay (b*m*heads/t*(head_dim*d_state + 1) float32 per shard,
    m = 1 or 2 segments); their transposes backward. In jaxpar's pipelines the positions travel per
    schedule iteration, a micro-batch's each (1F1B: per backward tick, and per forward tick with a
    one-hop ring, per layer execution with a longer one)."""
    c, t = st.sizes["context"], st.sizes["tensor"]
    ax, out = ("context",), []
    piped, one_f = jaxpar_program and shape.stages > 1, one_f_one_b(st, shape, jaxpar_program)
    if piped:   # 1F1B's forward ticks: per layer execution when the ring is a loop (c > 2: XLA does not hoist it)
        ticks = shape.iterations * shape.accum
        forward = shape.exec_attention + shape.exec_moe if one_f and c > 2 else ticks
        pos_execs, pos_one = forward + (ticks if one_f else 0), shape.mb * shape.s_loc * TOKEN_BYTES
    else:
        pos_execs, pos_one = shape.accum, shape.b_loc / shape.accum * shape.s_loc * TOKEN_BYTES
    zigzag = st.options.cp_layout == "zigzag"
    if shape.exec_attention or shape.exec_moe:
        e = shape.exec_attention + shape.exec_moe  # an MoE block's attention half is an attention block's
        half = shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act  # K or V
        ring = st.options.attention == "ring"
        for phase in _cp_passes(st, one_f):
            out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], phase) if ring
                    else site(cc, AG, ax, e, [half * c, half * c], phase))
        out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], "backward") if ring
                else site(cc, RS, ax, e, [half * c, half * c], "backward", partitioner=False))
        if ring:
            out += site(cc, PERMUTE, ax, (c - 1) * pos_execs, [pos_one], "forward")
            if st.options.remat != "none" and not one_f:  # rematerialised: the positions' ring again, per
                again = shape.iterations * shape.accum if piped else e   # pipeline iteration or layer
                out += site(cc, PERMUTE, ax, (c - 1) * again, [pos_one], "backward")
        else:
            out += site(cc, AG, ax, pos_execs, [pos_one * c], "forward")
    if shape.exec_mamba:
        e, segs = shape.exec_mamba, 2 if zigzag else 1
        _, conv_dim, heads = mamba_dims(m)
        halo = shape.mb * (m.d_conv - 1) * conv_dim / t * act
        state = shape.mb * segs * heads / t * (m.ssm_head_dim * m.d_state + 1) * 4 * c
        for phase in _cp_passes(st, one_f):
            out += site(cc, PERMUTE, ax, e, [halo] * segs, phase) + site(cc, AG, ax, e, [state], phase)
        out += site(cc, PERMUTE, ax, e, [halo] * segs, "backward")
        out += site(cc, RS, ax, e, [state], "backward", partitioner=False)
    return out


# ---- mixture of experts: expert parallelism and the router's statistics --------------------------

def expert_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU,
                    padded: bool = True) -> list[tuple]:
    """Per MoE-layer execution (jaxpar/ops/moe.py). Under expert > 1, the dispatch buffers go to the
    experts' owners and back: two all-to-alls over `expert` forward and their two transposes backward
    (two more backward under remat `full`), each moving a device's whole buffer
        E x g x C_loc x d x act bytes,   g = sequences per micro-batch, C_loc = min(s_loc, C),
    C the per-sequence capacity (dropless: the sequence; capacity mode: ceil(cf * s * k / E)), so a
    dropless kernel sends E/k times the copies that exist (static buffers; the price of XLA's static
    shapes, see `jaxpar.ops.moe`); `padded=False` (Megatron's token dispatcher) sends only the routed
    copies, g x s_loc x k x d x act. Under `context` each shard all-gathers every shard's per-(choice,
    expert) queue counts (g*k*E int32). The balance loss needs each expert's load and mean router
    probability over the whole batch: one all-reduce of 2E float32 per layer over the batch axes (and
    `context`); its scalars (z-loss, dropped fraction) are not predicted (module docstring), but inside
    jaxpar's pipeline they are [1, 1] arrays (2E + 2 floats). With the pipeline's per-data-shard copies
    (program_comm.moe_stage_copies) the sums run over the other axes in the loop, and the accumulated
    statistics of the stage's v*k unit slots over `data` once per accumulation step."""
    sz, e = st.sizes, shape.exec_moe
    c = sz["context"]
    out = []
    if sz["expert"] > 1:  # the buffer's rows per token as the FLOPs count them (flops.expert_rows)
        rows = expert_rows(m, round(shape.s_loc * c), c, padded)
        buf = rows * shape.s_loc * shape.mb * m.d_model * act
        out += site(cc, A2A, ("expert",), 2 * e, [buf], "forward")
        out += site(cc, A2A, ("expert",), (4 if st.options.remat == "full" else 2) * e, [buf], "backward")
    if c > 1:
        counts = shape.mb * m.top_k * m.experts * TOKEN_BYTES * c
        for phase in _passes(st):
            out += site(cc, AG, ("context",), e, [counts], phase)
    stats = tuple(a for a in DATA_LIKE if sz[a] > 1)
    per = (2 * m.experts + (2 if shape.stages > 1 else 0)) * 4
    if moe_stage_copies(st, shape):
        stats = tuple(a for a in stats if a != "data")
        out += site(cc, AR, ("data",), shape.accum, [shape.repeats * shape.per_chunk * per], "forward")
    for group in reductions(cc, st, stats):   # (the balance loss's gradient reads the summed probabilities:
        out += site(cc, AR, group, e, [per], "forward")   # no sum again under remat, models/moe.py)
    return out


# ---- all of it ---------------------------------------------------------------------------------------

def predicted(m: ModelConfig, st: Strategy, shape: StepShape, software: Software = JAXPAR,
              compiler: Compiler = GPU) -> tuple[tuple, ...]:
    """Every predicted collective of one step of `software` as (kind, axes, phase, count, total bytes),
    merged by (kind, axes, phase). Plain tuples: the time model reads them thousands of times per second."""
    sz, cc, own = st.sizes, compiler, software.jaxpar_program
    act = 4 if cc.promote_bf16 else DTYPE_BYTES[st.options.dtype]  # XLA:CPU moves bf16 as float32
    raw = data_parallel(m, st, shape, act, cc, software.param_gather_bytes, own)
    if sz["tensor"] > 1:
        raw += tensor_parallel(m, st, shape, act, cc, own)
    if sz["context"] > 1:
        raw += context_parallel(m, st, shape, act, cc, own)
    if sz["pipeline"] > 1:
        raw += pipeline_parallel(m, st, shape, act, cc, software.pp_scatter_gather, own)
    if shape.exec_moe:
        raw += expert_parallel(m, st, shape, act, cc, software.moe_padded)
    merged: dict[tuple, list[float]] = {}
    for kind, axes, count, nbytes, phase in raw:
        key = (kind, axes, phase)
        acc = merged.get(key)
        if acc is None:
            merged[key] = [count, count * nbytes]
        else:
            acc[0] += count
            acc[1] += count * nbytes
    return tuple((kind, axes, phase, count, total) for (kind, axes, phase), (count, total) in merged.items())


def to_records(merged: tuple[tuple, ...], sizes: dict[str, int]) -> list[Collective]:
    """`predicted` tuples as `Collective` records (with ring-model wire bytes)."""
    return [record(kind, axes, count, total / count if count else 0.0, phase, sizes)
            for kind, axes, phase, count, total in merged]


def collectives(m: ModelConfig, st: Strategy, shape: StepShape, software: Software = JAXPAR,
                compiler: Compiler | str = GPU) -> list[Collective]:
    """Every predicted collective of one step, as `Collective` records merged by (kind, axes, phase)."""
    cc = COMPILERS[compiler] if isinstance(compiler, str) else compiler
    return to_records(predicted(m, st, shape, software, cc), st.sizes)
