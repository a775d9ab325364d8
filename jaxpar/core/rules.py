"""The logical-axis rules table: which mesh axes each logical name is sharded over.

This table is the whole definition of a strategy's layout. Models annotate parameters and
activations with the logical names on the left; a strategy's mesh decides how big each mesh axis is,
and its options adjust three entries (see `rules_for`). Axes of size 1 are dropped when a table is
turned into PartitionSpecs, so one table serves every mesh.
"""
from __future__ import annotations

import types

from jaxpar.core.strategy import Strategy


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dim sharded over mesh `axes`: None for none, an axis by itself, or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes

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
    "stages": ("pipeline",),        # the stage dim of pipeline buffers (jaxpar/pipeline/gpipe.py)
    # parameters
    "embed": ("fsdp",),             # ZeRO-3 / FSDP shards parameters on their model dim
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "latent": (),                   # a latent attention rank (models/mla.py): follows `embed` (rules_for)
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "ssm_heads": ("tensor",),
    "ssm_groups": ("tensor",),
    "ssm_state": (),
    "conv": (),
    "experts": ("expert",),
    # inference state (models/decode.py, jaxpar/serving/generate.py): sharded like a parameter
    "cache_batch": ("data", "fsdp", "expert"),  # the sequences being generated, as `batch`
    "cache_seq": (),                # cache slots (context-parallel prefill would shard them)
    "cache_kv_heads": ("tensor",),  # cached K/V heads (copies of them when tensor > kv_heads)
    "cache_latent": (),             # latent attention's cached latent: every head reads it, so no split by head
}

DATA_AXES = ("data", "fsdp", "expert")  # the axes a batch is split over


def zero3_axes(strategy: Strategy) -> tuple[str, ...]:
    """The mesh axes ZeRO-3 shards the parameters' model dim (`embed`) over: `fsdp`; on a mesh without
    one but with expert parallelism, the expert group and the data axis beside it (data x expert), as NeMo
    (Megatron-Core's expert-data-parallel group with FSDP) and MaxText (EP with FSDP on one group of
    devices) lay it out. A routed expert's weights [experts, embed, mlp] then hold their experts on
    `expert` and their model dim on `data` (spec_for uses a mesh axis once per array), every other weight
    its model dim on data x expert: weights, gradients and optimizer state all 1/(data x expert) per
    device, each gathered over the axes its matmuls need."""
    sizes = strategy.sizes
    if sizes.get("fsdp", 1) == 1 and sizes.get("expert", 1) > 1:
        return ("data", "expert")
    return ("fsdp",)


def rules_for(strategy: Strategy, purpose: str, *, replicate_kv_heads: bool = False) -> Rules:
    """The table for `purpose` in {"params", "optimizer", "activations", "compute"}.

    - params:      `embed` (and `latent`, for the weights without a model dim) under ZeRO-3 on fsdp (or the expert group: `zero3_axes`), replicated otherwise.
    - optimizer:   Adam moments follow the params, except ZeRO-1 which shards them (and the
                   gradient entering the update) on `embed` over data x fsdp.
    - activations: sequence parallelism adds `tensor` to the residual stream's sequence dim.
    - compute:     the layout a weight is gathered to for its matmuls: the params table without fsdp
                   (FSDP's all-gather target; jaxpar/ops/fsdp_prefetch.py gathers to it explicitly).

    `replicate_kv_heads` is Megatron's rule for tensor > kv_heads (used by inference: jaxpar/serving/generate.py):
    the K/V projections and their activations are replicated over `tensor` (every rank computes every
    K/V head), and the cache keeps tensor/kv_heads copies of each head on `cache_kv_heads`, so each
    tensor rank holds the one head its query heads read.
    """
    rules = dict(BASE_RULES)
    if replicate_kv_heads:
        rules["kv_heads"] = rules["act_kv_heads"] = ()
    zero = strategy.zero
    if purpose in ("params", "optimizer", "compute"):
        rules["embed"] = zero3_axes(strategy) if zero == 3 and purpose != "compute" else ()
        if purpose == "optimizer" and zero == 1:
            rules["embed"] = ("data", "fsdp")
        rules["latent"] = rules["embed"]   # W_q_b, W_k_b, W_v_b have no model dim: ZeRO shards their latent
    elif purpose == "activations":
        if strategy.options.sequence_parallel:
            rules["res_seq"] = ("context", "tensor")
    else:
        raise ValueError(f"unknown rules purpose {purpose!r}")
    return Rules(rules)
