"""The MoE dispatch's capacity, as plain arithmetic: the kernel (jaxpar/ops/moe.py) sizes its buffers
with it and the cost model (jaxpar/cost/flops.py, comm.py) prices them with it, without importing JAX."""
from __future__ import annotations

import math


def group_capacity(seq: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """C: copies an expert takes from one group of `seq` tokens (dropless: seq)."""
    if capacity_factor == 0:
        return seq
    return max(1, min(seq, math.ceil(capacity_factor * seq * top_k / experts)))
