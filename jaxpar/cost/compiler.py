"""The compiler is data: XLA's collective passes on each backend, for the analytic cost model (cost/comm.py).

What a program asks for (the SPMD partitioner's collectives and jaxpar's hand-written ones) is the
same on every backend; what XLA's later passes make of it is not. `Compiler` states those passes:
    reduce_scatter        ReduceScatterCreator: an all-reduce whose result is only sliced to 1/n
                          becomes a reduce-scatter. Without it the all-reduce stays (same bytes).
    reassociate           AllReduceReassociate: AR(x) + AR(y) -> AR(x + y). Without it, under
                          tensor parallelism the input gradients of q, k, v (and gate, up) are
                          all-reduced one by one: 5 per attention layer backward, not Megatron's 2.
    combine               AllReduceCombiner: the independent all-reduces over one group that a
                          program issues at one point (one layer's weight gradients, q/k/v's input
                          gradients) become one tuple-shaped op: one count, the bytes summed.
    hoist                 gradient all-reduces leave the layer loop (one per stacked weight array
                          per step, the textbook); without it they run in the loop body, once per
                          layer execution (pipeline bubbles included) on one layer's gradients.
    fold                  AllReduceFolder: AR over g1 of AR over g2 -> one AR over g1 x g2. Without
                          it a gradient partial over the batch axes and over `context` is reduced
                          twice, once per group.
    promote_bf16          bf16 collectives run in float32 (4 bytes per element): XLA:CPU's float
                          normalization converts every bf16 all-reduce, all-gather, permute and
                          all-to-all (checked on a bf16 ZeRO-1 step: tests/test_planner.py, verify).
    flat_weights          not a pass but the program's choice, which the software makes
                          (Software.flat_params): FSDP gathers and reduce-scatters one block's weights as
                          one flat buffer, one op per block and pass (PyTorch FSDP's FlatParameter, FSDP2's
                          one all-gather and one reduce-scatter per fully_shard group); XLA issues one per
                          weight array (False), as `weight_buffers` applies.
    buckets               also the program's (Software.grad_buckets): the gradient reductions and parameter
                          gathers a step issues once, after or beside the backward pass, go in buckets
                          of max(40M, 1M x ranks) parameters (Megatron-Core's DDP default bucket_size,
                          megatron/core/distributed/distributed_data_parallel.py), not one per array
                          (`weight_buckets`).
`GPU` and `TPU` are the textbook (Megatron; the ZeRO paper); `CPU` is what XLA:CPU emits (it runs
none of the first five passes but the combiner; tests/test_comm.py hand-counts its tally).
A model of the combiner's scheduling is out of scope: scalar all-reduces (the loss, the partial
sums of the gradient norms) are not predicted, because XLA folds them into whichever op is near.
XLA:TPU, compiled for a TPU topology on a CPU host (`jaxpar comm --target tpu-v5e:2x4`,
jaxpar/analysis/target.py), is held against `TPU` in tests/test_tpu_compile.py: each axis group's gradient
reduction bytes and the tensor-parallel backward all-reduces match; what `TPU` does not model is named in
`TPU_GAPS` (checked there as bounds).
`site`, `together`, `reductions`, `ar_bytes`, `scattered` and `input_grads` apply a `Compiler` to the
collectives each parallelism issues (cost/comm_*.py); what a backend's unhoisted loop and combiner make
of them beyond an op's kind and bytes is cost/compiler_comm.py's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.core.rules import BASE_RULES
from jaxpar.core.strategy import Strategy

AR, AG, RS, A2A, PERMUTE = "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
BATCH_AXES = BASE_RULES["batch"]  # the axes a batch is split over


@dataclasses.dataclass(frozen=True, slots=True)
class Compiler:
    """XLA's collective passes on one backend (module docstring)."""
    name: str
    reduce_scatter: bool = True
    reassociate: bool = True
    combine: bool = False
    hoist: bool = True
    fold: bool = True
    promote_bf16: bool = False
    flat_weights: bool = False
    buckets: bool = False

    @functools.cache
    def issuing(self, flat_weights: bool, buckets: bool) -> Compiler:
        """This compiler under a program that flattens each block's weights and buckets its step's reductions
        as the software says (`flat_weights`, `buckets`)."""
        return dataclasses.replace(self, flat_weights=flat_weights, buckets=buckets)


GPU = Compiler("gpu")
TPU = Compiler("tpu")
CPU = Compiler("cpu", reduce_scatter=False, reassociate=False, combine=True, hoist=False, fold=False,
               promote_bf16=True)
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


# ---- what the passes make of the collectives a program issues ------------------------------------

def site(cc: Compiler, kind: str, axes: tuple[str, ...], execs: float, buffers: list[float], phase: str,
         partitioner: bool = True) -> list[tuple]:
    """One collective per buffer, issued together `execs` times over `axes`, as [(kind, axes, count,
    mean bytes per op, phase)]: count = execs x buffers (`predicted` keeps only count and total bytes
    per kind, axes and phase, so one tuple per site suffices). A partitioner's reduce-scatter stays an
    all-reduce without ReduceScatterCreator (`partitioner=False`: a hand-written psum_scatter, always
    a reduce-scatter); the combiner makes the all-reduces of one site one op."""
    if kind == RS and partitioner and not cc.reduce_scatter:
        kind = AR
    if not execs or not buffers:
        return []
    if kind == AR and cc.combine:
        return [(AR, axes, execs, sum(buffers), phase)]
    return [(kind, axes, execs * len(buffers), sum(buffers) / len(buffers), phase)]


def weight_buffers(cc: Compiler, buffers: list[float]) -> list[float]:
    """The buffers a block's FSDP all-gather or reduce-scatter moves: one per weight array, or their sum
    where the program flattens the block's weights (`Compiler.flat_weights`)."""
    return [sum(buffers)] if cc.flat_weights and buffers else buffers


BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 40_000_000, 1_000_000   # Megatron-Core DDP: max(40M, 1M x ranks)


def weight_buckets(cc: Compiler, buffers: list[float], element_bytes: float, st: Strategy,
                   axes: tuple[str, ...]) -> list[float]:
    """The buffers of a gradient reduction or parameter gather issued once per step over `axes`: one per
    weight array, or equal buckets of max(40M, 1M x ranks) parameters of `element_bytes` each where the
    program buckets them (`Compiler.buckets`)."""
    if not cc.buckets or not buffers:
        return buffers
    total = sum(buffers)
    n = max(1, math.ceil(total / element_bytes / max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * st.group(axes))))
    return [total / n] * n


def ar_bytes(cc: Compiler, act: int) -> int:
    """Bytes per element of an all-reduced activation of `act` bytes per element."""
    return 4 if cc.promote_bf16 else act


def together(cc: Compiler, ops: list[tuple]) -> list[tuple]:
    """Collectives issued at one point of the program: with the combiner, the all-reduces over one group
    (with equal executions and phase) become one op, their bytes summed."""
    if not cc.combine:
        return ops
    merged: dict[tuple, float] = {}
    others = []
    for kind, axes, execs, nbytes, phase in ops:
        if kind == AR:
            merged[(axes, execs, phase)] = merged.get((axes, execs, phase), 0.0) + nbytes
        else:
            others.append((kind, axes, execs, nbytes, phase))
    return others + [(AR, axes, execs, nbytes, phase) for (axes, execs, phase), nbytes in merged.items()]


def reductions(cc: Compiler, st: Strategy, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The groups a replicated weight's gradient is all-reduced over: one, or (without AllReduceFolder)
    the batch axes and `context` separately (the partial sums over batch and over sequence)."""
    if cc.fold or not axes:
        return [axes] if axes else []
    return [g for g in (tuple(a for a in axes if a in BATCH_AXES), tuple(a for a in axes if a not in BATCH_AXES)) if g]


def scattered(cc: Compiler, x: float, xr: float) -> float:
    """Bytes of one partitioner's reduce-scatter of a buffer of x bytes (xr: as all-reduced): x, or xr
    where ReduceScatterCreator is absent and it stays an all-reduce of the (promoted) whole (`site`
    names its kind)."""
    return x if cc.reduce_scatter else xr


def input_grads(cc: Compiler, xr: float, projections: int) -> list[float]:
    """The buffers summed for the input gradient of `projections` column-parallel matmuls reading one
    input (q, k, v; gate, up): one with AllReduceReassociate (AR(x) + AR(y) -> AR(x + y)), one per
    projection without it; xr bytes each."""
    return [xr] if cc.reassociate else [xr] * projections


def input_grad_sums(cc: Compiler, kind: str, axes: tuple[str, ...], execs: float, nbytes: float, xr: float,
                    projections: int, phase: str) -> list[tuple]:
    """`input_grads` as issued: with AllReduceReassociate one `kind` op of `nbytes` (a reduce-scatter of
    the sequence shard under SP); without it an all-reduce per projection (sliced afterwards under SP)."""
    if cc.reassociate:
        return site(cc, kind, axes, execs, [nbytes], phase)
    return site(cc, AR, axes, execs, input_grads(cc, xr, projections), phase)
