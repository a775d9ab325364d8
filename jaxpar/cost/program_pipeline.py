"""The collectives jaxpar's own pipelines (jaxpar/pipeline/gpipe.py, one_f_one_b.py) issue beyond the
textbook's stage-to-stage sends (comm_pipeline.py), and what they recompute beyond a layer's own remat
policy: each an adjustment comm.predicted applies for `Software.jaxpar_program`, stated once with the
layouts it was checked on (XLA:CPU, tests/test_cost_vs_hlo.py and tests/test_verify_scale.py). Records
are (kind, axes, count, mean bytes per op, phase), as comm.py's. The gradient sums of the pipelines'
per-shard weight copies are program_comm.py's."""
from __future__ import annotations

from jaxpar.collectives import A2A, AG, AR, PERMUTE, RS
from jaxpar.cost import comm_context, comm_tensor, sites
from jaxpar.cost.comm_context import Positions
from jaxpar.cost.compiler import Compiler, lower, together
from jaxpar.cost.held import DATA_LIKE, equal_buffers, held
from jaxpar.cost.memory import GRAD_BYTES, TOKEN_BYTES
from jaxpar.cost.program_comm import fsdp_stage_copies, head_apart, moe_stage_copies, stage_copies
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


# ---- the sends, the head spread, the boundary sums, an uneven split's weights -----------------------

def unused_cooldown_send(sends: list[tuple], st: Strategy, shape: StepShape) -> list[tuple]:
    """`sends` (comm_pipeline.pipeline_parallel) less the cotangents jaxpar's 1F1B sends but never reads: at
    S = 2 (v = 1) the cool-down is one tick, a loop XLA unrolls, and the cotangent it sends is unused, one
    per accumulation step (tests/test_cost_vs_hlo.py's 1F1B cases at pipeline=2)."""
    if not (st.options.pp_schedule == "1f1b" and shape.stages == 2 and shape.repeats == 1):
        return sends
    return [(kind, axes, execs - shape.accum, *rest) if (kind, axes, rest[-2]) == (PERMUTE, ("pipeline",), "backward")
            else (kind, axes, execs, *rest) for kind, axes, execs, *rest in sends]


def schedule_collectives(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler) -> list[tuple]:
    """What jaxpar's GSPMD pipeline issues besides the sends (Megatron's has none of these), per accumulation
    step: the head spread over the stages (`head_spread`), the sums at the pipeline's ends (`boundary_sums`)
    and, for an uneven split, the weights' moves to their stages (`uneven_weights`)."""
    return (head_spread(m, st, shape, act) + boundary_sums(m, st, shape, act, cc)
            + uneven_weights(m, st, shape, act))


def head_spread(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """The last stage's output spread over the stages for the head (jaxpar/pipeline/gpipe.py): padded to
    M' = S*ceil(M/S) micro-batches, one all-to-all [M', mb, s, d] forward and its transpose backward per
    accumulation step; 1F1B (jaxpar/pipeline/one_f_one_b.py): in each of the M steady ticks one all-to-all of
    the state, and its cotangent back by another. Split over `tensor` under SP."""
    ax, x = ("pipeline",), shape.mb * shape.s_loc * m.d_model * act
    t = st.sizes["tensor"] if st.options.sequence_parallel else 1
    if st.options.pp_schedule == "1f1b":
        return (sites.issue(A2A, ax, shape.micro * shape.accum, [x / t], "forward")
                + sites.issue(A2A, ax, shape.micro * shape.accum, [x / t], "backward"))
    spread = shape.stages * shape.head_micro * x / t
    return sites.issue(A2A, ax, shape.accum, [spread], "forward") + sites.issue(A2A, ax, shape.accum, [spread], "backward")


def boundary_sums(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler) -> list[tuple]:
    """Backward, per accumulation step, over `pipeline`: the input's cotangent (every stage's buffer began as
    the input) and the head's and final norm's gradients (each stage's partial sum over its micro-batches);
    under the combiner one op. FSDP: the head's gradient summed in its shards (1F1B: gathered before its
    loop, summed whole); under `fsdp_stage_copies` the head's shard is summed over data x pipeline at once
    and under `head_apart` on its own (program_comm.py). With the combiner the per-micro-batch losses
    (ceil(M/S) floats) are summed over the data axes with the head's and final norm's reduction, one op
    apart from the embedding's (with `context` or the per-shard copies: program_comm.py's)."""
    sz, ax = st.sizes, ("pipeline",)
    t = sz["tensor"] if st.options.sequence_parallel else 1
    one_f_one_b = st.options.pp_schedule == "1f1b"
    y = shape.b_loc / shape.accum * shape.s_loc * m.d_model * act / t
    zero3 = sz["fsdp"] if st.zero == 3 else 1
    head = m.vocab * m.d_model / sz["tensor"] / (1 if one_f_one_b else zero3) * act
    apart = head_apart(st, shape)
    out = together(cc, lower(cc, sites.issue(AR, ax, shape.accum, [y], "backward")
                             + sites.issue(AR, ax, shape.accum, [0.0 if fsdp_stage_copies(st, shape) or apart else head,
                                                                 m.d_model * act], "backward"), st))
    out += sites.issue(AR, ax, shape.accum, [head] if apart else [], "backward")
    data = tuple(a for a in DATA_LIKE if sz[a] > 1 and a != "fsdp")
    if cc.combine and data and "context" not in data and not (stage_copies(st, shape) or moe_stage_copies(st, shape)):
        out += sites.issue(AR, data, shape.accum, [shape.head_micro * 4], "backward")
    return out


def uneven_weights(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """An uneven split's weights are viewed as [S, v, k] per step: per weight array one all-to-all forward,
    and one for its gradient backward (moved before the fsdp gather: ZeRO-3 shards of the sharded part).
    An even split, circular included, is stored stage-major (jaxpar/pipeline/order.py): no weight moves."""
    if shape.per_chunk * shape.stages * shape.repeats == m.units:   # unit slots, padding included: none
        return []
    zero3 = st.sizes["fsdp"] if st.zero == 3 else 1
    h = held(m, st)
    units = ([k + z / zero3 for (k, _), (z, _) in zip(held(m, st, "kept").runs, held(m, st, "zero").runs)]
             if zero3 > 1 else [u for u, _ in h.runs])
    moved = sum(u * (k * shape.stages * shape.repeats) / shape.stages for u, k in zip(units, shape.run_slots))
    arrays = equal_buffers(moved * act, h.stack_arrays)
    return sites.issue(A2A, ("pipeline",), 1, arrays, "forward") + sites.issue(A2A, ("pipeline",), 1, arrays, "backward")


# ---- what the stages recompute and how the positions travel -----------------------------------------

def recomputed_tp(st: Strategy, shape: StepShape) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer that run again in its backward pass inside
    jaxpar's pipeline (in place of comm_tensor.recomputed_tp). GPipe and circular (jaxpar/pipeline/gpipe.py):
    each iteration's stage work is rematerialised under the policy, and its vmap over the stages (and over
    the fsdp shards) gives every weight dot a batch dim, so `dots_no_batch` saves none of them and
    recomputes as `full` does: both sums when a stage runs k > 1 unit slots per iteration (a slot's output
    feeds the next slot), one when k = 1 (the chunk's output is dead; XLA drops the one-trip slot loop);
    `dots` keeps every dot output (no sum again). Gathers: any policy but `none` reruns both. 1F1B:
    `one_f_one_b_recomputed`. XLA:CPU counts, checked per policy, k and fsdp in tests/test_verify_scale.py
    and test_cost_vs_hlo.py's remat cases."""
    if st.options.pp_schedule == "1f1b":
        return one_f_one_b_recomputed(st, shape)
    remat = st.options.remat
    sums = (2 if shape.per_chunk > 1 else 1) if remat in ("full", "dots_no_batch") else 0
    return 2 * (remat != "none"), sums


def one_f_one_b_recomputed(st: Strategy, shape: StepShape) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer run again in 1F1B's backward: every backward
    tick recomputes its chunk from the stashed input (jax.vjp of the chunk), so both gathers, and both
    sums when the chunk runs k > 1 unit slots (a slot's output feeds the next), one when k = 1 (the
    chunk's output is dead), as `recomputed_tp`'s `full`; and the units' own remat policy inside the
    chunk (jaxpar/pipeline/stages.py) reruns the gathers again (any policy: no dot outputs) and, under
    `full`, the attention sum (the MLP's is the unit's output: dead)."""
    sp, remat = st.sizes["tensor"] > 1 and st.options.sequence_parallel, st.options.remat
    gathers = 2 * sp * (1 + (remat != "none"))
    return gathers, (2 if shape.per_chunk > 1 else 1) + (remat == "full")


def cp_positions(st: Strategy, shape: StepShape) -> Positions:
    """How the key positions travel a context-parallel step inside jaxpar's pipelines (in place of
    comm_context.positions): per schedule iteration, a micro-batch's each; rematerialised, once more per
    iteration. 1F1B: per backward tick, and per forward tick with a one-hop ring (c = 2), per layer
    execution with a longer one (its ring a loop XLA does not hoist); the chunk's rerun covers the remat."""
    ticks, c = shape.iterations * shape.accum, st.sizes["context"]
    one_f = st.options.pp_schedule == "1f1b"
    forward = shape.exec_attention + shape.exec_moe if one_f and c > 2 else ticks
    again = ticks if st.options.remat != "none" and not one_f else 0
    return Positions(forward + (ticks if one_f else 0), shape.mb * shape.s_loc * TOKEN_BYTES, again)


# ---- 1F1B's vocab-parallel head -----------------------------------------------------------------------

def one_f_one_b_head(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """The vocab-sharded embedding and head under 1F1B, in place of comm_tensor.tp_vocab. Per micro-batch (the
    lookup's loop) the embedding output is summed over `tensor` (SP: reduce-scattered) and, under SP, its
    gradient gathered. The head runs in each of the M steady ticks on its 1/S of the last stage's output
    (h = mb x s_loc / S tokens per device): under SP its input gathered; the softmax max and sum-exp
    all-reduced (h x 4 bytes each); backward the label logit's sum (h x 4, needed by the loss value
    only) with, in one op under the combiner, the input gradient's sum (SP: its reduce-scatter apart,
    and the final norm's weight gradient instead: its partial sum over the tick's sequence shard,
    accumulated replicated)."""
    sp, ax, d = st.options.sequence_parallel, ("tensor",), m.d_model
    x = shape.b_loc / shape.accum * shape.s_loc * d * act
    ticks, h = shape.micro * shape.accum, shape.mb * shape.s_loc / shape.stages
    hx = h * d * act
    per = shape.micro   # the embedding looked up micro-batch by micro-batch (jaxpar/pipeline/one_f_one_b.py)
    out = sites.issue(RS if sp else AR, ax, ticks, [x / per], "forward")
    out += sites.issue(AG, ax, ticks, [x / per], "backward") if sp else []
    out += sites.issue(AG, ax, ticks, [hx], "forward") if sp else []
    out += sites.issue(AR, ax, ticks, [h * 4], "forward") + sites.issue(AR, ax, ticks, [h * 4], "forward")
    if sp:   # (a reduce-scatter: apart, XLA:CPU's too)
        out += sites.issue(RS, ax, ticks, [hx], "backward")
    grads = sites.issue(AR, ax, ticks, [d * GRAD_BYTES] if sp else [hx], "backward")
    return out + together(cc, lower(cc, sites.issue(AR, ax, ticks, [h * 4], "backward") + grads, st))


# ---- the adjustments, applied to the textbook's sites -----------------------------------------------

def tensor_parallel(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler,
                    act: int) -> list[tuple]:
    """comm_tensor's sites as jaxpar's pipelines issue them: their stages recompute more than a layer's own
    remat (`recomputed_tp`, in place of comm_tensor.recomputed_tp); 1F1B reruns each chunk in its backward
    (a Mamba-2 layer's collectives once more: `rerun_mamba`) and runs its own vocab-parallel head
    (`one_f_one_b_head`, in place of comm_tensor.tp_vocab), whose ticks sum the final norm's gradient."""
    one_f, x = st.options.pp_schedule == "1f1b", comm_tensor.residual(m, shape, act)
    out = list(ops)
    if one_f:
        out = [op[:6] + (sites.SP_LAYER_NORMS,) if op[6] == sites.SP_NORMS else op
               for op in ops if op[6] not in (sites.VOCAB, sites.LABEL)]
        out += one_f_one_b_head(cc, st, shape, m, act) + rerun_mamba(st, shape, x)
    if shape.exec_attention and st.options.overlap == "none":
        gathers, sums = recomputed_tp(st, shape)
        textbook = comm_tensor.recomputed_tp(st)
        more = gathers - textbook[0] if st.options.sequence_parallel else 0
        out += comm_tensor.reruns(st, shape.exec_attention, x, more, sums - textbook[1])
    return out


def rerun_mamba(st: Strategy, shape: StepShape, x: float) -> list[tuple]:
    """What 1F1B's rerun of each chunk in its backward adds to a Mamba-2 layer's tensor collectives: the
    gathered input again under SP (no dot output), and the out_proj sum where a slot feeds the next (k > 1)."""
    e, sp = shape.exec_mamba, st.options.sequence_parallel
    out = sites.issue(AG, ("tensor",), e, [x], "backward") if sp else []
    return out + (sites.issue(RS if sp else AR, ("tensor",), e, [x], "backward") if shape.per_chunk > 1 else [])


def context_parallel(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape, act: int,
                     exchange: comm_context.Exchange) -> list[tuple]:
    """comm_context's sites as jaxpar's pipelines issue them: the positions travel as `cp_positions` says,
    and 1F1B's rerun of each chunk runs the kernels' forward collectives once more, backward."""
    out = [op for op in ops if op[6] != sites.POSITIONS]
    if any(op[6] == sites.POSITIONS for op in ops):
        out += comm_context.position_sites(st, cp_positions(st, shape))
    if st.options.pp_schedule == "1f1b":
        out += (comm_context.attention_pass(m, st, shape, act, exchange, "backward")
                + comm_context.mamba_pass(m, st, shape, act, "backward"))
    return out
