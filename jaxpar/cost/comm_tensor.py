"""Tensor (and sequence) parallelism's collectives: Megatron's f and g operators per layer execution
(Shoeybi et al. 2019, section 3: a column-parallel GEMM's input gradient and a row-parallel GEMM's output are
partial sums over `tensor`, one all-reduce each), the vocab-parallel embedding and head, and under sequence
parallelism each all-reduce as a reduce-scatter onto the sequence-sharded residual stream and the
all-gather that brings it back (Korthikanti et al. 2022, section 4.2.2, fig. 5), with the norms' gradient
sums. `x` is one micro-batch's residual stream [b, s, d] on a device, in bytes. Sites as
jaxpar/cost/sites.py records them; what a compiler that does not reassociate or that combines makes of them
is jaxpar/cost/compiler.py's, what jaxpar's pipelines recompute beyond a layer's remat program_pipeline.py's.
"""
from __future__ import annotations

from jaxpar.collectives import AG, AR, PERMUTE, RS
from jaxpar.cost import sites
from jaxpar.cost.memory import GRAD_BYTES
from jaxpar.cost.params import attention_block_params, layer_counts, mamba_block_params
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

TENSOR = ("tensor",)


def residual(m: ModelConfig, shape: StepShape, act: int) -> float:
    """Bytes of one micro-batch's residual stream on a device (whole over `tensor`): mb x s_loc x d x act."""
    return shape.mb * shape.s_loc * m.d_model * act


def tp_rings(st: Strategy, execs: float, x: float, forward: int, recomputed: int) -> list[tuple]:
    """Collective-matmul rings (overlap=collective_matmul[_bidir], jaxpar/ops/collective_matmul.py) for
    `execs` layer executions with `forward` rings each: a ring moves `x` in tensor-1 steps of one chunk,
    x/tensor (bidirectional: 2 permutes of half a chunk a step). Backward each ring's transpose is a ring
    (all-gather <-> reduce-scatter); remat `full` recomputes `recomputed` of the forward rings."""
    n, dirs = st.size("tensor"), 2 if st.options.overlap == "collective_matmul_bidir" else 1
    ring = [x / (n * dirs)] * ((n - 1) * dirs)
    back = forward + (recomputed if st.options.remat == "full" else 0)
    return (sites.issue(PERMUTE, TENSOR, execs * forward, ring, "forward")
            + sites.issue(PERMUTE, TENSOR, execs * back, ring, "backward"))


def recomputed_tp(st: Strategy) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer run again in its backward pass, the layer
    recomputed on its own: remat `full` reruns both gathers and the attention sum (the MLP's is the layer's
    output: dead), the `dots` policies the gathers only (their outputs are no dot outputs)."""
    remat = st.options.remat
    return (2 if remat != "none" else 0), (1 if remat == "full" else 0)


def reruns(st: Strategy, execs: float, x: float, gathers: int, sums: int) -> list[tuple]:
    """`gathers` SP all-gathers and `sums` row-parallel sums of `x` run again in the backward pass, per
    layer execution (the gathers only under sequence parallelism)."""
    sp = st.options.sequence_parallel
    out = sites.issue(AG, TENSOR, execs, [x], "backward") * gathers if sp else []
    return out + sites.issue(RS if sp else AR, TENSOR, execs, [x], "backward") * sums


def tp_attention(st: Strategy, shape: StepShape, x: float) -> list[tuple]:
    """Per attention-layer execution. Forward: after o-proj and after the MLP's down-projection an
    all-reduce (SP: an all-gather of the norm output before each, a reduce-scatter after). Recompute:
    `recomputed_tp`. Backward: the input gradients of q, k, v and of gate, up, one sum each (SP:
    reduce-scattered; the gathers' transposes are reduce-scatters and the scatters' all-gathers; under
    fp8_sp_gather the forward's gathers, and their reruns, move float8: half the bytes). Under
    overlap=collective_matmul the gathers and scatters are rings (`tp_rings`): q/k/v's gather, o's scatter,
    gate/up's gather and down's scatter; remat recomputes all but down's (dead)."""
    e, sp = shape.exec_attention, st.options.sequence_parallel
    if st.options.overlap != "none":
        return tp_rings(st, e, x, forward=4, recomputed=3)
    kind, out = RS if sp else AR, []
    g = x / 2 if st.options.fp8_sp_gather else x   # the normed input gathered as float8 (XLA:CPU: float16, x float32)
    for _ in range(2):
        out += (sites.issue(AG, TENSOR, e, [g], "forward") if sp else []) + sites.issue(kind, TENSOR, e, [x], "forward")
    gathers, sums = recomputed_tp(st)
    out += reruns(st, e, g, gathers, 0) + reruns(st, e, x, 0, sums)
    out += sites.issue(AG, TENSOR, e, [x], "backward") * 2 if sp else []
    out += sites.issue(kind, TENSOR, e, [x], "backward", sites.input_grads(2, x))    # q, k, v's input gradients
    return out + sites.issue(kind, TENSOR, e, [x], "backward", sites.input_grads(1, x))   # gate and up's


def tp_mamba(st: Strategy, shape: StepShape, x: float) -> list[tuple]:
    """Per Mamba-layer execution: an all-reduce after out_proj forward (SP: a gather before in_proj, a
    reduce-scatter after out_proj), and of in_proj's input gradient backward (one packed matmul, so one
    partial sum; SP: the transposes). Recompute adds nothing live (the out_proj sum is the layer's output)
    but the gathered input under SP (no dot output)."""
    e, sp = shape.exec_mamba, st.options.sequence_parallel
    if not sp:
        return sites.issue(AR, TENSOR, e, [x], "forward") + sites.issue(AR, TENSOR, e, [x], "backward")
    regather = sites.issue(AG, TENSOR, e, [x], "backward") * int(st.options.remat != "none")
    return (sites.issue(AG, TENSOR, e, [x], "forward") + sites.issue(RS, TENSOR, e, [x], "forward")
            + sites.issue(AG, TENSOR, e, [x], "backward") + sites.issue(RS, TENSOR, e, [x], "backward") + regather)


def tp_moe(st: Strategy, shape: StepShape, m: ModelConfig, x: float) -> list[tuple]:
    """Per MoE-layer execution (models/moe.py, jaxpar/ops/moe.py), the experts' width split over `tensor`.
    Forward: the attention half's all-reduce after o-proj, and one psum of the combined expert output
    [tokens, d] (the combine is linear, so the kernel sums after it); shared experts add a row-parallel
    MLP's. Recompute (remat `full`): the attention one again. Backward: q, k, v's input gradients, the
    tokens' gradient at the kernel's entry and the router weights' gradient [tokens, k] float32 (each
    copy's output is a partial sum over `tensor`); shared experts: gate and up's input gradients. Under SP
    the attention half is `tp_attention`'s and the norm output entering the MoE is gathered; the experts'
    sum stays an all-reduce (the kernel's psum). Under overlap=collective_matmul the attention half's
    gather and scatter, and q, k, v's input gradients, are rings (`tp_rings`)."""
    e, sp = shape.exec_moe, st.options.sequence_parallel
    w = shape.mb * shape.s_loc * m.top_k * 4
    kind, rings = RS if sp else AR, st.options.overlap != "none"
    gathers, out = 1 if rings else 2, []
    if sp:
        out += sites.issue(AG, TENSOR, e, [x], "forward") * gathers + sites.issue(AG, TENSOR, e, [x], "backward") * gathers
    out += [] if rings else sites.issue(kind, TENSOR, e, [x], "forward")
    out += sites.issue(AR, TENSOR, e, [x] * (1 + bool(m.shared_experts)), "forward")
    if st.options.remat == "full":
        out += [] if rings else sites.issue(kind, TENSOR, e, [x], "backward")
    if sp and st.options.remat != "none":  # the gathered inputs again (no dot outputs)
        out += sites.issue(AG, TENSOR, e, [x], "backward") * gathers
    if rings:
        out += tp_rings(st, e, x, forward=2, recomputed=2)
    else:
        out += sites.issue(AR, TENSOR, e, [x], "backward", sites.input_grads(2, x))
    gate_up = sites.input_grads(1, x) if m.shared_experts else ""
    return out + sites.issue(AR, TENSOR, e, [x, w] + ([x] if m.shared_experts else []), "backward", gate_up)


def tp_vocab(st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """Vocab-sharded embedding and head, once per accumulation step: forward the embedding output summed over
    `tensor` (SP: reduce-scattered), the head input gathered under SP, the softmax max and sum-exp all-reduced
    (T x 4 bytes each), and the label's logit (T x 4; only the loss value reads it: `sites.LABEL`); backward
    the head input gradient all-reduced (SP: reduce-scattered) and, under SP, the embedding output gradient
    gathered. Under pipeline parallelism the head sees only its stage's ceil(M/S) micro-batches."""
    tokens = shape.b_loc / shape.accum * shape.s_loc
    head = shape.head_micro * shape.mb * shape.s_loc if shape.stages > 1 else tokens
    x, hx, n = tokens * m.d_model * act, head * m.d_model * act, shape.accum
    sp, vocab = st.options.sequence_parallel, sites.VOCAB
    out = sites.issue(RS if sp else AR, TENSOR, n, [x], "forward", vocab)
    out += sites.issue(AR, TENSOR, n, [head * 4], "forward", vocab) + sites.issue(AR, TENSOR, n, [head * 4], "forward", vocab)
    out += sites.issue(RS if sp else AR, TENSOR, n, [hx], "backward", vocab)
    if sp:
        out += sites.issue(AG, TENSOR, n, [hx], "forward", vocab) + sites.issue(AG, TENSOR, n, [x], "backward", vocab)
    return out + sites.issue(AR, TENSOR, n, [head * 4], "forward", sites.LABEL)


def sp_norms(m: ModelConfig, shape: StepShape) -> list[tuple]:
    """Under SP the norm weights see sequence shards: their gradients summed over `tensor` once per step in
    one op (after the layer loop). An MoE block's two norms count as an attention block's (its router sees
    the gathered norm output: replicated, nothing to sum)."""
    d = m.d_model
    na, nm = layer_counts(m)
    reps = na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated + m.moe_layers * 2 * d
    return sites.issue(AR, TENSOR, 1, [(reps / shape.stages + d) * GRAD_BYTES], "backward", sites.SP_NORMS)


def tensor_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """Every tensor-parallel collective of a step: the layers' (attention 2 sums per pass, Mamba-2 1, MoE as
    `tp_moe`), the embedding and head's (`tp_vocab`) and, under SP, the norms' (`sp_norms`)."""
    x = residual(m, shape, act)
    out = tp_attention(st, shape, x) if shape.exec_attention else []
    out += tp_mamba(st, shape, x) if shape.exec_mamba else []
    out += tp_moe(st, shape, m, x) if shape.exec_moe else []
    out += tp_vocab(st, shape, m, act)
    return out + (sp_norms(m, shape) if st.options.sequence_parallel else [])
