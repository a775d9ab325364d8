"""The options a cost question leaves open, filled as the hardware suggests (and said so).

`estimate` and `plan` answer "what would this layout do on that hardware"; a mesh file written for
the CPU tests (float32, one micro-batch) would answer a question nobody asks of an H100. So, unless
the user set them (a flag, or a mesh file's [options]):
    dtype          bfloat16: every profile in jaxpar/cost/hardware/ is an accelerator whose dense
                   peak is quoted for bf16 (float32 matmuls run at a fraction of it)
    microbatches   under pipeline parallelism, M = 4 x stages when the batch allows it (bubble
                   (S-1)/(M+S-1) under 16% for GPipe), else the largest M the local batch divides:
                   one micro-batch would leave every stage idle (S-1)/S of the step
Each default is returned as a line to print beside the estimate.
"""
from __future__ import annotations

from jaxpar.core.strategy import Options, Strategy

DEFAULTS = Options()


def accelerator_defaults(st: Strategy, global_batch: int, given: set[str]) -> tuple[Strategy, list[str]]:
    """(`st` with the defaults above applied where neither `given` flags nor its mesh file set them,
    one line per default applied)."""
    o, notes, changes = st.options, [], {}
    if "dtype" not in given and o.dtype == DEFAULTS.dtype:
        changes["dtype"] = "bfloat16"
        notes.append("dtype = bfloat16 (accelerator compute; --dtype float32 to change)")
    stages = st.size("pipeline")
    if stages > 1 and "microbatches" not in given and o.microbatches == DEFAULTS.microbatches:
        local = global_batch // max(1, st.size("data") * st.size("fsdp") * st.size("expert") * o.grad_accum)
        fits = [m for m in range(1, min(4 * stages, local) + 1) if local % m == 0]
        if fits and fits[-1] > 1:
            changes["microbatches"] = fits[-1]
            why = "4 x stages" if fits[-1] == 4 * stages else f"the most <= 4 x {stages} stages the local batch {local} divides"
            notes.append(f"microbatches = {fits[-1]} ({why}; --microbatches to change)")
    return (st.with_options(**changes) if changes else st), notes
