"""From logical names to NamedShardings, and the layout in force while a step is traced.

Parameters carry their logical names as flax `out_sharding` metadata; activations are annotated by
the model with `constrain(x, names)`. Both go through `spec_for`, which looks each name up in a
rules table and drops mesh axes of size 1.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.core.rules import DATA_AXES, Rules, rules_for
from jaxpar.core.schedule import stored_spec
from jaxpar.core.strategy import Strategy


def spec_for(names: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
    """PartitionSpec for a tuple of logical names (None = unsharded dim)."""
    used: set[str] = set()
    dims = []
    for name in names:
        axes = tuple(a for a in (rules[name] if name is not None else ()) if mesh.shape[a] > 1 and a not in used)
        used.update(axes)
        dims.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the three rules tables of a strategy (`replicate_kv_heads`: see rules_for)."""
    mesh: Mesh
    strategy: Strategy
    replicate_kv_heads: bool = False

    def rules(self, purpose: str) -> Rules:
        return rules_for(self.strategy, purpose, replicate_kv_heads=self.replicate_kv_heads)

    def axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) an activation's logical name is sharded over."""
        return tuple(a for a in self.rules("activations")[name] if self.mesh.shape[a] > 1)

    def size(self, name: str) -> int:
        n = 1
        for a in self.axes(name):
            n *= self.mesh.shape[a]
        return n

    def activation(self, *names: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, spec_for(names, self.rules("activations"), self.mesh))


def model_layout(mesh: Mesh, strategy: Strategy, kv_heads: int, has_attention: bool = True) -> Layout:
    """A model's layout: K/V heads replicated across tensor ranks when tensor exceeds the model's
    kv_heads (Megatron's rule; jaxpar.core.rules.rules_for), for training and generation alike."""
    return Layout(mesh, strategy, replicate_kv_heads=has_attention and strategy.size("tensor") > kv_heads)


_CURRENT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("jaxpar_layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[None]:
    """Make `layout` the one `constrain` and the shard_map kernels see while tracing."""
    token = _CURRENT.set(layout)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_layout() -> Layout | None:
    return _CURRENT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical names; a no-op outside a layout (one device)."""
    layout = _CURRENT.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.activation(*names))


def gathered(w: jax.Array, names: Sequence[str | None], dtype) -> jax.Array:
    """A weight (logical `names`) cast to the compute `dtype` and gathered to the layout its matmuls read
    (rules "compute": FSDP's all-gather target), once for all its uses; its gradient goes back to the
    stored layout in float32 (the cast's transpose first, so the sums are float32 as without this).

    For the LM head: left to itself the SPMD partitioner gathered it once per dot (the logits forward,
    the input gradient backward) at some shapes (`plan --verify` on llama3-70b: 1 GiB more per step).
    A custom VJP rather than a plain constraint: under the pipeline's vmap over stages the head is
    shared by every stage, and a constraint's transpose would act on the gradient after the sum over
    stages (the whole head summed over pipeline, then scattered over fsdp); the custom VJP's backward
    runs per stage, so each stage's gradient is scattered over fsdp first and only its shard summed."""
    layout = _CURRENT.get()
    if layout is None:
        return w.astype(dtype)
    mesh = layout.mesh
    compute = NamedSharding(mesh, spec_for(names, layout.rules("compute"), mesh))
    stored = NamedSharding(mesh, spec_for(names, layout.rules("params"), mesh))
    held = {a for d in stored.spec if d is not None for a in ((d,) if isinstance(d, str) else d)}
    batch = {a for a in DATA_AXES if mesh.shape[a] > 1}
    if held & (batch - set(layout.axes("batch"))):
        # inside a vmap over the batch's shards (a pipeline's per-shard weight copies): the weight
        # arrives gathered, and its sharded axes are the vmap's, which no constraint may name
        return w.astype(dtype)

    @jax.custom_vjp
    def gather(w):
        return jax.lax.with_sharding_constraint(w.astype(dtype), compute)

    def forward(w):
        return gather(w), None

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g.astype(w.dtype), stored),)

    gather.defvjp(forward, backward)
    return gather(w)


def lookup(table: jax.Array, ids: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` for a parameter table [rows, width] with logical `names`, ids [batch, seq].

    When the table's width is sharded over axes that also split the batch (FSDP: `embed` on fsdp),
    each device holds a slice of every row but only its own sequences' ids. The lookup is then stated
    step by step: the ids are gathered over those axes, every device looks its width slice of all
    their rows up (the table stays put; a row dim sharded over `tensor` gives partial rows, summed
    later), and the result leaves in the table's layout, [batch without those axes, seq, width on
    them], for the caller's batch constraint to take back to batch sharding (one all-to-all; its
    transpose backward, so the table's gradient needs no reduction over those axes). Left to
    itself with the rows sharded too (fsdp x tensor) the SPMD partitioner finds no such path and
    replicates the rows over the other axes ('Involuntary full rematerialization'; found by
    `plan --verify` on llama3-70b: all-reduces of the whole micro-batch over pipeline x tensor)."""
    import jax.numpy as jnp  # noqa: PLC0415

    layout = _CURRENT.get()
    if layout is None:
        return jnp.take(table, ids, axis=0)
    mesh = layout.mesh
    width = spec_for(names, layout.rules("params"), mesh)
    width = tuple(width)[1] if len(width) > 1 else None
    width_axes = () if width is None else (width,) if isinstance(width, str) else tuple(width)
    acts = spec_for(("batch", "seq"), layout.rules("activations"), mesh)
    acts = tuple(acts) + (None,) * (2 - len(acts))
    batch = tuple(a for a in ((acts[0],) if isinstance(acts[0], str) else acts[0] or ()))
    if not set(width_axes) & set(batch):
        return jnp.take(table, ids, axis=0)
    kept = tuple(a for a in batch if a not in width_axes)
    last = max(batch.index(a) for a in width_axes)
    if any(batch.index(a) > last for a in kept):
        return _split_lookup(table, ids, batch, width_axes, width, acts[1])
    kept_dim = None if not kept else kept[0] if len(kept) == 1 else kept
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(mesh, P(kept_dim, acts[1])))
    rows = jnp.take(table, ids, axis=0)
    return jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, P(kept_dim, acts[1], width)))


def _split_lookup(table: jax.Array, ids: jax.Array, batch: tuple[str, ...], width_axes: tuple[str, ...],
                  width, seq) -> jax.Array:
    """`lookup` when a batch axis that keeps its split comes after one of the table's width axes in the
    batch's order (fsdp x expert: the batch split fsdp-major, `embed` on fsdp). The device at (f, e)
    holds batch block f*E + e; gathering over fsdp gives it blocks {e, E + e}, which no sharding of one
    batch dim over `expert` describes (P(expert) means blocks 2e, 2e + 1). Left to that, the partitioner
    moved the ids and rows by collective-permutes over fsdp x expert around the gather and the
    all-to-all (and before the split form, replicated the rows: 'involuntary full rematerialization').
    Here the batch dim is split into one dim per batch axis up to the last width axis, each sharded over
    its axis, and the rest, split over the batch axes after it ([F, B/F] sharded (fsdp, expert)), so
    that the gather over the width axes and the all-to-all back are the plain ones `lookup` describes
    (checked against the compiled HLO: the catalogue's fsdp2-ep4, tests/test_strategies.py); the rows
    leave in the batch layout (width dim whole, `seq` as the activations), and the reshape back to
    [batch, seq, width] moves nothing."""
    import jax.numpy as jnp  # noqa: PLC0415

    mesh = _CURRENT.get().mesh
    last = max(batch.index(a) for a in width_axes) + 1
    lead, after = batch[:last], batch[last:]           # one dim per leading axis, the rest split over `after`
    sizes = tuple(mesh.shape[a] for a in lead)
    b, s = ids.shape
    n = 1
    for k in sizes:
        n *= k
    tail = None if not after else after[0] if len(after) == 1 else after

    def spec(gathered: tuple[str, ...], *rest) -> NamedSharding:
        return NamedSharding(mesh, P(*(None if a in gathered else a for a in lead), tail, seq, *rest))

    split = jax.lax.with_sharding_constraint(ids.reshape(*sizes, b // n, s), spec(()))
    rows = jnp.take(table, jax.lax.with_sharding_constraint(split, spec(width_axes)), axis=0)
    rows = jax.lax.with_sharding_constraint(rows, spec(width_axes, width))
    rows = jax.lax.with_sharding_constraint(rows, spec((), None))
    return rows.reshape(b, s, table.shape[1])


# ---- parameters and optimizer state ------------------------------------------------------------

def param_shardings(abstract_state: Any, layout: Layout, purpose: str = "params") -> Any:
    """NamedSharding per parameter leaf, in the same nnx.State structure as the parameters."""
    rules = layout.rules(purpose)

    def one(v: nnx.Variable) -> nnx.Variable:
        names = tuple(v.get_metadata().get("out_sharding") or ()) or (None,) * len(v.shape)
        spec = spec_for(names, rules, layout.mesh)
        if names[:1] == ("layers",):  # a stacked weight: an uneven pipeline split moves `pipeline` off `layers`
            spec = stored_spec(spec, v.shape, layout.strategy)
        return v.replace(NamedSharding(layout.mesh, spec))

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_shardings(abstract_opt_state: Any, abstract_params: Any, layout: Layout) -> Any:
    """Shardings for an optax state: leaves shaped like a parameter follow the optimizer rules
    for that parameter (matched by the tail of their tree path); everything else is replicated."""
    by_path = {}
    opt_sh = param_shardings(abstract_params, layout, "optimizer")
    for path, sh in jax.tree_util.tree_leaves_with_path(opt_sh):
        by_path[_path_key(path)] = sh
    replicated = NamedSharding(layout.mesh, P())

    def one(path, leaf):
        key = _path_key(path)
        for start in range(len(key)):
            if key[start:] in by_path:
                return by_path[key[start:]]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
