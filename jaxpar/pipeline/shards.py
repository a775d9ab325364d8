"""The batch shards of the 1F1B schedule (jaxpar/pipeline/one_f_one_b.py): its weight gradients accumulate in the
loop's carry, so no weight may be shared by devices that hold different rows of the batch there (GSPMD would
reduce every tick's contribution). The weights are copied once per shard of the weight-copy axes (data x fsdp,
`stages.COPY_AXES`) and a vmap over those N shards runs each shard's rows with its own copy; the other batch
axes (`expert`) keep their rows inside each shard, where the expert kernel's all-to-alls run over them and
the experts stay where they are. Two logical names say which is which: "shards" (the copy axes) and "rows"
(the rest of the batch's axes)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.core.rules import Rules, spec_entry
from jaxpar.core.sharding import Layout, constrain, use_layout
from jaxpar.pipeline.stages import COPY_AXES, InStages, param_spec, split_microbatches


def _split_batch(rules, inner: bool):
    """`rules` with the batch split in two: "shards" (the weight-copy axes, data x fsdp: one copy of the
    weights each) and "rows" (the other batch axes, `expert`: the expert kernel's all-to-alls run over
    them); inside the vmap over the shards (`inner`) the batch is its rows and the weights are the shards'
    copies, gathered (`embed` whole, as the compute rules have it)."""
    rules = dict(rules)
    rules["shards"] = tuple(a for a in rules["batch"] if a in COPY_AXES)
    rules["rows"] = tuple(a for a in rules["batch"] if a not in COPY_AXES)
    if inner:
        rules["batch"] = rules["rows"]
        rules["embed"] = ()
    return Rules(rules)


class ShardedLayout(Layout):
    """The step's layout around the loop: the batch's logical names plus "shards" and "rows"."""

    def rules(self, purpose: str):
        return _split_batch(super().rules(purpose), inner=False)


class PerShard(InStages):
    """The layout inside the vmap over batch shards: the vmapped dim is the shards' share of the batch."""

    def rules(self, purpose: str):
        return _split_batch(super().rules(purpose), inner=True)


@dataclasses.dataclass(frozen=True)
class Shards:
    """The N = data x fsdp batch shards, each running its rows with its own copy of the weights, so that
    no weight gradient is reduced over the batch axes inside the loop (jaxpar/pipeline/one_f_one_b.py)."""
    layout: Layout
    count: int                    # N
    axis: Any                     # the batch axes as spmd_axis_name (None without)
    inner: Layout                 # the layout inside the vmap over them

    @classmethod
    def of(cls, layout: Layout) -> Shards:
        shard_axes = layout.axes("shards")
        return cls(layout, layout.group(shard_axes),
                   spec_entry(shard_axes),
                   PerShard(layout.mesh, layout.strategy, layout.replicate_kv_heads))

    def copies(self, a, names: tuple, lead: int, lead_spec: tuple):
        """a (a parameter with logical `names` after `lead` dims) broadcast to one copy per batch shard
        after its `lead` dims (each device keeps what it holds), gathered over fsdp."""
        a = jnp.broadcast_to(jnp.expand_dims(a, lead), a.shape[:lead] + (self.count,) + a.shape[lead:])
        spec = param_spec(names, self.layout, self.layout.axes("shards"), lead=lead_spec + (self.axis,),
                          gathered=True)
        return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(self.layout.mesh, spec))

    def rows(self, a, names: tuple, microbatches: int):
        """[B, rest] (B on the batch axes, rest named `names`) -> [M, N, mb/N, rest]: micro-batches, then
        each batch shard's rows (on the `rows` axes), in place."""
        a = constrain(split_microbatches(a, microbatches), (None, "batch") + names)
        a = a.reshape((microbatches, self.count, a.shape[1] // self.count) + a.shape[2:])
        return constrain(a, (None, "shards", "rows") + names)

    def staged(self, fn: Callable, stage_axes_in: tuple, shard_axes_in: tuple) -> Callable:
        """fn over the stages (spmd: the pipeline axes) and, in each, over the batch shards."""
        def per_stage(*args):
            with use_layout(self.inner):
                return jax.vmap(fn, in_axes=shard_axes_in, spmd_axis_name=self.axis)(*args)
        return jax.vmap(per_stage, in_axes=stage_axes_in, spmd_axis_name=spec_entry(self.layout.axes("stages")))
