"""Context parallelism's collectives (Liu et al. 2023, ring attention; jaxpar/ops/attention.py, mamba_cp.py),
per layer execution and pass. Ring: context-1 hops, each a permute of the local K block and one of V, and
of dK, dV backward; all-gather: K and V gathered forward, dK and dV reduce-scattered backward. Mamba-2: its
conv halo permuted and every segment's final SSM state gathered. Sites as jaxpar/cost/sites.py records them;
how jaxpar's pipelines move the positions and rerun a chunk's collectives is program_pipeline.py's.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import AG, PERMUTE, RS
from jaxpar.cost import sites
from jaxpar.cost.flops import unit_policy
from jaxpar.cost.memory import TOKEN_BYTES
from jaxpar.cost.params import mamba_dims
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

CONTEXT = ("context",)


@dataclasses.dataclass(frozen=True, slots=True)
class Positions:
    """How the key positions travel a context-parallel step: `execs` times forward, `nbytes` each (int32
    token positions), and `again` times backward (rematerialised: 0 without remat)."""
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
    """A step's positions travel once per accumulation step (the batch's, before the layer loop), and again
    in each recomputed layer unit where its policy keeps no moved block (`RING_KEPT`)."""
    e = shape.exec_attention + shape.exec_moe
    return Positions(shape.accum, shape.b_loc / shape.accum * shape.s_loc * TOKEN_BYTES,
                     e if unit_policy(st.options.remat) not in RING_KEPT else 0)


def position_sites(st: Strategy, moved: Positions) -> list[tuple]:
    """The positions' collectives: around the ring (c-1 int32 permutes each way), or gathered."""
    c = st.sizes["context"]
    if st.options.attention == "ring":
        return (sites.issue(PERMUTE, CONTEXT, (c - 1) * moved.execs, [moved.nbytes], "forward", sites.POSITIONS)
                + sites.issue(PERMUTE, CONTEXT, (c - 1) * moved.again, [moved.nbytes], "backward", sites.POSITIONS))
    return sites.issue(AG, CONTEXT, moved.execs, [moved.nbytes * c], "forward", sites.POSITIONS)


def recomputes(st: Strategy, kept: tuple[str, ...] = ("none",)) -> int:
    """Backward passes that run a kernel's forward collectives again: their outputs (moved K/V blocks, halos,
    states) are no dot outputs, so every remat policy but those that keep them (`kept`) recomputes them."""
    return int(st.options.remat not in kept)


def kv_bytes(m: ModelConfig, st: Strategy, shape: StepShape, act: int, heads: str) -> float:
    """K or V of one micro-batch's local block on a device: the key-value heads, or every query head of the
    tensor shard where K and V travel repeated to them (`heads` "q")."""
    t = st.sizes["tensor"]
    if heads == "q":
        return shape.mb * shape.s_loc * m.heads * m.head_dim / t * act
    return shape.mb * shape.s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act


def attention_pass(m: ModelConfig, st: Strategy, shape: StepShape, act: int, exchange: Exchange,
                   phase: str) -> list[tuple]:
    """One run of the attention kernels' forward collectives (in `phase`: forward, or a recompute backward):
    K and V around the ring, or gathered (PyTorch's all-gather rotater: one buffer of both)."""
    c, e = st.sizes["context"], shape.exec_attention + shape.exec_moe   # an MoE block's attention half too
    if not e:
        return []
    half = kv_bytes(m, st, shape, act, exchange.heads)
    if exchange.rotate == "allgather":
        return sites.issue(AG, CONTEXT, e, [2 * half * c], phase)
    if st.options.attention == "ring":
        return sites.issue(PERMUTE, CONTEXT, (c - 1) * e, [half, half], phase)
    return sites.issue(AG, CONTEXT, e, [half * c, half * c], phase)


def mamba_pass(m: ModelConfig, st: Strategy, shape: StepShape, act: int, phase: str) -> list[tuple]:
    """One run of Mamba-2's forward collectives (jaxpar/ops/mamba_cp.py): the conv halo permuted (zigzag:
    one from each neighbour) and every segment's final SSM state gathered."""
    if not shape.exec_mamba:
        return []
    segs = 2 if st.options.cp_layout == "zigzag" else 1
    halo, state = mamba_bytes(m, st, shape, act, segs)
    return (sites.issue(PERMUTE, CONTEXT, shape.exec_mamba, [halo] * segs, phase)
            + sites.issue(AG, CONTEXT, shape.exec_mamba, [state], phase))


def mamba_bytes(m: ModelConfig, st: Strategy, shape: StepShape, act: int, segs: int) -> tuple[float, float]:
    """(one conv halo: (d_conv-1) tokens x conv channels, every segment's final SSM state and log-decay
    gathered: b x segs x heads/t x (head_dim x d_state + 1) float32 per shard, times context)."""
    _, conv_dim, heads = mamba_dims(m)
    t, c = st.sizes["tensor"], st.sizes["context"]
    return (shape.mb * (m.d_conv - 1) * conv_dim / t * act,
            shape.mb * segs * heads / t * (m.ssm_head_dim * m.d_state + 1) * 4 * c)


def context_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int,
                     exchange: Exchange = Exchange()) -> list[tuple]:
    """Every context-parallel collective of a step: the kernels' forward (`attention_pass`, `mamba_pass`),
    again in each recompute (`recomputes`: the ring's moved blocks only under a policy that keeps none,
    `RING_KEPT`), and their transposes backward: the ring's dK and dV permutes, the all-gather's
    reduce-scatters (hand-written: reduce-scatters on every backend), PyTorch's rotater's gather again and
    its dK/dV ring by context hops of the whole local buffer (float32 where `exchange.grad_bytes` says),
    Mamba-2's halo and state transposes; and the positions (`positions`; PyTorch's rotater shards them up
    front)."""
    c, e = st.sizes["context"], shape.exec_attention + shape.exec_moe
    ring = exchange.rotate != "allgather" and st.options.attention == "ring"
    out = []
    for phase in ("forward",) + ("backward",) * recomputes(st, RING_KEPT if ring else ("none",)):
        out += attention_pass(m, st, shape, act, exchange, phase)
    for phase in ("forward",) + ("backward",) * recomputes(st):
        out += mamba_pass(m, st, shape, act, phase)
    if e:
        half = kv_bytes(m, st, shape, act, exchange.heads)
        if exchange.rotate == "allgather":
            grad = 2 * half / act * (exchange.grad_bytes or act)
            out += (sites.issue(AG, CONTEXT, e, [2 * half * c], "backward")
                    + sites.issue(PERMUTE, CONTEXT, c * e, [grad], "backward"))
        else:
            out += (sites.issue(PERMUTE, CONTEXT, (c - 1) * e, [half, half], "backward") if ring
                    else sites.issue(RS, CONTEXT, e, [half * c, half * c], "backward", sites.HAND))
            out += position_sites(st, positions(st, shape))
    if shape.exec_mamba:
        segs = 2 if st.options.cp_layout == "zigzag" else 1
        halo, state = mamba_bytes(m, st, shape, act, segs)
        out += (sites.issue(PERMUTE, CONTEXT, shape.exec_mamba, [halo] * segs, "backward")
                + sites.issue(RS, CONTEXT, shape.exec_mamba, [state], "backward", sites.HAND))
    return out
