"""Predicted collectives of one training step: kind x mesh axes x phase, per device. `predicted` is the
recipe, read top-down: per parallelism, the collectives the textbook says it issues, and where the step
is jaxpar's own pipeline program, that program's adjustments in their place.

The textbook's, one module per parallelism:
    comm_data      data parallelism, ZeRO-1, FSDP: gradient reductions, parameter gathers, the lookup
    comm_tensor    tensor (+ sequence) parallelism: the f/g sums per layer, the vocab-parallel head, the norms
    comm_context   context parallelism: K/V rings or gathers, Mamba-2's halos and states, the positions
    comm_pipeline  pipeline parallelism: the sends between stages
    comm_expert    expert parallelism's all-to-alls and the router's statistics
jaxpar's program's (each adjustment with its source and the layouts it was checked on):
    program_pipeline  its pipelines' head spread, boundary sums, uneven weights, recomputes, 1F1B head
    program_comm      its pipelines' per-shard weight copies and how their gradients are summed
What XLA's passes make of the collectives a program asks for differs by backend: jaxpar/cost/compiler.py
states them as data (`Compiler`: GPU, TPU, CPU) and applies them (`site`, `together`, `reductions`).

Records are the HLO tally's own `jaxpar.collectives.Collective` (kind, axes, count, bytes, wire_bytes, phase),
so a prediction and the compiled program's tally compare field by field (tests/test_cost_vs_hlo.py does,
for every 8-device strategy on XLA:CPU). `bytes` is the full (gathered / pre-scatter / reduced) buffer of
each instance, summed over instances; `wire_bytes` is what one device sends under the ring algorithm
(`jaxpar.collectives.wire_factor`). Counts multiply layer executions (scan and pipeline trip counts
included). Recomputed forward collectives (remat `full`) are tallied under `backward`.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import Collective, wire_factor  # the HLO tally's record and ring model: shared
from jaxpar.cost import comm_context, comm_tensor, compiler_comm, program_comm, program_pipeline
from jaxpar.cost.comm_data import data_parallel
from jaxpar.cost.comm_expert import expert_parallel
from jaxpar.cost.comm_pipeline import pipeline_parallel
from jaxpar.cost.compiler import A2A, AG, AR, COMPILERS, GPU, PERMUTE, RS, Compiler
from jaxpar.cost.flops import unit_policy
from jaxpar.cost.memory import DTYPE_BYTES
from jaxpar.cost.shape import StepShape, one_f_one_b
from jaxpar.cost.software import JAXPAR, Software
from jaxpar.core.strategy import AXES, Strategy
from jaxpar.models.config import ModelConfig

__all__ = ["A2A", "AG", "AR", "PERMUTE", "RS", "Collective", "collectives", "predicted", "record", "to_records",
           "wire_factor"]   # the kinds' names and the ring model, for the tally's readers


def record(kind: str, axes: tuple[str, ...], count: float, nbytes: float, phase: str,
           sizes: dict[str, int]) -> Collective:
    """`count` instances of `nbytes` each over the group spanned by `axes`."""
    n = 1
    for a in axes:
        n *= sizes[a]
    total = count * nbytes
    return Collective(kind, axes, round(count), round(total), total * wire_factor(kind, n), phase)


def predicted(m: ModelConfig, st: Strategy, shape: StepShape, software: Software = JAXPAR,
              compiler: Compiler = GPU) -> tuple[tuple, ...]:
    """Every predicted collective of one step of `software` as (kind, axes, phase, count, total bytes),
    merged by (kind, axes, phase). Per parallelism, the textbook's collectives (comm_data, comm_tensor,
    comm_context, comm_pipeline, comm_expert) and, where the step is jaxpar's own program, its
    adjustments in their place (program_comm: its pipelines' per-shard weight copies' gradient sums,
    `departures` from comm_data's; program_pipeline: what its stages recompute, its 1F1B head, how the
    positions travel, its head spread and boundary sums); where a backend leaves the sums in the layer
    loop or combines them, compiler_comm's. Plain tuples: the time model reads them thousands of times
    per second."""
    cores = st                                  # the attention core's collectives (context) under the run's policy
    st = units_strategy(st)                     # every other collective follows the layer unit's policy
    sz, own, sp = st.sizes, software.jaxpar_program, st.options.sequence_parallel
    flat, buckets = software.flat_params, software.grad_buckets
    cc = compiler.issuing(flat, buckets) if flat or buckets else compiler
    piped = own and shape.stages > 1            # jaxpar's own pipeline schedules (jaxpar/pipeline/)
    one_f = one_f_one_b(st, shape, own)         # ... its 1F1B: every backward tick reruns its chunk
    act = 4 if cc.promote_bf16 else DTYPE_BYTES[st.options.dtype]  # XLA:CPU moves bf16 as float32
    gather = software.param_gather_bytes
    weights = 1 if software.fp8_gathers and st.options.dtype == "float8" else act   # float8 FSDP gathers
    if own:
        raw = program_comm.data_parallel(m, st, shape, act, cc, gather)
    elif software.fsdp_over_context and sz["context"] > 1:
        raw = over_context(data_parallel(m, context_as_fsdp(st), shape, weights, cc, gather))
    else:
        raw = data_parallel(m, st, shape, weights, cc, gather)
    if sz["tensor"] > 1:
        recomputed = program_pipeline.recomputed_tp(st, shape) if piped else comm_tensor.recomputed_tp(st)
        raw += comm_tensor.tensor_parallel(m, st, shape, act, cc, recomputed, rerun_chunk=one_f)
        raw += (program_pipeline.one_f_one_b_head(cc, st, shape, m, act) if one_f
                else comm_tensor.tp_vocab(cc, st, shape, m, act, compiler_comm.label_phase(cc, sp)))
        if sp:
            raw += (comm_tensor.sp_norms(m, shape) if cc.hoist
                    else compiler_comm.sp_norms_in_loop(cc, m, shape, final=not one_f))
    if sz["context"] > 1:
        positions = program_pipeline.cp_positions(st, shape) if piped else comm_context.positions(st, shape)
        exchange = comm_context.Exchange(software.cp_rotate, software.cp_kv_heads, software.cp_grad_bytes)
        raw += comm_context.context_parallel(m, cores, shape, act, cc, positions, one_f, exchange)
    if sz["pipeline"] > 1:
        sends = pipeline_parallel(m, st, shape, act, software.pp_scatter_gather)
        raw += (program_pipeline.unused_cooldown_send(sends, st, shape)
                + program_pipeline.schedule_collectives(m, st, shape, act, cc)) if own else sends
    if shape.exec_moe:
        copies = program_comm.moe_stage_copies(st, shape)   # (read for every stack: checked on jaxpar's only)
        raw += expert_parallel(m, st, shape, act, cc, software.moe_padded, copies)
    return merge(raw)


def context_as_fsdp(st: Strategy) -> Strategy:
    """The data-parallel view of a step whose stack's FSDP spans the context ranks (Software.fsdp_over_context:
    torchtitan's fully_shard over its dp_shard x cp mesh, MaxText's `embed` rule on its context axis): one
    fsdp group of fsdp x context ranks (ZeRO-3 unless the strategy names a stage), no context axis. The memory
    model shards the state over the same group (memory.local_params); `over_context` names the group's axes."""
    sizes = dict(st.mesh)
    sizes["fsdp"], sizes["context"] = sizes["fsdp"] * sizes["context"], 1
    zero = 3 if st.options.zero is None else st.options.zero
    return dataclasses.replace(st, mesh=tuple(sizes.items()), options=dataclasses.replace(st.options, zero=zero))


def over_context(raw: list[tuple]) -> list[tuple]:
    """`context_as_fsdp`'s records on the real mesh: each group over fsdp spans fsdp x context."""
    return [(kind, tuple(a for a in AXES if a in axes or (a == "context" and "fsdp" in axes)), count, nbytes, phase)
            for kind, axes, count, nbytes, phase in raw]


def units_strategy(st: Strategy) -> Strategy:
    """`st` with its remat policy as the layer unit runs it (flops.unit_policy): `selective` recomputes no
    unit (only the attention core, whose collectives are context parallelism's), `offload` every unit as
    `full` does."""
    unit = unit_policy(st.options.remat)
    return st if unit == st.options.remat else st.with_options(remat=unit)


def merge(raw: list[tuple]) -> tuple[tuple, ...]:
    """(kind, axes, count, mean bytes, phase) records as (kind, axes, phase, count, total bytes), one per
    (kind, axes, phase), in the order each first occurs."""
    merged: dict[tuple, list[float]] = {}
    for kind, axes, count, nbytes, phase in raw:
        key = (kind, axes, phase)
        acc = merged.get(key)
        if acc is None:
            merged[key] = [count, count * nbytes]
        else:
            acc[0] += count
            acc[1] += count * nbytes
    return tuple((kind, axes, phase, count, total) for (kind, axes, phase), (count, total) in merged.items())


def to_records(merged: tuple[tuple, ...], sizes: dict[str, int]) -> list[Collective]:
    """`predicted` tuples as `Collective` records (with ring-model wire bytes)."""
    return [record(kind, axes, count, total / count if count else 0.0, phase, sizes)
            for kind, axes, phase, count, total in merged]


def collectives(m: ModelConfig, st: Strategy, shape: StepShape, software: Software = JAXPAR,
                compiler: Compiler | str = GPU) -> list[Collective]:
    """Every predicted collective of one step, as `Collective` records merged by (kind, axes, phase)."""
    cc = COMPILERS[compiler] if isinstance(compiler, str) else compiler
    return to_records(predicted(m, st, shape, software, cc), st.sizes)
