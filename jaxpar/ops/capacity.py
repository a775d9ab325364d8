"""The MoE dispatch's capacity, as plain arithmetic: the kernel (jaxpar/ops/moe.py) sizes its buffers
with it and the cost model (jaxpar/cost/flops.py, comm.py) prices them with it, without importing JAX."""
from __future__ import annotations

import math


def group_capacity(seq: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """C: copies an expert takes from one group of `seq` tokens (dropless: seq)."""
    if capacity_factor == 0:
        return seq
    return max(1, min(seq, math.ceil(capacity_factor * seq * top_k / experts)))


def bucket_rows(groups: int, seq: int, top_k: int, experts: int, shards: int, capacity: int) -> int:
    """B: rows of the grouped kernel's fixed-capacity bucket from one shard to one expert owner
    (jaxpar/ops/moe_grouped.py), for `groups` sequences of `seq` local tokens, `shards` owners of
    experts/shards experts each, and `capacity` = min(seq, C) copies kept per (group, expert) on the
    shard. The exact worst case: a token's k copies go to distinct experts, so at most min(k, E/n) of
    them to one owner, and an owner's E/n experts keep at most `capacity` copies of a group each."""
    per = experts // shards
    return min(groups * seq * min(top_k, per), groups * per * capacity)
