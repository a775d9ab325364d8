"""The analytic cost model: FLOPs, memory, collectives and step time as pure functions of
(ModelConfig, Strategy, Hardware, global_batch, seq). No JAX needed. Two layers, read in this order:

The textbook: the hardware and the algorithm, with no compiler, stack or program in them (readable next to
the scaling book and the papers each docstring cites):
    hardware   peaks, links, calibration, power      params   weights per block, split by the rules table
    flops      FLOPs per block and per step           shape    how a step is cut up on a device
    memory     state and activations (Korthikanti's inventory), under a stack's `Traits`
    held       the weights a device holds             floor    the bytes each parallelism must move per step
    time       alpha-beta link time, the roofline, overlap, bubble          energy   joules per step and token
    sites      where a step issues its collectives, as records the layers below adjust by role
  the collectives each parallelism issues, one module each:
    comm_data      data parallelism, ZeRO-1, FSDP      comm_tensor    tensor and sequence parallelism
    comm_context   context parallelism                 comm_pipeline  the sends between pipeline stages
    comm_expert    expert parallelism, the router's statistics
The implementation: what a stack, XLA and jaxpar's program make of the textbook, applied after it by name:
    software   the stacks' presets: traits as data, and the one question "is this jaxpar's own program?"
               (`Software.jaxpar_program`)
    compiler   XLA's collective passes per backend, as data, and `lower`, which applies them to the sites
    compiler_comm   XLA's partitioner's norm sums, a backend's unhoisted layer loop, the MoE dispatch form
    inventory_jax, program_memory   what jaxpar's program keeps and XLA's buffers hold
    program_flops                   what jaxpar's pipelines recompute
    program_pipeline                what jaxpar's pipelines issue and recompute beyond the sends
    program_comm                    how jaxpar's pipelines sum their per-shard weight copies
    comm       the recipe: the textbook's sites, then jaxpar's program's, then the compiler's (equal to the
               compiled HLO: tests/test_cost_vs_hlo.py)
    overlap    which of them jaxpar's overlap options hide
Then estimate (shape -> FLOPs -> collectives -> memory -> time) -> report; inference (prefill and decode);
defaults; band (the estimate's error per regime, from the published runs `published` reads). tests/test_cost_layers.py keeps the textbook free of the implementation's imports and flags.
"""
from jaxpar.cost.estimate import Estimate, estimate
from jaxpar.cost.hardware import Hardware, known_profiles, load_hardware
from jaxpar.cost.report import format_estimate
from jaxpar.cost.software import JAXPAR, MEGATRON, MEGATRON_CORE, SOFTWARE, Software

__all__ = ["Estimate", "Hardware", "JAXPAR", "MEGATRON", "MEGATRON_CORE", "SOFTWARE", "Software", "estimate", "format_estimate",
           "known_profiles", "load_hardware"]
