"""Where a step issues its collectives, as the textbook states them: one record per program site.

A site is the tuple (kind, axes, execs, n, total, phase, role): `execs` times per step, `n` collectives
of `kind` over the group that `axes` span, `total` bytes per execution over the n buffers (each buffer
the full gathered, pre-scatter or reduced one, as the HLO tally counts it), in `phase`. `role` names what
the site is for, so that what a compiler, a stack or jaxpar's program makes of it is applied afterwards,
by name (jaxpar/cost/compiler.py `lower`, `issuing`; jaxpar/cost/program_comm.py): "" for none.
Plain tuples: the planner builds thousands per second. comm.merge sums them per (kind, axes, phase).
"""
from __future__ import annotations

# Roles a site may carry (what the adjustments after the textbook look for)
WEIGHTS = "weights"              # a block's FSDP gather or scatter, one op per weight array (a stack may flatten them)
UNIT_SCATTER = "unit scatter"    # ZeRO-3's reduce-scatter of a unit's gradients in the layer loop (weights too)
STAGE_WEIGHTS = "stage weights"  # a pipeline stage's FSDP gather, once per accumulation step (weights too)
FINAL_NORM = "final norm"        # the final norm's gradient reduce-scatter (ZeRO-3)
HEAD_GATHER = "head gather"      # the head's and final norm's FSDP gather, once per micro-batch (ZeRO-3)
HAND = "hand"                    # a hand-written reduce-scatter (psum_scatter): one on every backend
VOCAB = "vocab"                  # the vocab-parallel embedding's and head's sums
LABEL = "label"                  # the vocab-parallel head's label-logit sum, which only the loss value reads
SP_NORMS = "sp norms"            # the norms' gradient sums over `tensor` under sequence parallelism
SP_LAYER_NORMS = "sp layer norms"   # the same without the final norm's, which a program sums elsewhere
LOOKUP = "lookup"                # the sharded embedding table's lookup
POSITIONS = "positions"          # the key positions' moves under context parallelism
STATS = "stats"                  # the MoE balance loss's statistics, summed over the batch and sequence axes at once
LOOP_SUMS = "loop sums"          # gradient sums a compiler leaves in the layer loop (replicated weights)
LOOP_SHARDED = "loop sharded sums"   # the same, of the ZeRO shards over the data axes beyond the shard group
STEP, SHARDED, REPLICATED, INPUT = "step", "sharded sums", "replicated sums", "input"   # tuple roles below


def step(element_bytes: float) -> tuple:
    """A reduction or gather issued once per step, of weights of `element_bytes` each (a stack may bucket it)."""
    return (STEP, element_bytes)


def sharded_sums(element_bytes: float) -> tuple:
    """`step`, for the ZeRO shards' gradient sums over the data axes beyond the shard group."""
    return (SHARDED, element_bytes)


def replicated_sums(element_bytes: float) -> tuple:
    """`step`, for the gradient sums of weights replicated over the data axes (ZeRO-0, and the weights
    ZeRO-1 and -3 keep whole)."""
    return (REPLICATED, element_bytes)


def input_grads(more: int, nbytes: float) -> tuple:
    """An input gradient summed once for `more` + 1 projections that read one input (q, k, v; gate, up): a
    compiler that does not reassociate all-reduces issues `more` more all-reduces of `nbytes`."""
    return (INPUT, more, nbytes)


def issue(kind: str, axes: tuple[str, ...], execs: float, buffers: list[float], phase: str,
          role: str | tuple = "") -> list[tuple]:
    """One collective per buffer over `axes`, issued together `execs` times: a site (none without
    executions or buffers)."""
    if not execs or not buffers:
        return []
    return [(kind, axes, execs, len(buffers), sum(buffers), phase, role)]


def bucketed(role) -> float:
    """The element bytes of a site a stack may bucket (`step` and its kin), else 0."""
    return role[1] if type(role) is tuple and role[0] in (STEP, SHARDED, REPLICATED) else 0.0
