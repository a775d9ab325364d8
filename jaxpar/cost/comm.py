"""Predicted collectives of one training step: kind x mesh axes x phase, per device. `predicted` is the
recipe, read top-down, in three layers applied one after the other, each by name:

    the textbook, one module per parallelism (sites, jaxpar/cost/sites.py)
        comm_data      data parallelism, ZeRO-1, FSDP: gradient sums, parameter gathers, the lookup
        comm_tensor    tensor (+ sequence) parallelism: the f/g sums per layer, the vocab-parallel head, the norms
        comm_context   context parallelism: K/V rings or gathers, Mamba-2's halos and states, the positions
        comm_pipeline  pipeline parallelism: the sends between stages
        comm_expert    expert parallelism's all-to-alls and the router's statistics
    jaxpar's program: program_comm (its pipelines' per-shard weight copies), program_pipeline (their head
        spread, boundary sums, uneven weights, recomputes, 1F1B's head)
    the compiler and the stack: compiler_comm (XLA's partitioner's norm sums, XLA:CPU's loop), compiler.lower
        (the passes as data; a stack's flat FSDP buffers and buckets)

Records are the HLO tally's own `jaxpar.collectives.Collective` (kind, axes, count, bytes, wire_bytes, phase),
so a prediction and the compiled program's tally compare field by field (tests/test_cost_vs_hlo.py, every
8-device strategy on XLA:CPU). `bytes` is the full (gathered / pre-scatter / reduced) buffer of each instance,
summed; `wire_bytes` what one device sends under the ring algorithm. Counts multiply layer executions (scan and
pipeline trip counts included); recomputed forward collectives (remat `full`) are tallied under `backward`.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import A2A, AG, AR, PERMUTE, RS, Collective, wire_factor  # the tally's record and ring model
from jaxpar.cost import compiler_comm, program_comm, program_pipeline
from jaxpar.cost.comm_context import Exchange, context_parallel
from jaxpar.cost.comm_data import data_parallel
from jaxpar.cost.comm_expert import expert_parallel
from jaxpar.cost.comm_pipeline import pipeline_parallel
from jaxpar.cost.comm_tensor import tensor_parallel
from jaxpar.cost.compiler import COMPILERS, GPU, Compiler, activation_bytes, lower
from jaxpar.cost.flops import unit_policy
from jaxpar.cost.memory import ACTIVATION_BYTES
from jaxpar.cost.shape import StepShape
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
    """Every predicted collective of one step of `software` as (kind, axes, phase, count, total bytes), merged
    by (kind, axes, phase): per parallelism the textbook's sites, then, where the step is jaxpar's own
    program, its adjustments (`program_sites`), then what the compiler and the stack make of them
    (compiler_comm, compiler.lower). Plain tuples: the time model reads them thousands of times per second."""
    cores = st                                  # the attention core's collectives (context) under the run's policy
    st = units_strategy(st)                     # every other collective follows the layer unit's policy
    cc = compiler.issuing(software.flat_params, software.grad_buckets) if software.flat_params or software.grad_buckets else compiler
    act = activation_bytes(cc, ACTIVATION_BYTES[st.options.dtype])
    sizes = st.sizes
    exchange = Exchange(software.cp_rotate, software.cp_kv_heads, software.cp_grad_bytes) if sizes["context"] > 1 else None
    ops = data_sites(m, st, shape, software, cc, act)
    if sizes["tensor"] > 1:
        ops += tensor_parallel(m, st, shape, act)
    if sizes["context"] > 1:
        ops += context_parallel(m, cores, shape, act, exchange)
    if sizes["pipeline"] > 1:
        ops += pipeline_parallel(m, st, shape, act, software.pp_scatter_gather)
    if shape.exec_moe:   # (the per-shard copies' statistics for every stack: checked on jaxpar's only)
        form = compiler_comm.dispatch_form(st, cc, software.moe_padded)
        ops += program_comm.expert_stats(expert_parallel(m, st, shape, act, form), m, st, shape)
    if software.jaxpar_program and shape.stages > 1:
        ops = program_sites(ops, m, st, shape, cc, act, exchange)
    if not cc.hoist and st.options.sequence_parallel and sizes["tensor"] > 1:
        ops = compiler_comm.norms_in_loop(ops, cc, m, shape)
    return merge(lower(cc, ops, st))


def data_sites(m: ModelConfig, st: Strategy, shape: StepShape, software: Software, cc: Compiler, act: int) -> list[tuple]:
    """comm_data's sites (where the compiler leaves the sums in the loop, compiler_comm's), as the
    partitioner issues the norms' sums, for the stack's data parallelism: jaxpar's program's with its
    departures (program_comm.data_parallel); a stack whose FSDP spans the context ranks over fsdp x context
    (`context_as_fsdp`); float8 weights gathered in float8 where the stack does (`Software.fp8_gathers`; jaxpar's program under its
    `fp8_gather` option: comm_data.float8_gathers)."""
    gather = software.param_gather_bytes
    weights = 1 if software.fp8_gathers and st.options.dtype == "float8" else act   # float8 FSDP gathers

    def textbook(view: Strategy, element: int) -> list[tuple]:
        if not cc.hoist:
            return compiler_comm.data_parallel_in_loop(m, view, shape, element, cc, gather)
        return compiler_comm.norms_summed_whole(data_parallel(m, view, shape, element, gather), m, view, shape)

    if software.jaxpar_program:
        return program_comm.data_parallel(textbook(st, act), m, st, shape, cc, act)
    if software.fsdp_over_context and st.sizes["context"] > 1:
        return over_context(textbook(context_as_fsdp(st), weights))
    return textbook(st, weights)


def program_sites(ops: list[tuple], m: ModelConfig, st: Strategy, shape: StepShape, cc: Compiler, act: int,
                  exchange: Exchange) -> list[tuple]:
    """The textbook's sites as jaxpar's own pipelines issue them (jaxpar/cost/program_pipeline.py): their
    recomputes and 1F1B's head (tensor), how the positions travel and 1F1B's reruns (context), the
    cool-down send 1F1B never reads and what they issue beside the sends (pipeline)."""
    if st.sizes["tensor"] > 1:
        ops = program_pipeline.tensor_parallel(ops, m, st, shape, cc, act)
    if st.sizes["context"] > 1:
        ops = program_pipeline.context_parallel(ops, m, st, shape, act, exchange)
    return program_pipeline.unused_cooldown_send(ops, st, shape) + program_pipeline.schedule_collectives(m, st, shape, act, cc)


def context_as_fsdp(st: Strategy) -> Strategy:
    """The data-parallel view of a step whose stack's FSDP spans the context ranks (Software.fsdp_over_context:
    torchtitan's fully_shard over its dp_shard x cp mesh, MaxText's `embed` rule on its context axis): one
    fsdp group of fsdp x context ranks (ZeRO-3 unless the strategy names a stage), no context axis. The memory
    model shards the state over the same group (memory.local_params); `over_context` names the group's axes."""
    sizes = dict(st.mesh)
    sizes["fsdp"], sizes["context"] = sizes["fsdp"] * sizes["context"], 1
    zero = 3 if st.options.zero is None else st.options.zero
    return dataclasses.replace(st, mesh=tuple(sizes.items()), options=dataclasses.replace(st.options, zero=zero))


def over_context(ops: list[tuple]) -> list[tuple]:
    """`context_as_fsdp`'s sites on the real mesh: each group over fsdp spans fsdp x context."""
    return [(kind, tuple(a for a in AXES if a in axes or (a == "context" and "fsdp" in axes)), *rest)
            for kind, axes, *rest in ops]


def units_strategy(st: Strategy) -> Strategy:
    """`st` with its remat policy as the layer unit runs it (flops.unit_policy): `selective` recomputes no
    unit (only the attention core, whose collectives are context parallelism's), `offload` every unit as
    `full` does."""
    unit = unit_policy(st.options.remat)
    return st if unit == st.options.remat else st.with_options(remat=unit)


def merge(ops: list[tuple]) -> tuple[tuple, ...]:
    """Sites (jaxpar/cost/sites.py) as (kind, axes, phase, count, total bytes), one per (kind, axes, phase), in
    the order each first occurs."""
    merged: dict[tuple, list[float]] = {}
    for kind, axes, execs, n, total, phase, _ in ops:
        key = (kind, axes, phase)
        acc = merged.get(key)
        if acc is None:
            merged[key] = [execs * n, execs * total]
        else:
            acc[0] += execs * n
            acc[1] += execs * total
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
