"""What the software stack does that neither the model config nor the mesh says.

The same mesh costs differently under different implementations; these switches name the
differences that matter for the cost model, with one preset for jaxpar itself and one for
Megatron-LM (the published runs the model is calibrated on).

    dropout            the model trains with dropout: masks and dropped copies join the activation
                       inventory (Megatron GPT: attention-probability and hidden dropout, Korthikanti 2022)
    causal             count only the lower triangle of attention scores (a causal kernel that skips
                       masked blocks); False counts the full s x s, as dense masked attention computes
    pp_scatter_gather  a stage sends 1/t of its boundary activation and the receiver all-gathers it
                       over `tensor` (Narayanan et al. 2021, section 4.1); None: only when the
                       activation is already split over `tensor`, i.e. under sequence parallelism
    pp_1f1b            the pipeline runs one-forward-one-backward (Megatron; Narayanan 2021), so a
                       stage holds activations of S micro-batches, not all M (jaxpar's GPipe/circular
                       schedules are autodiff through a loop: forward for all M, then backward)
    jax_activations    the activation inventory of jaxpar's JAX program (what autodiff keeps: float32
                       norm copies, softmax exp and probabilities, ...; jaxpar/cost/memory.py), not
                       Korthikanti's inventory of Megatron's kernels
    rerun_outputs      full recompute reruns a layer's last projection too (Megatron); XLA drops it,
                       because nothing in the backward pass reads its output (jaxpar/cost/flops.py)
    moe_padded         MoE dispatch into static per-expert buffers of the group capacity (jaxpar.ops.moe:
                       dropless computes and sends E/k times the token copies that exist); False: only
                       the routed copies (Megatron's grouped GEMM and token dispatcher)
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Software:
    name: str = "jaxpar"
    dropout: bool = False
    causal: bool = False
    pp_scatter_gather: bool | None = None
    pp_1f1b: bool = False
    jax_activations: bool = True
    rerun_outputs: bool = False
    moe_padded: bool = True


JAXPAR = Software()
MEGATRON = Software(name="megatron-lm", dropout=True, causal=False, pp_scatter_gather=True,
                    pp_1f1b=True, jax_activations=False, rerun_outputs=True, moe_padded=False)
