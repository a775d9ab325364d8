"""The options a cost question leaves open, filled as the hardware suggests (and said so).

`estimate` and `plan` answer "what would this layout do on that hardware"; a mesh file written for
the CPU tests (float32, one micro-batch) would answer a question nobody asks of an H100. So, unless
the user set them (a flag, or a mesh file's [options]):
    dtype          bfloat16: every profile in jaxpar/cost/hardware/ is an accelerator whose dense
                   peak is quoted for bf16 (float32 matmuls run at a fraction of it)
    microbatches   under pipeline parallelism, M = 4 x stages when the batch allows it (bubble
                   (S-1)/(M+S-1) under 16% for GPipe), else the largest M the local batch divides:
                   one micro-batch would leave every stage idle (S-1)/S of the step
And what another stack's own recipes set (jaxpar/cost/software.py), where the user did not:
    zero           1 where the stack shards the optimizer state over data (`distributed_optimizer`:
                   Megatron-Core, NeMo) and the mesh has data > 1 and no fsdp
    sequence_parallel  on wherever tensor > 1, where the stack's tensor parallelism always shards the
                   sequence between blocks (`sequence_parallel`: Megatron-Core, torchtitan)
    pp_schedule    1f1b under a pipeline, where the stack runs one-forward-one-backward (`pp_1f1b`)
    attention      under context > 1, the stack's context-parallel attention (`cp_attention`)
And one the stack decides whatever the options say, printed as a training estimate prices it (`priced_zero`):
    zero           3 over fsdp x context where the stack's FSDP spans the context ranks (`fsdp_over_context`:
                   torchtitan, MaxText), though the mesh's ZeRO stage (from fsdp alone) reads otherwise
Each default is returned as a line to print beside the estimate.
"""
from __future__ import annotations

from jaxpar.core.strategy import Options, Strategy
from jaxpar.cost.comm import context_as_fsdp
from jaxpar.cost.software import JAXPAR, Software

DEFAULTS = Options()


def accelerator_defaults(st: Strategy, global_batch: int, given: set[str],
                         software: Software = JAXPAR, phase: str = "train") -> tuple[Strategy, list[str]]:
    """(`st` with the defaults above applied where neither `given` flags nor its mesh file set them,
    one line per default applied). A prefill or decode `phase` takes the dtype alone: the others are
    the stack's training recipes (a decode step has one token per sequence to shard)."""
    o, notes, changes = st.options, [], {}
    if "dtype" not in given and o.dtype == DEFAULTS.dtype:
        changes["dtype"] = "bfloat16"
        notes.append("dtype = bfloat16 (accelerator compute; --dtype float32 to change)")
    if phase != "train":
        return (st.with_options(**changes) if changes else st), notes
    stages = st.size("pipeline")
    if stages > 1 and "microbatches" not in given and o.microbatches == DEFAULTS.microbatches:
        local = global_batch // max(1, st.size("data") * st.size("fsdp") * st.size("expert") * o.grad_accum)
        fits = [m for m in range(1, min(4 * stages, local) + 1) if local % m == 0]
        if fits and fits[-1] > 1:
            changes["microbatches"] = fits[-1]
            why = "4 x stages" if fits[-1] == 4 * stages else f"the most <= 4 x {stages} stages the local batch {local} divides"
            notes.append(f"microbatches = {fits[-1]} ({why}; --microbatches to change)")
    stack, lines = stack_defaults(st, software, given)
    changes |= stack
    return (st.with_options(**changes) if changes else st), notes + lines


def stack_defaults(st: Strategy, software: Software, given: set[str]) -> tuple[dict, list[str]]:
    """(option changes, one line each) that `software`'s recipes make where `given` flags and `st`'s mesh
    file left the option at its default (module docstring)."""
    o, changes, notes, sizes = st.options, {}, [], st.sizes

    def free(key: str) -> bool:
        return key not in given and getattr(o, key) == getattr(DEFAULTS, key)

    if (software.distributed_optimizer and free("zero") and sizes["fsdp"] == 1
            and sizes["data"] * sizes["expert"] * sizes["context"] > 1):
        changes["zero"] = 1
        notes.append(f"zero = 1 ({software.name}'s distributed optimizer; --zero 0 to change)")
    if software.sequence_parallel and free("sequence_parallel") and sizes["tensor"] > 1:
        changes["sequence_parallel"] = True
        notes.append(f"sequence parallel ({software.name}'s tensor parallelism; --no-sequence-parallel to change)")
    if software.pp_1f1b and free("pp_schedule") and sizes["pipeline"] > 1:
        changes["pp_schedule"] = "1f1b"
        notes.append(f"pp_schedule = 1f1b ({software.name}'s schedule; --pp-schedule to change)")
    if software.cp_attention and free("attention") and sizes["context"] > 1:
        changes["attention"] = software.cp_attention
        notes.append(f"attention = {software.cp_attention} ({software.name}'s context parallelism; "
                     "--attention to change)")
    return changes, notes


def priced_zero(st: Strategy, software: Software) -> tuple[int, list[str]]:
    """(the ZeRO stage a training estimate prices for `st` under `software`, a line saying so where it is
    not the mesh's): the strategy's, or 3 where the stack's FSDP spans the context ranks and no stage was
    named (jaxpar.cost.comm.context_as_fsdp, memory.local_params); another stage there is not one the stack
    runs (jaxpar.cost.software.refusal)."""
    zero = context_as_fsdp(st).zero if software.fsdp_over_context and st.size("context") > 1 else st.zero
    if zero == st.zero:
        return zero, []
    group = st.size("fsdp") * st.size("context")
    return zero, [f"zero = {zero} over fsdp x context = {group} devices ({software.name}'s FSDP spans the context "
                  "ranks)"]
