"""The analytic cost model: FLOPs, memory, collectives and step time as pure functions of
(ModelConfig, Strategy, Hardware, global_batch, seq). No JAX needed. Read in this order:
hardware -> software -> params -> flops -> memory -> shape -> compiler -> comm -> time -> estimate -> report.
"""
from jaxpar.cost.estimate import Estimate, estimate
from jaxpar.cost.hardware import Hardware, known_profiles, load_hardware
from jaxpar.cost.report import format_estimate
from jaxpar.cost.software import JAXPAR, MEGATRON, MEGATRON_CORE, SOFTWARE, Software

__all__ = ["Estimate", "Hardware", "JAXPAR", "MEGATRON", "MEGATRON_CORE", "SOFTWARE", "Software", "estimate", "format_estimate",
           "known_profiles", "load_hardware"]
