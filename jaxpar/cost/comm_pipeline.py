"""Pipeline parallelism's collectives in the cost model (jaxpar/pipeline/gpipe.py, jaxpar/pipeline/one_f_one_b.py):
what jaxpar/cost/comm.py's `predicted` adds for a mesh with pipeline > 1. Records are (kind, axes,
count, mean bytes per op, phase), as comm.py's."""
from __future__ import annotations

from jaxpar.cost.compiler import A2A, AG, AR, GPU, PERMUTE, RS, Compiler, ar_bytes, site, together
from jaxpar.cost.held import DATA_LIKE, equal_buffers, held
from jaxpar.cost.memory import GRAD_BYTES
from jaxpar.cost.program_comm import fsdp_stage_copies, head_apart, moe_stage_copies, stage_copies
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def pipeline_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler = GPU,
                      scatter_gather: bool = False, jaxpar_program: bool = True) -> list[tuple]:
    """jaxpar/pipeline/gpipe.py. One collective-permute of the stage state (a micro-batch's residual stream)
    per schedule iteration forward, and its transpose backward (GPipe M+S-1, circular v*M+S-1
    iterations). The state is split over `tensor` under SP; with Megatron's scatter/gather (Narayanan
    2021, 4.1) it is split for the send and all-gathered over `tensor` on arrival.
    jaxpar's own pipeline (`jaxpar_program`) also, per accumulation step: the output, padded to
    M' = S*ceil(M/S) micro-batches, is spread over the stages for the head by one all-to-all [M', mb, s, d]
    forward and its transpose backward; backward the input's cotangent (every stage's buffer began as
    the input) and the head's and final norm's gradients (each stage's partial sum over its
    micro-batches) are all-reduced over `pipeline`; under the combiner they are one op, and the head's
    and final norm's reduction over the data axes is one op apart from the embedding's (with the
    per-micro-batch losses, ceil(M/S) floats). 1F1B (jaxpar/pipeline/one_f_one_b.py): v*M + S - 1 ticks shift
    the state up and as many the cotangent down (one permute each, the second labelled backward); in the
    M steady ticks the last stage's output is spread over the stages for the head by one all-to-all of
    the state and its cotangent comes back by another; the head's gradient is summed whole (gathered
    over fsdp before the loop). An uneven split's weights are viewed as [S, v, k] per
    step: per weight array one all-to-all forward, and one for its gradient backward (an even split,
    circular included, is stored stage-major: jaxpar/pipeline/order.py, no weight moves)."""
    sp, sizes = st.options.sequence_parallel, st.sizes
    split = sp or scatter_gather
    x = shape.mb * shape.s_loc * m.d_model * act
    n = shape.iterations * shape.accum
    sent = x / sizes["tensor"] if split else x
    ax = ("pipeline",)
    # jaxpar's 1F1B at S = 2: the cool-down is one tick, a loop XLA unrolls, and the cotangent it sends is
    # unused (tests/test_cost_vs_hlo.py's 1F1B cases at pipeline=2)
    dead = shape.accum if (st.options.pp_schedule == "1f1b" and shape.stages == 2 and shape.repeats == 1
                           and jaxpar_program) else 0
    out = [(PERMUTE, ax, n, sent, "forward"), (PERMUTE, ax, n - dead, sent, "backward")]
    if split and not sp and sizes["tensor"] > 1:
        out += [(AG, ("tensor",), n, x, "forward"), (AG, ("tensor",), n, x, "backward")]
    if jaxpar_program:  # jaxpar's GSPMD pipeline; Megatron's has none of these
        t = sizes["tensor"] if sp else 1
        one_f_one_b = st.options.pp_schedule == "1f1b"   # jaxpar/pipeline/one_f_one_b.py: the head spread per tick
        spread = shape.stages * shape.head_micro * x / t
        if one_f_one_b:
            out += [(A2A, ax, shape.micro * shape.accum, x / t, "forward"),
                    (A2A, ax, shape.micro * shape.accum, x / t, "backward")]
        else:
            out += [(A2A, ax, shape.accum, spread, "forward"), (A2A, ax, shape.accum, spread, "backward")]
        y = shape.b_loc / shape.accum * shape.s_loc * m.d_model * ar_bytes(cc, act) / t
        # FSDP: the head's gradient is summed in its shards (1F1B: gathered before its loop, summed whole)
        zero3 = sizes["fsdp"] if st.zero == 3 else 1
        head = m.vocab * m.d_model / sizes["tensor"] / (1 if one_f_one_b else zero3) * ar_bytes(cc, act)
        fsdp_copies = fsdp_stage_copies(st, shape)   # the head's shard is summed over data x pipeline at once
        apart = head_apart(st, shape)
        out += together(cc, site(cc, AR, ax, shape.accum, [y], "backward")
                        + site(cc, AR, ax, shape.accum, [0.0 if fsdp_copies or apart else head,
                                                         m.d_model * ar_bytes(cc, act)], "backward"))
        out += site(cc, AR, ax, shape.accum, [head] if apart else [], "backward")
        data = tuple(a for a in DATA_LIKE if sizes[a] > 1 and a != "fsdp")
        if cc.combine and data and "context" not in data and not (stage_copies(st, shape) or moe_stage_copies(st, shape)):
            # (else in program_comm's)
            out += [(AR, data, shape.accum, shape.head_micro * 4, "backward")]
        units = shape.per_chunk * shape.stages * shape.repeats   # unit slots, padding included
        if units != m.units:   # uneven: the weights move to their stages
            h = held(m, st)   # moved before the fsdp gather: ZeRO-3 shards of the sharded part
            unit = held(m, st, "kept").unit + held(m, st, "zero").unit / zero3 if zero3 > 1 else h.unit
            arrays = equal_buffers(unit * units / shape.stages * act, h.unit_arrays)
            out += site(cc, A2A, ax, 1, arrays, "forward") + site(cc, A2A, ax, 1, arrays, "backward")
    return out


# ---- 1F1B's tensor-parallel collectives (jaxpar/pipeline/one_f_one_b.py) -----------------------------------

def one_f_one_b_recomputed(st: Strategy, shape: StepShape) -> tuple[int, int]:
    """(SP gathers, row-parallel sums) of an attention layer run again in 1F1B's backward: every backward
    tick recomputes its chunk from the stashed input (jax.vjp of the chunk), so both gathers, and both
    sums when the chunk runs k > 1 unit slots (a slot's output feeds the next), one when k = 1 (the
    chunk's output is dead), as comm.recomputed_tp's pipeline `full`; and the units' own remat policy
    inside the chunk (jaxpar/pipeline/stages.py) reruns the gathers again (any policy: no dot outputs)
    and, under `full`, the attention sum (the MLP's is the unit's output: dead)."""
    sp, remat = st.sizes["tensor"] > 1 and st.options.sequence_parallel, st.options.remat
    gathers = 2 * sp * (1 + (remat != "none"))
    return gathers, (2 if shape.per_chunk > 1 else 1) + (remat == "full")


def one_f_one_b_head(cc: Compiler, st: Strategy, shape: StepShape, m: ModelConfig, act: int) -> list[tuple]:
    """The vocab-sharded embedding and head under 1F1B, in place of comm.tp_vocab. Per micro-batch (the
    lookup's loop) the embedding output is summed over `tensor` (SP: reduce-scattered) and, under SP, its
    gradient gathered. The head runs in each of the M steady ticks on its 1/S of the last stage's output
    (h = mb x s_loc / S tokens per device): under SP its input gathered; the softmax max and sum-exp
    all-reduced (h x 4 bytes each); backward the label logit's sum (h x 4, needed by the loss value
    only) with, in one op under the combiner, the input gradient's sum (SP: its reduce-scatter apart,
    and the final norm's weight gradient instead: its partial sum over the tick's sequence shard,
    accumulated replicated)."""
    sp, ax, n, d = st.options.sequence_parallel, ("tensor",), shape.accum, m.d_model
    tokens = shape.b_loc / shape.accum * shape.s_loc
    x, xr = tokens * d * act, tokens * d * ar_bytes(cc, act)
    ticks, h = shape.micro * shape.accum, shape.mb * shape.s_loc / shape.stages
    hx, hxr = h * d * act, h * d * ar_bytes(cc, act)
    per = shape.micro   # the embedding looked up micro-batch by micro-batch (jaxpar/pipeline/one_f_one_b.py)
    out = site(cc, RS if sp else AR, ax, ticks, [((x if cc.reduce_scatter else xr) if sp else xr) / per], "forward")
    out += site(cc, AG, ax, ticks, [x / per], "backward") if sp else []
    out += site(cc, AG, ax, ticks, [hx], "forward") if sp else []
    out += site(cc, AR, ax, ticks, [h * 4], "forward") + site(cc, AR, ax, ticks, [h * 4], "forward")
    if sp:   # (a reduce-scatter: apart, XLA:CPU's too)
        out += site(cc, RS, ax, ticks, [hx if cc.reduce_scatter else hxr], "backward")
    grads = site(cc, AR, ax, ticks, [d * GRAD_BYTES] if sp else [hxr], "backward")
    out += together(cc, site(cc, AR, ax, ticks, [h * 4], "backward") + grads)
    return out

