"""Context parallelism's collectives (Liu et al. 2023, ring attention; jaxpar/ops/attention.py and
mamba_cp.py), per layer execution and pass. Records are (kind, axes, count, mean bytes per op, phase) as
jaxpar/cost/compiler.py's `site` writes them; comm.predicted merges them. How the key positions travel
is passed in (`Positions`: `positions` below, or jaxpar's pipelines', program_pipeline.py)."""
from __future__ import annotations

import dataclasses

from jaxpar.cost.compiler import AG, PERMUTE, RS, Compiler, site
from jaxpar.cost.memory import TOKEN_BYTES
from jaxpar.cost.params import mamba_dims
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Positions:
    """How the key positions travel a context-parallel step: `execs` times forward, `nbytes` each
    (int32 token positions), and `again` times backward (rematerialised: 0 without remat)."""
    execs: float
    nbytes: float
    again: float


@dataclasses.dataclass(frozen=True, slots=True)
class Exchange:
    """How a stack moves K and V between context ranks (jaxpar/cost/software.py's cp_* traits, which name
    their sources): `rotate` "" as the strategy's `attention` says, "allgather" PyTorch's all-gather
    rotater; `heads` "kv" (key-value heads) or "q" (K and V repeated to the query heads); `grad_bytes` of
    dK/dV per element (0: the activations' dtype)."""
    rotate: str = ""
    heads: str = "kv"
    grad_bytes: int = 0


# The remat policies that keep ring attention's moved K/V blocks and positions (by name under those that
# save dots: jaxpar.ops.attention.RING_NAMES), so that no recomputed layer moves them again.
RING_KEPT = ("none", "dots", "dots_no_batch")


def positions(st: Strategy, shape: StepShape) -> Positions:
    """A step's positions travel once per accumulation step (the batch's, before the layer loop), and
    again in each recomputed layer where the policy keeps no moved block (`RING_KEPT`)."""
    e = shape.exec_attention + shape.exec_moe
    return Positions(shape.accum, shape.b_loc / shape.accum * shape.s_loc * TOKEN_BYTES,
                     e if st.options.remat not in RING_KEPT else 0)


def _cp_passes(st: Strategy, rerun_chunk: bool = False, kept: tuple[str, ...] = ("none",)) -> tuple[str, ...]:
    """Passes of the context-parallel kernels' collectives: their outputs (moved K/V blocks, halos,
    states) are no dot outputs, so every remat policy but those that keep them (`kept`: none, and for the
    ring's named blocks `RING_KEPT`) recomputes them in the backward pass (and a schedule that reruns
    each chunk in its backward, `rerun_chunk`, once more)."""
    return ("forward",) + ("backward",) * (int(st.options.remat not in kept) + int(rerun_chunk))


def allgather_rotater(st: Strategy, e: float, kv: float, grad: float, cc: Compiler,
                      rerun_chunk: bool = False) -> list[tuple]:
    """PyTorch's context-parallel attention with rotate method ALL_GATHER (_AllGatherRotater,
    torch/distributed/tensor/experimental/_attention.py), per layer execution: one all-gather of K and V
    (one concatenated buffer, `kv` bytes a shard) per attention call, forward, again in each recompute,
    and again backward; dK and dV (`grad` bytes a shard, one buffer) go around the ring by context hops
    (its dkv rotater: context permutes, the last home), summed as they travel: no reduce-scatter."""
    c, ax = st.sizes["context"], ("context",)
    out = []
    for phase in _cp_passes(st, rerun_chunk) + ("backward",):
        out += site(cc, AG, ax, e, [kv * c], phase)
    return out + site(cc, PERMUTE, ax, c * e, [grad], "backward")


def kernels(st: Strategy, e: float, half: float, cc: Compiler, positions: Positions,
            rerun_chunk: bool = False) -> list[tuple]:
    """jaxpar's context-parallel attention kernels (jaxpar/ops/attention.py), per layer execution, K and V
    `half` bytes a shard each: ring (`attention="ring"`; its moved blocks moved again backward only under a
    policy that does not keep them, `RING_KEPT`) or all-gather."""
    c, ax, out = st.sizes["context"], ("context",), []
    ring = st.options.attention == "ring"
    for phase in _cp_passes(st, rerun_chunk, RING_KEPT if ring else ("none",)):
        out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], phase) if ring
                else site(cc, AG, ax, e, [half * c, half * c], phase))
    out += (site(cc, PERMUTE, ax, (c - 1) * e, [half, half], "backward") if ring
            else site(cc, RS, ax, e, [half * c, half * c], "backward", partitioner=False))
    if ring:
        out += site(cc, PERMUTE, ax, (c - 1) * positions.execs, [positions.nbytes], "forward")
        out += site(cc, PERMUTE, ax, (c - 1) * positions.again, [positions.nbytes], "backward")
    else:
        out += site(cc, AG, ax, positions.execs, [positions.nbytes * c], "forward")
    return out


def context_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                     positions: Positions, rerun_chunk: bool = False,
                     exchange: Exchange = Exchange()) -> list[tuple]:
    """Attention (jaxpar/ops/context_parallel.py), per layer execution and pass: ring (Liu et al.
    2023): context-1 hops, each a permute of K and one of V (2 ops of the local block's half each),
    and of dK, dV backward; the key positions travel the ring (c-1 int32 permutes) as `positions`
    says; all-gather: K and V gathered (2 ops) forward, dK and dV reduce-scattered backward
    (hand-written: reduce-scatters on every backend), the positions gathered.
    Mamba-2 (jaxpar/ops/mamba_cp.py): per pass one permute of the packed conv halo ((d_conv-1)
    tokens x conv channels; zigzag: two, one from each neighbour) and one all-gather of every
    segment's final SSM state and log-decay (b*m*heads/t*(head_dim*d_state + 1) float32 per shard,
    m = 1 or 2 segments); their transposes backward. `rerun_chunk`: the schedule reruns each chunk in its
    backward (jaxpar's 1F1B), one pass more. `exchange`: how the stack moves K and V (`Exchange`;
    "allgather": `allgather_rotater`, positions sharded up front)."""
    c, t = st.sizes["context"], st.sizes["tensor"]
    ax, out = ("context",), []
    zigzag = st.options.cp_layout == "zigzag"
    if shape.exec_attention or shape.exec_moe:
        e = shape.exec_attention + shape.exec_moe  # an MoE block's attention half is an attention block's
        if exchange.heads == "q":
            half = shape.mb * shape.s_loc * m.heads * m.head_dim / t * act  # K or V
        else:
            half = shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act
        if exchange.rotate == "allgather":
            grad = 2 * half / act * (exchange.grad_bytes or act)
            out += allgather_rotater(st, e, 2 * half, grad, cc, rerun_chunk)
        else:
            out += kernels(st, e, half, cc, positions, rerun_chunk)
    if shape.exec_mamba:
        e, segs = shape.exec_mamba, 2 if zigzag else 1
        _, conv_dim, heads = mamba_dims(m)
        halo = shape.mb * (m.d_conv - 1) * conv_dim / t * act
        state = shape.mb * segs * heads / t * (m.ssm_head_dim * m.d_state + 1) * 4 * c
        for phase in _cp_passes(st, rerun_chunk):
            out += site(cc, PERMUTE, ax, e, [halo] * segs, phase) + site(cc, AG, ax, e, [state], phase)
        out += site(cc, PERMUTE, ax, e, [halo] * segs, "backward")
        out += site(cc, RS, ax, e, [state], "backward", partitioner=False)
    return out
