"""The logical-axis rules table: which mesh axes each logical name is sharded over.

This table is the whole definition of a strategy's layout. Models annotate parameters and
activations with the logical names on the left; a strategy's mesh decides how big each mesh axis is,
and its options adjust three entries (see `rules_for`). Axes of size 1 are dropped when a table is
turned into PartitionSpecs, so one table serves every mesh.
"""
from __future__ import annotations

import types

from jaxpar.strategy import Strategy

Rules = types.MappingProxyType  # an immutable {logical name: tuple of mesh axes}

BASE_RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),            # sequence dim inside attention / MLP / mixer
    "res_seq": ("context",),        # sequence dim of the residual stream; + tensor under SP
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "stages": ("pipeline",),        # the stage dim of pipeline buffers (jaxpar/pipeline.py)
    # parameters
    "embed": ("fsdp",),             # ZeRO-3 / FSDP shards parameters on their model dim
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "ssm_heads": ("tensor",),
    "ssm_groups": ("tensor",),
    "ssm_state": (),
    "conv": (),
    "experts": ("expert",),
}

DATA_AXES = ("data", "fsdp", "expert")  # the axes a batch is split over


def rules_for(strategy: Strategy, purpose: str) -> Rules:
    """The table for `purpose` in {"params", "optimizer", "activations"}.

    - params:      `embed` on fsdp under ZeRO-3, replicated otherwise.
    - optimizer:   Adam moments follow the params, except ZeRO-1 which shards them (and the
                   gradient entering the update) on `embed` over data x fsdp.
    - activations: sequence parallelism adds `tensor` to the residual stream's sequence dim.
    """
    rules = dict(BASE_RULES)
    zero = strategy.zero
    if purpose in ("params", "optimizer"):
        rules["embed"] = ("fsdp",) if zero == 3 else ()
        if purpose == "optimizer" and zero == 1:
            rules["embed"] = ("data", "fsdp")
    elif purpose == "activations":
        if strategy.options.sequence_parallel:
            rules["res_seq"] = ("context", "tensor")
    else:
        raise ValueError(f"unknown rules purpose {purpose!r}")
    return Rules(rules)
