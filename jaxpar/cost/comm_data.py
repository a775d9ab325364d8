"""Data parallelism, ZeRO-1 and FSDP (ZeRO-3): the gradient sums, parameter gathers and sharded embedding
lookup of one step, per device, as the ZeRO paper states them (Rajbhandari et al. 2020, sections 5.1-5.3;
the scaling book, "Sharded matrices": an all-gather before use, a reduce-scatter of the gradient).

    ZeRO-0   every gradient all-reduced over the data-like axes, once per step after the backward pass
    ZeRO-1   the sharded gradients reduce-scattered over data x fsdp once per step, the updated
             parameters all-gathered after the update
    ZeRO-3   per layer execution each sharded weight all-gathered forward and again backward, its
             gradient reduce-scattered over fsdp; the shards then all-reduced over the other data axes
Sites as jaxpar/cost/sites.py records them (comm.predicted merges them). What XLA's passes and a stack's
or jaxpar's program make of them is applied afterwards: jaxpar/cost/compiler.py, compiler_comm.py,
program_comm.py.
"""
from __future__ import annotations

from jaxpar.collectives import A2A, AG, AR, RS
from jaxpar.cost import sites
from jaxpar.cost.held import Held, data_axes, equal_buffers, head_and_norm, held, norm_vectors
from jaxpar.cost.memory import PARAM_BYTES, TOKEN_BYTES, grad_bytes
from jaxpar.cost.params import per_model, zero_rules, zero_split
from jaxpar.cost.shape import StepShape
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig


def embedding_lookup(m: ModelConfig, st: Strategy, shape: StepShape, act: int, shard: tuple[str, ...]) -> list[tuple]:
    """Embedding table sharded on its model dim over `shard` (ZeRO-3 parameters, ZeRO-1 moments): the token
    ids are all-gathered to look rows up locally and the rows go back to batch sharding by an all-to-all;
    backward (under ZeRO-1, where only the gradient is sharded, only backward) the row gradients take the
    reverse all-to-all, after which the embedding gradient needs no reduction."""
    ids = shape.b_loc * st.group(shard) * shape.s_loc * TOKEN_BYTES
    rows = shape.b_loc * shape.s_loc * m.d_model * act
    out = sites.issue(AG, shard, shape.accum, [ids / shape.accum], "forward", sites.LOOKUP)
    if st.zero == 3:
        out += sites.issue(A2A, shard, shape.accum, [rows / shape.accum], "forward", sites.LOOKUP)
    return out + sites.issue(A2A, shard, shape.accum, [rows / shape.accum], "backward", sites.LOOKUP)


def fsdp_gathers(m: ModelConfig, st: Strategy, shape: StepShape, act: int) -> list[tuple]:
    """ZeRO-3: per layer execution, forward and backward, one all-gather over fsdp per array the params rules
    shard (compute dtype; a packed group, Mamba-2's in_proj, as one array). The head and final norm are
    gathered once, forward: the gathered copy is saved for the backward pass, as are the layers' norm
    weights and the routed experts' (the expert kernel's operands), which without remat are not gathered
    again backward (jaxpar.xla_workarounds.gathered; models/layers.py RMSNorm; jaxpar/ops/moe.py). Under a
    pipeline each stage's weights are gathered once per accumulation step, forward only: per array of a
    unit its v*k unit slots at once (FSDP inside the stages keeps them for every micro-batch)."""
    t, e_axis, out = st.sizes["tensor"], st.sizes["expert"], []
    for e, block in ((shape.exec_attention, "attention"), (shape.exec_mamba, "mamba"), (shape.exec_moe, "moe")):
        if not e:
            continue
        if st.options.fp8_gather:   # (attention blocks only: validate.check_fp8_gather)
            out += float8_gathers(m, st, e, act)
            continue
        sharded, _ = zero_split(m, block, 3)
        arrays = equal_buffers(sharded.per_device(t, e_axis) * act, sharded.moved)
        if shape.stages > 1:
            slots = e / (shape.accum * shape.iterations * shape.per_chunk) * shape.repeats * shape.per_chunk
            out += sites.issue(AG, ("fsdp",), shape.accum, [b * slots for b in arrays], "forward", sites.STAGE_WEIGHTS)
            continue
        out += sites.issue(AG, ("fsdp",), e, arrays, "forward", sites.WEIGHTS)
        if st.options.remat == "none":   # the gathered norm (and routed experts') weights are saved
            elements, n = norm_vectors(m, block)
            if block == "moe":
                routed, _ = zero_split(m, block, 3, experts=True)
                elements, n = elements + routed.per_device(t, e_axis), n + routed.moved
            arrays = equal_buffers(sharded.per_device(t, e_axis) * act - elements * act, sharded.moved - n)
        out += sites.issue(AG, ("fsdp",), e, arrays, "backward", sites.WEIGHTS)
    head, norm = head_and_norm(m, t)
    return out + sites.issue(AG, ("fsdp",), shape.accum, [b * act for b in (head, norm) if b], "forward",
                             sites.HEAD_GATHER)


def float8_gathers(m: ModelConfig, st: Strategy, execs: int, act: int) -> list[tuple]:
    """`fsdp_gathers` of an attention block under fp8_gather (jaxpar/ops/fp8.py `Layouts`): the projection
    weights gathered as float8, forward and again for the input gradient, at half the compute dtype's bytes
    (1 against bfloat16's 2; XLA:CPU widens both, 2 against `act` = 4: compiler.activation_bytes), the norm
    weights in the compute dtype, forward (and backward under remat, as `fsdp_gathers`). Under remat "full"
    the recomputed forward gathers each projection again, but the last (the MLP's down projection, whose
    output the backward pass does not read), beside the input gradient's own gather (jax.checkpoint keeps
    XLA from merging them). The scales are all-reduced maxima (tensorwise: one element per weight), not
    predicted, as the other scalar sums."""
    sharded, _ = zero_split(m, "attention", 3)
    norms, n = norm_vectors(m, "attention")
    t, w8 = st.sizes["tensor"], act // 2
    total = (sharded.per_device(t, st.sizes["expert"]) - norms) * w8
    weights, backward = equal_buffers(total, sharded.moved - n), []
    if st.options.remat == "full":
        down = m.mlp_dim * m.d_model / t * w8
        backward = equal_buffers(total - down, sharded.moved - n - 1) + equal_buffers(norms * act, n)
    return (sites.issue(AG, ("fsdp",), execs, weights + equal_buffers(norms * act, n), "forward", sites.WEIGHTS)
            + sites.issue(AG, ("fsdp",), execs, weights + backward, "backward", sites.WEIGHTS))


def data_parallel(m: ModelConfig, st: Strategy, shape: StepShape, act: int, gather_bytes: int = PARAM_BYTES
                  ) -> list[tuple]:
    """Every data-parallel collective of a step (module docstring), the ZeRO stage's. ZeRO-1 and ZeRO-3
    shard the weights with an `embed` dim (params.zero_split reads which from the rules); the others
    (Mamba-2's conv, A_log, dt_bias, D, gate norm) are summed as under ZeRO-0. `gather_bytes` per element
    of ZeRO-1's parameter gather (jaxpar gathers its float32 masters; Megatron's distributed optimizer the
    bf16 weights). Routed experts (MoE under expert > 1) are split over `expert`: their gradients are
    summed over the data-like axes but `expert`, apart from the others' (shard_map sums them at once)."""
    axes = data_axes(st)
    if m.moe_layers and st.sizes["expert"] > 1:
        experts = tuple(a for a in axes if a != "expert")
        return (_weights(m, st, shape, act, axes, False, gather_bytes)
                + _weights(m, st, shape, act, experts, True, gather_bytes))
    return _weights(m, st, shape, act, axes, None, gather_bytes)


@per_model   # (memoised on the strategy, as held.data_axes)
def shard_axes(st: Strategy) -> tuple[str, ...]:
    """The axes the strategy's ZeRO stage shards the weights with an `embed` dim over (ZeRO-3 by its
    params rules, ZeRO-1 by its optimizer's), of size > 1."""
    zero = st.zero
    return tuple(a for a in zero_rules(zero, "optimizer" if zero == 1 else "params")["embed"] if st.sizes[a] > 1)


def gradient_sums(group: tuple[str, ...], h: Held, shards: int, gb: int, role_of=sites.replicated_sums) -> list[tuple]:
    """The gradients of the weights `h` (`gb` bytes each, / `shards`) all-reduced over `group` once per step
    after the backward pass, one op per weight array."""
    if not group:
        return []
    return sites.issue(AR, group, 1, equal_buffers(h.full * gb / shards, h.arrays), "backward", role_of(gb / shards))


def _weights(m: ModelConfig, st: Strategy, shape: StepShape, act: int, axes: tuple[str, ...],
             experts: bool | None, gather_bytes: int) -> list[tuple]:
    """`data_parallel` for the weights `experts` selects (True: the routed experts, False: the others, None:
    all), summed over `axes`; the embedding lookup and FSDP gathers go with the non-expert weights."""
    shard = shard_axes(st)
    if not shard:
        return gradient_sums(axes, held(m, st, experts=experts), 1, grad_bytes(st))
    return sharded(m, st, shape, act, axes, experts, gather_bytes)


def sharded(m: ModelConfig, st: Strategy, shape: StepShape, act: int, axes: tuple[str, ...],
            experts: bool | None, gather_bytes: int) -> list[tuple]:
    """ZeRO-1 and ZeRO-3 (the weights with an `embed` dim sharded over `shard_axes`): `data_parallel`'s
    docstring. The embedding's gradient is left sharded by its lookup; the head's and final norm's are
    reduce-scattered one by one."""
    zero, gb, dense, shard = st.zero, grad_bytes(st), experts is not True, shard_axes(st)
    part, kept = held(m, st, "zero", experts), held(m, st, "kept", experts)
    head, norm = head_and_norm(m, st.sizes["tensor"])
    out = (fsdp_gathers(m, st, shape, act) + embedding_lookup(m, st, shape, act, shard)
           if zero == 3 and dense else [])
    if zero != 3:   # ZeRO-1: once per step
        out += sites.issue(RS, shard, 1, equal_buffers(part.layers * gb, part.stack_arrays)
                           + [b * gb for b in (head, norm) if b and dense], "backward", sites.step(gb))
    else:           # ZeRO-3: in each run's layer loop, which keeps a shard of each gradient alive
        if shape.stages > 1:   # each fsdp shard accumulates its stage's v*k unit slots, reduced once
            out += sites.issue(RS, shard, shape.accum, equal_buffers(part.slots(shape) * gb, part.stack_arrays),
                               "backward", sites.WEIGHTS)
        else:
            for execs, (unit, arrays) in zip(shape.run_execs, part.runs):
                out += sites.issue(RS, shard, execs, equal_buffers(unit * gb, arrays), "backward",
                                   sites.UNIT_SCATTER if dense else sites.WEIGHTS)
        out += sites.issue(RS, shard, 1, [head * gb] if head and dense else [], "optimizer")
        out += sites.issue(RS, shard, 1, [norm * gb] if dense else [], "optimizer", sites.FINAL_NORM)
    if zero == 1:
        out += embedding_lookup(m, st, shape, act, shard) if dense else []
        out += sites.issue(AG, shard, 1, equal_buffers(part.full * gather_bytes, part.arrays), "optimizer",
                           sites.step(gather_bytes))
    out += gradient_sums(axes, kept, 1, gb)
    rest = tuple(a for a in axes if a not in shard)
    return out + gradient_sums(rest, part, st.sizes["fsdp"] if zero == 3 else 1, gb,
                               sites.sharded_sums if dense else sites.step)
