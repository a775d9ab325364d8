"""The collective record that the compiled-program tally (jaxpar.analysis) and the analytic cost model
(jaxpar.cost) share, so that a prediction and a tally compare field by field; the ring model of the
bytes a device sends; byte formatting. Imports nothing from jaxpar.

``Collective``
    Collectives of one kind over one set of mesh axes in one phase, merged: ``count`` instances,
    ``bytes`` the full (reduced / gathered / pre-scatter) buffers summed, ``wire_bytes`` what one
    device sends of them.
``wire_factor``
    Bytes one device sends per byte of buffer under the ring algorithm, group size n: AG, RS, A2A
    (n-1)/n, AR 2(n-1)/n, collective-permute 1.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
AR, AG, RS, A2A, PERMUTE = KINDS
PHASES = ("forward", "backward", "optimizer", "other")
OPTIMIZER_SCOPE = "optimizer"  # the jax.named_scope whose ops are in the `optimizer` phase
UNMATCHED_AXES = ("?",)  # the axes of device groups that span no mesh axes


@dataclasses.dataclass(frozen=True)
class Collective:
    """Collectives of one kind over one set of mesh axes in one phase, merged."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int
    wire_bytes: float
    phase: str


def wire_factor(kind: str, n: int) -> float:
    """Bytes one device sends per byte of buffer, ring algorithm, group size n."""
    if kind == "collective-permute":
        return 1.0
    share = (n - 1) / n
    return 2 * share if kind == "all-reduce" else share


def totals(collectives: Iterable[Collective]) -> dict:
    """Sum of ``count``, ``bytes`` and ``wire_bytes`` over collectives."""
    collectives = list(collectives)
    return {
        "count": sum(c.count for c in collectives),
        "bytes": sum(c.bytes for c in collectives),
        "wire_bytes": sum(c.wire_bytes for c in collectives),
    }


def human_bytes(n: float, digits: int = 2) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError
