"""How a model executes: the implementations the strategy's options choose, never the maths.

The model calls each unconditionally (models/ holds one path per projection, core and scan); which one runs
is chosen once, outside it, by jaxpar/training/trainer.py `run_config` (as torchtitan applies its parallelize
plans to a model that knows none of them), and by jaxpar/serving/generate.py for generation.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxpar.ops.attention import AttentionCore
from jaxpar.ops.collective_matmul import PLAIN, Matmuls
from jaxpar.ops.latent_attention import absorbed_read
from jaxpar.ops.layer_scan import LayerScan
from jaxpar.ops.mamba_cp import SSMKernels
from jaxpar.xla_workarounds import cast


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The compute `dtype` (parameters stay float32); the projections (`matmuls`: plain dots, or collective
    matmul rings); the attention core (`core`: the sequence split, the kernel, its selective recompute); the
    scan over layer units (`scan`: its remat policy, FSDP prefetch); Mamba-2's conv and SSD (`ssm`: chunked,
    or split over `context`); how a weight read again by a recomputed unit is cast (`recomputed_weight`:
    `cast`, or jaxpar.xla_workarounds.gathered once for both reads); the MoE kernel (`moe_kernel`); how a
    latent attention decode step reads its cache (`mla_decode`: jaxpar/ops/latent_attention.py, absorbed, or
    expanded back to every head: the reference); the sequence's stored order (`seq_order`: the logical
    position of each stored index, zigzag under context parallelism; None: in order), which multi-token
    prediction moves its labels along (models/mtp.py)."""
    dtype: str = "float32"
    matmuls: Matmuls = PLAIN
    core: AttentionCore = AttentionCore()
    scan: LayerScan = LayerScan()
    ssm: SSMKernels = SSMKernels()
    recomputed_weight: Callable = cast
    moe_kernel: str = "grouped"
    mla_decode: Callable = absorbed_read
    seq_order: tuple[int, ...] | None = None

    def stored_positions(self, seq: int) -> np.ndarray:
        """The logical position of each stored index of a sequence of `seq` tokens (`seq_order`, else in order)."""
        order = np.arange(seq) if self.seq_order is None else np.asarray(self.seq_order)
        if len(order) != seq:
            raise ValueError(f"RunConfig.seq_order has {len(order)} positions, the sequence {seq}")
        return order
