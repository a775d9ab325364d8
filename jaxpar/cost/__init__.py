"""The analytic cost model: FLOPs, memory, collectives and step time as pure functions of
(ModelConfig, Strategy, Hardware, global_batch, seq). No JAX needed. Two layers, read in this order:

The textbook: the hardware and the algorithm, with no compiler or program in them (readable next to
the scaling book and the papers each docstring cites):
    hardware   peaks, links, calibration, power
    params     weights per block, split by the rules table
    flops      FLOPs per block and per step
    shape      how a step is cut up on a device: batch, micro-batches, loop trip counts
    memory     state and activations (Korthikanti's inventory)
    held       the weights a device holds, counted for the collectives that move them
    floor      the bytes each parallelism must move per step (why TP costs four sums per layer)
    time       alpha-beta link time per tier, the roofline, overlap, bubble
    energy     joules per step and per token
  the collectives each parallelism issues, one module each (XLA's passes applied as compiler.py states):
    comm_data      data parallelism, ZeRO-1, FSDP      comm_tensor    tensor and sequence parallelism
    comm_context   context parallelism                 comm_pipeline  the sends between pipeline stages
    comm_expert    expert parallelism, the router's statistics
The implementation: what a software stack and XLA make of it, as data and the adjustments it implies:
    software   the stacks' presets (jaxpar, Megatron-LM, Megatron-Core): traits as data, and the one
               question "is this jaxpar's own program?" (`Software.jaxpar_program`)
    compiler   XLA's collective passes per backend, as data, and `site`, which applies them
    compiler_comm   what a backend's unhoisted layer loop and combiner make of the textbook's collectives
    inventory_jax, program_memory   what jaxpar's program keeps and XLA's buffers hold
    program_flops                   what jaxpar's pipelines recompute
    program_pipeline                what jaxpar's pipelines issue and recompute beyond the sends
    program_comm                    how jaxpar's pipelines sum their per-shard weight copies
    comm       the recipe: the textbook's collectives, then jaxpar's program's adjustments in their place
               (equal to the compiled HLO: tests/test_cost_vs_hlo.py)
    overlap    which of them jaxpar's overlap options hide
Then estimate (all of it, top-down) -> report; inference (prefill and decode); defaults.
tests/test_cost_layers.py keeps the textbook modules free of the implementation layer's imports (the
collective modules import only compiler.py's `site` and its kin) and of 'is this jaxpar's program?'.
"""
from jaxpar.cost.estimate import Estimate, estimate
from jaxpar.cost.hardware import Hardware, known_profiles, load_hardware
from jaxpar.cost.report import format_estimate
from jaxpar.cost.software import JAXPAR, MEGATRON, MEGATRON_CORE, SOFTWARE, Software

__all__ = ["Estimate", "Hardware", "JAXPAR", "MEGATRON", "MEGATRON_CORE", "SOFTWARE", "Software", "estimate", "format_estimate",
           "known_profiles", "load_hardware"]
