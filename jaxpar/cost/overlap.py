"""Which of jaxpar's collectives its overlap options hide behind compute, as the time model's fractions.

jaxpar.cost.time.step_time hides a fraction of each class of communication (tensor, pipeline, data)
under compute, never more than the compute there is. For Megatron the fractions are the software's
(jaxpar/cost/software.py: `tp_overlap`, `dp_overlap`, `pp_overlap`, sourced there). For jaxpar's own
program they follow from the strategy's options, one rule per mechanism: a collective counts as hidden
when the program (or the compiler preset) issues it with independent compute beside it, the same notion
as `jaxpar comm`'s overlap report (jaxpar/analysis/overlap.py: asynchronous start/done pairs with
compute between them):

  overlap = collective_matmul[_bidir]   tensor/SP all-gathers and reduce-scatters are rings of
        collective-permutes, each beside a partial matmul (jaxpar/ops/collective_matmul.py; Wang et al.
        2023): every all-gather, reduce-scatter and permute over `tensor` is hidden;
  xla_preset = gpu_windowed_einsum      XLA decomposes each all-gather -> einsum and einsum ->
        reduce-scatter itself (threshold 0): the same, under sequence parallelism (without it tensor
        parallelism's collectives are all-reduces, which no einsum decomposition takes);
  fsdp_prefetch                         the next layer's weight all-gather is issued before this
        layer's compute, forward and backward (jaxpar/ops/fsdp_prefetch.py): the all-gathers over the
        fsdp axes in the forward and backward passes are hidden;
  xla_preset = gpu_overlap, gpu_windowed_einsum, tpu_overlap   the collective pipeliner / asynchronous
        collective fusion moves a layer loop's all-gathers into the previous iteration and its
        reduce-scatters into the next (jaxpar/xla_presets.py): the fsdp all-gathers and the backward
        reduce-scatters over the data axes are hidden; tpu_overlap also overlaps the data-parallel
        gradient all-reduces with the backward pass (its data_parallel_all_reduce_opt flag).

Nothing else is hidden: ZeRO-0/1's reductions hoisted after the backward pass, the ZeRO-1 parameter
gathers after the update, pipeline sends, expert all-to-alls and context rings (the last keep their own
attention-overlap term in time.step_time). These are what each mechanism allows; how much of it XLA
realises on a given accelerator is measured by experiments/bench_overlap.py where one is lent.
"""
from __future__ import annotations

from jaxpar import xla_presets
from jaxpar.collectives import AG, AR, PERMUTE, RS
from jaxpar.cost.hardware import Hardware
from jaxpar.cost.software import Software
from jaxpar.cost.time import axis_span, comm_seconds
from jaxpar.core.strategy import Strategy

_PIPELINED = ("gpu_overlap", "gpu_windowed_einsum", "tpu_overlap")   # presets that pipeline the layer loop's collectives


def _hidden(kind: str, axes: tuple[str, ...], phase: str, st: Strategy) -> bool:
    """Whether jaxpar's program under `st`'s options issues this collective beside independent compute."""
    o = st.options
    if "tensor" in axes:
        rings = o.overlap != "none" or (o.xla_preset == "gpu_windowed_einsum" and o.sequence_parallel)
        return rings and kind in (AG, RS, PERMUTE)
    if "pipeline" in axes or ("context" in axes and kind != AR) or "expert" in axes:
        return False   # context parallelism's own exchanges keep their attention term; an all-reduce is a gradient sum
    fsdp = "fsdp" in axes and kind == AG and phase in ("forward", "backward")
    if fsdp and (o.fsdp_prefetch or o.xla_preset in _PIPELINED):
        return True
    if o.xla_preset in _PIPELINED and kind == RS and phase == "backward":
        return True
    return o.xla_preset == "tpu_overlap" and kind == AR and phase == "backward"


def inside_nodes(predicted: tuple[tuple, ...], st: Strategy, hw: Hardware) -> float:
    """The share of the tensor collectives' seconds spent in groups inside one node (NVLink, one TPU slice):
    what another stack's tensor overlap can hide (jaxpar/cost/software.py, tp_overlap)."""
    tensor = tuple(c for c in predicted if "tensor" in c[1])
    inside = tuple(c for c in tensor if axis_span(c[1], st, hw.devices_per_node)[1] == 1)
    total = comm_seconds(tensor, st, hw)["tensor"]
    return comm_seconds(inside, st, hw)["tensor"] / total if total else 1.0


def fractions(software: Software, st: Strategy, predicted: tuple[tuple, ...], hw: Hardware,
              imbalance: float = 1.0) -> tuple[float, float, float]:
    """(tensor, pipeline, data) overlap fractions for time.step_time: another stack's own (its tensor
    overlap inside nodes only, `inside_nodes`; with async_tp, under --overlap);
    for jaxpar, the share of each class's collective seconds that its options hide (module docstring).
    A preset for the other accelerator family is refused (jaxpar.xla_presets.check_platform)."""
    if not software.jaxpar_program:
        tp = software.tp_overlap or (1.0 if software.async_tp and st.options.overlap != "none" else 0.0)
        return tp * inside_nodes(predicted, st, hw) if tp else 0.0, software.pp_overlap, software.dp_overlap
    o = st.options
    if o.xla_preset != "none":
        xla_presets.check_platform(o.xla_preset, "tpu" if hw.name.startswith("tpu") else "gpu")
    if o.overlap == "none" and not o.fsdp_prefetch and o.xla_preset == "none":
        return 0.0, 0.0, 0.0
    total = comm_seconds(predicted, st, hw, imbalance)
    hidden = comm_seconds(tuple(c for c in predicted if _hidden(c[0], c[1], c[2], st)), st, hw, imbalance)
    share = {k: hidden[k] / total[k] if total[k] else 0.0 for k in ("tensor", "pipeline", "data")}
    return share["tensor"], share["pipeline"], share["data"]
