"""Mixture of experts' collectives (jaxpar/ops/moe.py): expert parallelism's all-to-alls, the queue counts
under context parallelism and the router's balance statistics, per MoE-layer execution. Records are
(kind, axes, count, mean bytes per op, phase) as jaxpar/cost/compiler.py's `site` writes them;
comm.predicted merges them."""
from __future__ import annotations

from jaxpar.cost.compiler import A2A, AG, AR, Compiler, reductions, site
from jaxpar.cost.flops import expert_rows
from jaxpar.cost.held import DATA_LIKE
from jaxpar.cost.memory import TOKEN_BYTES
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig
from jaxpar.ops.capacity import bucket_rows, group_capacity
from jaxpar.xla_workarounds import ragged_all_to_all_runs


def _passes(st: Strategy) -> tuple[str, ...]:
    """Phases in which a layer's forward collectives run: forward, plus backward if recomputed."""
    return ("forward", "backward") if st.options.remat == "full" else ("forward",)


def expert_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, cc: Compiler,
                    padded: bool = True, copies: bool = False) -> list[tuple]:
    """Per MoE-layer execution (jaxpar/ops/moe.py). Under expert > 1 the token copies go to the experts'
    owners and back: two all-to-alls over `expert` forward and their two transposes backward (two more
    backward under remat `full`), each moving per device
        padded     E x g x C_loc x d x act bytes: the dispatch buffers, g = sequences per micro-batch,
                   C_loc = min(s_loc, C), C the per-sequence capacity (dropless: the sequence; capacity
                   mode: ceil(cf * s * k / E)), so a dropless kernel sends E/k times the copies that exist;
        bucketed   n x B x d x act bytes, B = capacity.bucket_rows (the grouped kernel where the backend
                   has no ragged all-to-all, XLA:CPU: xla_workarounds.ragged_all_to_all_runs);
        ragged     g x s_loc x k x d x act bytes: only the routed copies (the grouped kernel on GPU and
                   TPU; Megatron's token dispatcher), the mean over routings;
    and the grouped forms first all-gather each shard's kept copies per expert over `expert` (n x E
    int32, rerun with the forward under remat `full`). `padded`: the stack pads (Software.moe_padded);
    jaxpar's program pads only under moe_kernel = padded (`kernel`). Under `context` each shard
    all-gathers every shard's per-(choice, expert) queue counts (g*k*E int32). The balance loss needs
    each expert's load and mean router probability over the whole batch: one all-reduce of 2E float32
    per layer over the batch axes (and `context`); its scalars (z-loss, dropped fraction) are not
    predicted (module docstring), but inside jaxpar's pipeline they are [1, 1] arrays (2E + 2 floats).
    With per-data-shard weight copies (`copies`: program_comm.moe_stage_copies) the sums run over the
    other axes in the loop, and the accumulated statistics of the stage's v*k unit slots over `data`
    once per accumulation step."""
    sz, e = st.sizes, shape.exec_moe
    c, n = sz["context"], sz["expert"]
    out = []
    if n > 1:
        form = kernel(st, cc, padded)
        buf = dispatch_bytes(m, shape.mb, shape.s_loc, c, n, act, form)
        out += site(cc, A2A, ("expert",), 2 * e, [buf], "forward")
        out += site(cc, A2A, ("expert",), (4 if st.options.remat == "full" else 2) * e, [buf], "backward")
        for phase in _passes(st) if form != "padded" else ():
            out += site(cc, AG, ("expert",), e, [counts_bytes(m, n)], phase)
    if c > 1:
        counts = shape.mb * m.top_k * m.experts * TOKEN_BYTES * c
        for phase in _passes(st):
            out += site(cc, AG, ("context",), e, [counts], phase)
    stats = tuple(a for a in DATA_LIKE if sz[a] > 1)
    per = (2 * m.experts + (2 if shape.stages > 1 else 0)) * 4
    if copies:
        stats = tuple(a for a in stats if a != "data")
        out += site(cc, AR, ("data",), shape.accum, [shape.repeats * shape.per_chunk * per], "forward")
    for group in reductions(cc, st, stats):   # (the balance loss's gradient reads the summed probabilities:
        out += site(cc, AR, group, e, [per], "forward")   # no sum again under remat, models/moe.py)
    return out


def kernel(st: Strategy, cc: Compiler, padded: bool = True) -> str:
    """How the copies travel under expert parallelism: padded (static buffers), bucketed or ragged (the
    grouped kernel, by the backend's rule: jaxpar.xla_workarounds.ragged_all_to_all_runs)."""
    if padded and st.options.moe_kernel == "padded":
        return "padded"
    return "ragged" if ragged_all_to_all_runs(cc.name) else "bucketed"


def dispatch_bytes(m: ModelConfig, mb: float, s_loc: float, context: int, n: int, act: int, form: str) -> float:
    """Bytes one device sends in one expert all-to-all, by `kernel` form (`expert_parallel`), for mb
    sequences of s_loc local tokens each (a sequence of s_loc * context tokens)."""
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
