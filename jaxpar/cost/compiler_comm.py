"""What XLA's passes make of the textbook's collectives beyond an op's kind and bytes (those
compiler.site applies): where a backend leaves the gradient sums in the layer loop (`Compiler.hoist`
False) and how its combiner (`Compiler.combine`) groups them. Checked on XLA:CPU, whose compiled steps
the tests compare with (tests/test_cost_vs_hlo.py, tests/test_verify_scale.py). Records are (kind, axes,
count, mean bytes per op, phase), as comm.py's."""
from __future__ import annotations

from jaxpar.cost.compiler import AR, Compiler, site
from jaxpar.cost.memory import GRAD_BYTES
from jaxpar.cost.shape import StepShape
from jaxpar.models.config import ModelConfig


def label_phase(cc: Compiler, sequence_parallel: bool) -> str | None:
    """Where the vocab-parallel head's label-logit sum (comm_tensor.tp_vocab) is issued: forward where it is
    computed; with the combiner, with the next all-reduce over `tensor`, after the backward pass
    ("optimizer"), and under SP in the final norm's gradient sum itself (`sp_norms_in_loop`: None here)."""
    if not cc.combine:
        return "forward"
    return None if sequence_parallel else "optimizer"


def sp_norms_in_loop(cc: Compiler, m: ModelConfig, shape: StepShape, final: bool = True) -> list[tuple]:
    """comm_tensor.sp_norms where the sums stay in the layer loop: per layer execution each block's norm
    gradients (an attention or MoE block's two, a Mamba-2 block's one), and the final norm's after the
    loop (with the combiner, together with the label-logit sum of the head's tokens: a pipeline stage's
    head micro-batches'; `final` False: the final norm's sum is elsewhere, 1F1B's per tick)."""
    ax, d = ("tensor",), m.d_model
    tokens = shape.b_loc / shape.accum * shape.s_loc
    if shape.stages > 1:
        tokens = shape.head_micro * shape.mb * shape.s_loc
    out = site(cc, AR, ax, shape.exec_attention + shape.exec_moe, [d * GRAD_BYTES] * 2, "backward")
    out += site(cc, AR, ax, shape.exec_mamba, [d * GRAD_BYTES], "backward")
    last = [d * GRAD_BYTES] + ([tokens * 4] if cc.combine else [])
    return out + (site(cc, AR, ax, 1, last, "optimizer") if final else [])
