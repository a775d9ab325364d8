"""The compiler is data: XLA's collective passes on each backend, applied to the textbook's sites after the fact.

What a program asks for (the SPMD partitioner's collectives and jaxpar's hand-written ones) is the same on
every backend; what XLA's later passes make of it is not. `Compiler` states the passes as data, one field
each; `lower` applies them to the sites the textbook modules issue (jaxpar/cost/sites.py), with a stack's
own issuing (flat FSDP buffers, Megatron's buckets: `Compiler.issuing`). `GPU` and `TPU` are the textbook
(Megatron; the ZeRO paper); `CPU` is what XLA:CPU emits (tests/test_comm.py hand-counts its tally). Scalar
all-reduces (the loss, the gradient norm's partial sums) are not predicted: XLA folds them into whichever op
is near. XLA:TPU, compiled ahead of time for a topology (`jaxpar comm --target tpu-v5e:2x4`), is held against
`TPU` in tests/test_tpu_compile.py; what `TPU` does not model is named in `TPU_GAPS`. What XLA makes of the
sites beyond an op's kind and bytes (its loop, its partitioner's norm sums) is jaxpar/cost/compiler_comm.py's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.collectives import AR, RS
from jaxpar.cost import sites
from jaxpar.core.rules import BASE_RULES
from jaxpar.core.strategy import Strategy

BATCH_AXES = BASE_RULES["batch"]  # the axes a batch is split over


@dataclasses.dataclass(frozen=True, slots=True)
class Compiler:
    """XLA's collective passes on one backend (module docstring), one field each."""
    name: str
    reduce_scatter: bool = True   # ReduceScatterCreator: an all-reduce whose result is only sliced to 1/n is a
    #                               reduce-scatter; without it the all-reduce stays (same bytes)
    reassociate: bool = True      # AllReduceReassociate: AR(x) + AR(y) -> AR(x + y); without it q, k, v's (and
    #                               gate, up's) input gradients are all-reduced one by one: 5 per layer, not 2
    combine: bool = False         # AllReduceCombiner: the independent all-reduces over one group issued at one
    #                               point (a layer's weight gradients) are one tuple-shaped op
    hoist: bool = True            # gradient sums leave the layer loop (one per stacked array per step); without
    #                               it they run per layer execution (compiler_comm.data_parallel_in_loop)
    fold: bool = True             # AllReduceFolder: AR over g1 of AR over g2 -> one AR over g1 x g2; without it a
    #                               sum over the batch axes and `context` is two (`reductions`)
    promote_bf16: bool = False    # XLA:CPU's float normalization runs bf16 collectives in float32 (4 bytes)
    flat_weights: bool = False    # the program's (Software.flat_params): a block's FSDP gathers and scatters as one
    #                               flat buffer (PyTorch FSDP's FlatParameter, FSDP2's per-group all-gather)
    buckets: bool = False         # the program's (Software.grad_buckets): a step's one-off reductions and gathers
    #                               in buckets of max(40M, 1M x ranks) parameters (Megatron-Core's DDP)
    ragged_all_to_all: bool = True  # the backend compiles jax.lax.ragged_all_to_all (XLA:CPU does not: the
    #                               grouped MoE kernel's buckets; xla_workarounds.ragged_all_to_all_runs, held equal
    #                               by tests/test_xla_workarounds.py, so that the cost model imports no JAX)

    @functools.cache
    def issuing(self, flat_weights: bool, buckets: bool) -> Compiler:
        """This compiler under a program that flattens each block's weights and buckets its step's reductions
        as the software says (`flat_weights`, `buckets`)."""
        return dataclasses.replace(self, flat_weights=flat_weights, buckets=buckets)


GPU = Compiler("gpu")
TPU = Compiler("tpu")
CPU = Compiler("cpu", reduce_scatter=False, reassociate=False, combine=True, hoist=False, fold=False,
               promote_bf16=True, ragged_all_to_all=False)
COMPILERS = {c.name: c for c in (GPU, TPU, CPU)}

# What XLA:TPU (libtpu 0.0.52) makes of a jaxpar step that `TPU` does not predict (llama-tiny on a v5e 2x4
# slice, tests/test_tpu_compile.py); bytes per axis group agree unless a gap says otherwise.
TPU_GAPS = {
    "combine": "XLA:TPU reduces the weight gradients inside the layer loop (unrolled 2x), one combined "
               "reduce-scatter per iteration, and combines the data-parallel all-reduces: fewer, bigger ops "
               "than the textbook's one per stacked weight array after the loop (bytes equal)",
    "rs-left-as-all-reduce": "inside the (2x unrolled) layer loop some weight gradients stay all-reduces whose "
                             "result a dynamic-update-slice fusion slices into the stacked gradient, so "
                             "ReduceScatterCreator does not see the slice: same bytes, twice the wire bytes",
    "gather-in-compute-dtype": "XLA:TPU moves the bfloat16 convert of a weight before its FSDP all-gather: "
                               "matmul weights are gathered in bfloat16 (half the float32 bytes), others in float32",
    "optimizer-phase": "the reduce-scatter of the weights outside the layer stack (embedding, head) is issued "
                       "with the backward pass, not after it",
    "decomposed-collectives": "at scale XLA:TPU decomposes FSDP all-gathers and reduce-scatters around big matmuls "
                              "into collective-permute rings (windowed einsums) that the textbook counts as one op",
    "fold-pipeline": "under pipeline parallelism (pp4-dp2) the embedding gradient's all-reduce over pipeline "
                     "(the table and the final norm, replicated over the stages) and its all-reduce over data become "
                     "one over (data, pipeline): one table's bytes fewer than predicted (experiments/study_tpu_compile.py)",
    "label-sum": "the vocab-parallel head's label-logit sum (over tensor) is combined with the scalar sums "
                 "after the backward pass, as XLA:CPU's combiner does, not issued in the forward",
    "sequence-parallel": "under sequence parallelism (fsdp4-tp2-sp) the tensor collectives differ beyond the "
                         "above: all-gathers ~0.7x the predicted bytes, one reduce-scatter fewer, and tensor "
                         "all-reduces of ~17 KiB where the model predicts the norms' 2 KiB (cause not identified)",
    "scalars": "the loss's and gradient norms' scalar all-reduces (as for every compiler: not predicted)",
}


# ---- what the passes make of the textbook's sites -----------------------------------------------------

BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 40_000_000, 1_000_000   # Megatron-Core DDP: max(40M, 1M x ranks)
FLAT = frozenset({sites.WEIGHTS, sites.UNIT_SCATTER, sites.STAGE_WEIGHTS})   # the roles `flat_weights` merges


def plain(cc: Compiler) -> bool:
    """Whether `cc` leaves every site as the textbook states it (XLA:GPU and XLA:TPU, no stack's issuing)."""
    return (cc.reduce_scatter and cc.reassociate and cc.fold and not cc.combine and not cc.flat_weights
            and not cc.buckets)


def lower(cc: Compiler, ops: list[tuple], st: Strategy) -> list[tuple]:
    """The sites (jaxpar/cost/sites.py) as `cc` issues them: a program that flattens a block's weights merges
    their gathers and scatters (`flat_weights`) and one that buckets its step's reductions re-cuts them
    (`buckets`, `weight_buckets`); without AllReduceReassociate an input gradient is summed once per
    projection; without ReduceScatterCreator a partitioner's reduce-scatter stays an all-reduce (same bytes);
    the combiner makes the all-reduces of one site one op; without AllReduceFolder a sum over batch and
    sequence axes is two (`reductions`); the combiner issues the label-logit sum with the next all-reduce
    over `tensor` (after the backward pass, or under sequence parallelism inside the norms' sum)."""
    if plain(cc):
        return ops
    out = []
    for kind, axes, execs, n, total, phase, role in ops:
        if cc.flat_weights and role in FLAT:
            n = 1
        if cc.buckets and (element_bytes := sites.bucketed(role)):
            n = weight_buckets(total, element_bytes, st.group(axes))
        if not cc.reassociate and type(role) is tuple and role[0] == sites.INPUT:
            kind, n, total = AR, n + role[1], total + role[1] * role[2]
        if kind == RS and role != sites.HAND and not cc.reduce_scatter:
            kind = AR
        if kind == AR and cc.combine:
            n = 1
        if role == sites.LABEL and cc.combine:
            if st.options.sequence_parallel:
                continue   # compiler_comm.sp_norms_in_loop issues it with the final norm's sum
            phase = "optimizer"
        groups = reductions(cc, axes) if role == sites.STATS else (axes,)
        out += [(kind, group, execs, n, total, phase, role) for group in groups]
    return out


def weight_buckets(total: float, element_bytes: float, ranks: int) -> int:
    """Buffers a step's reduction or gather of `total` bytes takes in buckets of max(40M, 1M x ranks)
    parameters of `element_bytes` each (Megatron-Core's DDP default bucket_size,
    megatron/core/distributed/distributed_data_parallel.py)."""
    return max(1, math.ceil(total / element_bytes / max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * ranks)))


def together(cc: Compiler, ops: list[tuple]) -> list[tuple]:
    """Sites issued at one point of the program (`lower`ed): with the combiner, the all-reduces over one group
    with equal executions and phase become one op, their bytes summed."""
    if not cc.combine:
        return ops
    merged: dict[tuple, float] = {}
    others = []
    for op in ops:
        kind, axes, execs, n, total, phase, _ = op
        if kind == AR:
            merged[(axes, execs, phase)] = merged.get((axes, execs, phase), 0.0) + total
        else:
            others.append(op)
    return others + [(AR, axes, execs, 1, total, phase, "") for (axes, execs, phase), total in merged.items()]


def reductions(cc: Compiler, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The groups a sum over `axes` is all-reduced over: one, or without AllReduceFolder the batch axes and
    the others (`context`: the partial sums over batch and over sequence) apart."""
    if cc.fold or not axes:
        return [axes] if axes else []
    return [g for g in (tuple(a for a in axes if a in BATCH_AXES), tuple(a for a in axes if a not in BATCH_AXES)) if g]


def activation_bytes(cc: Compiler, dtype_bytes: int) -> int:
    """Bytes per element of an activation a collective moves: XLA:CPU moves bf16 as float32 (`promote_bf16`)."""
    return 4 if cc.promote_bf16 else dtype_bytes
