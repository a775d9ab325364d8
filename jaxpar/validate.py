"""Every constraint between a model, a strategy and a batch, checked in one place before compiling.

Each failure raises ConfigError with a message naming the constraint and the values, e.g.
"tensor=4 does not divide kv_heads=2".
"""
from __future__ import annotations

import math

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.rules import DATA_AXES
from jaxpar.strategy import Strategy
from jaxpar.models.config import ModelConfig


def _divides(axis_desc: str, n: int, what: str, value: int) -> None:
    if n > 1 and value % n:
        raise ConfigError(f"{axis_desc}={n} does not divide {what}={value}")


def data_parallel_size(strategy: Strategy) -> int:
    n = 1
    for a in DATA_AXES:
        n *= strategy.size(a)
    return n


def check(model: ModelConfig, strategy: Strategy, *, batch: int, seq: int) -> None:
    """Raise ConfigError for the first violated constraint. `strategy` must be resolved."""
    model.validate()
    s, o = strategy.sizes, strategy.options
    tp, cp, pp = s["tensor"], s["context"], s["pipeline"]

    # --- sequence and batch -----------------------------------------------------------------
    if seq < 1 or seq > model.max_seq:
        raise ConfigError(f"seq={seq} must be between 1 and the model's max_seq={model.max_seq}")
    if batch < 1:
        raise ConfigError(f"batch={batch} must be >= 1")
    dp = data_parallel_size(strategy)
    dp_desc = "x".join(f"{a}={s[a]}" for a in DATA_AXES if s[a] > 1) or "data"
    per_step = o.grad_accum * (o.microbatches if pp > 1 else 1)
    if batch % (dp * per_step):
        extra = f" x grad_accum={o.grad_accum}" if o.grad_accum > 1 else ""
        extra += f" x microbatches={o.microbatches}" if pp > 1 and o.microbatches > 1 else ""
        raise ConfigError(f"batch={batch} is not divisible by the data-parallel size {dp_desc} ({dp}){extra}")

    # --- parameter sharding (ZeRO) --------------------------------------------------------------
    zero = strategy.zero
    if zero == 3 and s["fsdp"] == 1:
        raise ConfigError("zero=3 shards parameters over the fsdp axis, but the mesh has fsdp=1")
    if zero in (0, 1) and s["fsdp"] > 1:
        raise ConfigError(f"zero={zero} keeps parameters replicated, but the mesh has fsdp={s['fsdp']} "
                          "(fsdp shards parameters: use zero=3, or put those devices on `data`)")
    if zero == 3:
        _divides("fsdp", s["fsdp"], "d_model", model.d_model)
    if zero == 1:
        _divides("data x fsdp", s["data"] * s["fsdp"], "d_model", model.d_model)

    # --- tensor parallelism -----------------------------------------------------------------
    _divides("tensor", tp, "vocab", model.vocab)
    if "A" in model.pattern:
        _divides("tensor", tp, "heads", model.heads)
        _divides("tensor", tp, "kv_heads", model.kv_heads)
        _divides("tensor", tp, "mlp_dim", model.mlp_dim)
    if "M" in model.pattern:
        from jaxpar.models.mamba import check_mamba  # noqa: PLC0415
        check_mamba(model, tensor=tp, context=cp, seq=seq, cp_layout=o.cp_layout)
    if o.sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel shards the sequence over `tensor`, but the mesh has tensor=1")
    if o.sequence_parallel:
        _divides("context x tensor", cp * tp, "seq", seq)

    # --- context parallelism ------------------------------------------------------------------
    if "A" in model.pattern and (cp > 1 or o.attention != "dense"):
        from jaxpar.ops.context_parallel import check_context_parallel  # noqa: PLC0415
        check_context_parallel(seq, cp, o.cp_layout, o.attention, model.heads, model.kv_heads, tp)
    elif cp > 1:
        _divides("context", cp, "seq", seq)

    # --- pipeline -----------------------------------------------------------------------------
    from jaxpar.pipeline import check_pipeline  # noqa: PLC0415
    check_pipeline(model, strategy, batch)


def check_hosts(strategy: Strategy, hosts, axes: tuple[str, ...]) -> None:
    """Tensor-parallel groups stay inside one host unless `[mesh.dcn] tensor` asks otherwise.

    Tensor parallelism all-reduces activations several times per layer: across hosts (InfiniBand,
    DCN) that is far slower than inside one (NVLink, ICI). `hosts` holds each mesh position's host.
    """
    tp = strategy.size("tensor")
    if tp == 1 or dict(strategy.dcn).get("tensor", 1) > 1:
        return
    groups = np.moveaxis(np.asarray(hosts), axes.index("tensor"), -1).reshape(-1, tp)
    crossing = groups[np.any(groups != groups[:, :1], axis=1)]
    if len(crossing):
        per_host = groups.size // len(np.unique(groups))
        raise ConfigError(f"tensor={tp} groups span hosts {sorted(set(crossing[0].tolist()))} (each host "
                          f"has {per_host} devices): keep tensor <= {per_host}, or ask for cross-host "
                          f"tensor parallelism with [mesh.dcn] tensor = {math.ceil(tp / per_host)}")
