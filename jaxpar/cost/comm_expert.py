"""Mixture of experts' collectives (jaxpar/ops/moe.py; Lepikhin et al. 2020, GShard): expert parallelism's
all-to-alls, the queue counts under context parallelism and the router's balance statistics, per MoE-layer
execution. Sites as jaxpar/cost/sites.py records them. Which dispatch form a run takes (`padded`,
`bucketed`, `ragged`) is the kernel's and the backend's: jaxpar/cost/compiler_comm.py `dispatch_form`.
"""
from __future__ import annotations

from jaxpar.collectives import A2A, AG, AR
from jaxpar.cost import sites
from jaxpar.cost.flops import expert_rows
from jaxpar.cost.held import DATA_LIKE
from jaxpar.cost.memory import TOKEN_BYTES
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig
from jaxpar.ops.capacity import bucket_rows, group_capacity


def _passes(st: Strategy) -> tuple[str, ...]:
    """Phases in which a layer's forward collectives run: forward, plus backward if recomputed."""
    return ("forward", "backward") if st.options.remat == "full" else ("forward",)


def expert_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, form: str = "padded") -> list[tuple]:
    """Per MoE-layer execution. Under expert > 1 the token copies go to the experts' owners and back: two
    all-to-alls over `expert` forward and their two transposes backward (two more backward under remat
    `full`), each moving `dispatch_bytes` of the dispatch `form`; the grouped forms (bucketed, ragged)
    first all-gather each shard's kept copies per expert over `expert` (n x E int32, rerun with the forward
    under remat `full`). Under `context` each shard all-gathers every shard's per-(choice, expert) queue
    counts (g*k*E int32). The balance loss needs each expert's load and mean router probability over the
    whole batch: one all-reduce of 2E float32 per layer over the batch and sequence axes (`sites.STATS`;
    its scalars, z-loss and dropped fraction, are not predicted, but inside a pipeline they are [1, 1]
    arrays: 2E + 2 floats)."""
    sz, e = st.sizes, shape.exec_moe
    c, n = sz["context"], sz["expert"]
    out = []
    if n > 1:
        buf = dispatch_bytes(m, shape.mb, shape.s_loc, c, n, act, form)
        out += sites.issue(A2A, ("expert",), 2 * e, [buf], "forward")
        out += sites.issue(A2A, ("expert",), (4 if st.options.remat == "full" else 2) * e, [buf], "backward")
        for phase in _passes(st) if form != "padded" else ():
            out += sites.issue(AG, ("expert",), e, [counts_bytes(m, n)], phase)
    if c > 1:
        counts = shape.mb * m.top_k * m.experts * TOKEN_BYTES * c
        for phase in _passes(st):
            out += sites.issue(AG, ("context",), e, [counts], phase)
    stats = tuple(a for a in DATA_LIKE if sz[a] > 1)   # (the balance loss's gradient reads the summed
    per = stats_bytes(m, shape)                          # probabilities: no sum again under remat)
    return out + (sites.issue(AR, stats, e, [per], "forward", sites.STATS) if stats else [])


def stats_bytes(m: ModelConfig, shape: StepShape) -> float:
    """One MoE layer's balance statistics: 2E float32 (and the two scalars inside a pipeline)."""
    return (2 * m.experts + (2 if shape.stages > 1 else 0)) * 4


def dispatch_bytes(m: ModelConfig, mb: float, s_loc: float, context: int, n: int, act: int, form: str) -> float:
    """Bytes one device sends in one expert all-to-all for mb sequences of s_loc local tokens each (a sequence
    of s_loc x context tokens), by dispatch form:
        padded     E x g x C_loc x d x act: the static buffers, C_loc = min(s_loc, C), C the per-sequence
                   capacity (dropless: the sequence), so a dropless kernel sends E/k times the copies;
        bucketed   n x B x d x act, B = capacity.bucket_rows (the grouped kernel without a ragged all-to-all);
        ragged     g x s_loc x k x d x act: only the routed copies, the mean over routings."""
    seq = round(s_loc * context)
    if form == "padded":   # the buffer's rows per token as the FLOPs count them (flops.expert_rows)
        return expert_rows(m, seq, context, True) * s_loc * mb * m.d_model * act
    if form == "ragged":
        return m.top_k * s_loc * mb * m.d_model * act
    cap = min(s_loc, group_capacity(seq, m.top_k, m.experts, m.capacity_factor))
    return n * bucket_rows(mb, s_loc, m.top_k, m.experts, n, cap) * m.d_model * act


def counts_bytes(m: ModelConfig, n: int) -> float:
    """The grouped kernel's count exchange: every shard's kept copies per expert, n x E int32."""
    return n * m.experts * TOKEN_BYTES
