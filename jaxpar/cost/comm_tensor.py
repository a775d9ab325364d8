"""Tensor (and sequence) parallelism's collectives: the Megatron f/g operators (Shoeybi et al. 2019;
Korthikanti et al. 2022) per layer execution, the vocab-parallel embedding and head, the norms' gradient
sums under sequence parallelism. Records are (kind, axes, count, mean bytes per op, phase) as
jaxpar/cost/compiler.py's `site` writes them; comm.predicted merges them. What a pipeline of jaxpar's
recomputes beyond a layer's own remat is passed in (`recomputed`, `rerun_chunk`: program_pipeline.py)."""
from __future__ import annotations

from jaxpar.cost.compiler import AG, AR, PERMUTE, RS, Compiler, ar_bytes, input_grad_sums, input_grads, scattered, site
from jaxpar.cost.memory import GRAD_BYTES
from jaxpar.cost.params import attention_block_params, layer_counts, mamba_block_params
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


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


def recomputed_tp(st: Strategy) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer that run again in its backward pass, a layer
    recomputed on its own (Megatron's per-layer recompute, jaxpar outside a pipeline): remat `full` reruns
    both gathers and the attention sum (the MLP's is the layer's output: dead), the `dots` policies the
    gathers only (no dot outputs). jaxpar's pipelines recompute more: program_pipeline.recomputed_tp."""
    remat = st.options.remat
    return (2 if remat != "none" else 0), (1 if remat == "full" else 0)


def tp_attention(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float,
                 recomputed: tuple[int, int]) -> list[tuple]:
    """Per attention-layer execution (x: the residual activation, xr: as all-reduced).
    Forward: after o-proj and after the MLP down-proj an all-reduce (SP: all-gather of the norm output
    before each, reduce-scatter after). Recompute (remat `full`): the attention one again (the MLP's is
    dead: a layer's output is not needed for its own gradient; SP: both gathers and the attention
    reduce-scatter; under the `dots` policies too the gathers run again, their outputs being no dot
    outputs): `recomputed`, the (gathers, sums) run again (`recomputed_tp`, or a pipeline's). Backward: the
    input gradients of q,k,v and of gate,up are all-reduced, one sum each with reassociation, one per
    projection without it (SP: reduce-scattered; the gathers' transposes are reduce-scatters and the
    reduce-scatters' are all-gathers).
    Under overlap=collective_matmul the gathers and scatters are rings (`tp_rings`): q/k/v's gather,
    o's scatter, gate/up's gather and down's scatter; remat recomputes all but down's (dead)."""
    e, sp, out = shape.exec_attention, st.options.sequence_parallel, []
    if st.options.overlap != "none":
        return tp_rings(cc, st, e, xr, forward=4, recomputed=3)
    ax = ("tensor",)
    fwd_kind = RS if sp else AR
    fwd_x = scattered(cc, x, xr) if sp else xr
    for _ in range(2):
        if sp:
            out += site(cc, AG, ax, e, [x], "forward")
        out += site(cc, fwd_kind, ax, e, [fwd_x], "forward")
    gathers, sums = recomputed
    if sp:
        out += site(cc, AG, ax, e, [x], "backward") * gathers
    out += site(cc, fwd_kind, ax, e, [fwd_x], "backward") * sums
    if sp:
        out += site(cc, AG, ax, e, [x], "backward") + site(cc, AG, ax, e, [x], "backward")
    out += input_grad_sums(cc, fwd_kind, ax, e, fwd_x, xr, 3, "backward")   # q, k, v's input gradients
    return out + input_grad_sums(cc, fwd_kind, ax, e, fwd_x, xr, 2, "backward")   # gate and up's


def tp_mamba(cc: Compiler, st: Strategy, shape: StepShape, x: float, xr: float,
             rerun_chunk: bool = False) -> list[tuple]:
    """Per Mamba-layer execution: all-reduce after out_proj forward (SP: gather before in_proj,
    reduce-scatter after out_proj), and of in_proj's input gradient backward (in_proj is one packed
    matmul, so one partial sum; SP: the transposes). Recompute adds nothing live (the out_proj sum
    is the layer's output), but a schedule that reruns each chunk in its backward (`rerun_chunk`: jaxpar's
    1F1B, jaxpar/pipeline/one_f_one_b.py) with k > 1 slots."""
    e, sp, ax = shape.exec_mamba, st.options.sequence_parallel, ("tensor",)
    again = site(cc, RS if sp else AR, ax, e, [scattered(cc, x, xr) if sp else xr], "backward")
    again = again if rerun_chunk and shape.per_chunk > 1 else []   # live when a slot feeds the next
    if not sp:
        return site(cc, AR, ax, e, [xr], "forward") + site(cc, AR, ax, e, [xr], "backward") + again
    rs = scattered(cc, x, xr)
    regather = site(cc, AG, ax, e, [x], "backward") * (int(st.options.remat != "none") + int(rerun_chunk))  # no dot
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
    fwd_x = scattered(cc, x, xr) if sp else xr
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
    qkv = [] if rings else input_grads(cc, xr, 3)
    gate_up = input_grads(cc, xr, 2) if shared else []
    return out + site(cc, AR, ax, e, qkv, "backward") + site(cc, AR, ax, e, [xr, w] + gate_up, "backward")


def tp_vocab(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, act: int,
             label_phase: str | None = "forward") -> list[tuple]:
    """Vocab-sharded embedding and head, once per accumulation step (head outside the pipeline):
    forward the embedding output is summed over `tensor` (SP: reduce-scattered), the head input is
    gathered under SP, the softmax max and sum-exp are all-reduced (T*4 bytes each), and so is the
    label's logit (T*4; only the loss value needs it, so a combiner may issue it with a later all-reduce
    over `tensor`: `label_phase`, None where it joins another op, compiler_comm.label_phase); backward
    the head input gradient is all-reduced (SP: reduce-scattered) and, under SP, the embedding output
    gradient gathered. Under pipeline parallelism the embedding sees every micro-batch but the head only
    its stage's ceil(M/S) (jaxpar/pipeline/gpipe.py)."""
    tokens = shape.b_loc / shape.accum * shape.s_loc
    head = shape.head_micro * shape.mb * shape.s_loc if shape.stages > 1 else tokens
    x, xr, n = tokens * m.d_model * act, tokens * m.d_model * ar_bytes(cc, act), shape.accum
    hx, hxr = head * m.d_model * act, head * m.d_model * ar_bytes(cc, act)
    sp, ax = st.options.sequence_parallel, ("tensor",)
    rs, hrs = scattered(cc, x, xr), scattered(cc, hx, hxr)
    out = site(cc, RS if sp else AR, ax, n, [rs if sp else xr], "forward")
    out += site(cc, AR, ax, n, [head * 4], "forward") + site(cc, AR, ax, n, [head * 4], "forward")
    out += site(cc, RS if sp else AR, ax, n, [hrs if sp else hxr], "backward")
    if sp:
        out += site(cc, AG, ax, n, [hx], "forward") + site(cc, AG, ax, n, [x], "backward")
    return out + (site(cc, AR, ax, n, [head * 4], label_phase) if label_phase else [])


def sp_norms(m: ModelConfig, shape: StepShape) -> list[tuple]:
    """Under SP the norm weights see sequence shards: their gradients are summed over `tensor`, once per
    step in one op (the sums hoisted out of the layer loop; where a backend leaves them in it:
    compiler_comm.sp_norms_in_loop). An MoE block's two norms count as an attention block's (its router
    sees the gathered norm output: replicated, nothing to sum)."""
    d = m.d_model
    na, nm = layer_counts(m)
    reps = (na * attention_block_params(m).replicated + nm * mamba_block_params(m).replicated + m.moe_layers * 2 * d)
    return [(AR, ("tensor",), 1, (reps / shape.stages + d) * GRAD_BYTES, "backward")]


def tensor_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                    recomputed: tuple[int, int], rerun_chunk: bool = False) -> list[tuple]:
    """The layers' sums: attention layer 2 per pass (after o-proj, after MLP down), Mamba-2 layer 1 (after
    out_proj), MoE layer as `tp_moe`; `recomputed` and `rerun_chunk` as `tp_attention` and `tp_mamba` take
    them. The embedding and head (`tp_vocab`) and the norms (`sp_norms`) are comm.predicted's next lines."""
    x = shape.mb * shape.s_loc * m.d_model * act
    xr = shape.mb * shape.s_loc * m.d_model * ar_bytes(cc, act)
    out = tp_attention(cc, st, shape, x, xr, recomputed) if shape.exec_attention else []
    out += tp_mamba(cc, st, shape, x, xr, rerun_chunk) if shape.exec_mamba else []
    out += tp_moe(cc, st, shape, m, x, xr) if shape.exec_moe else []
    return out
