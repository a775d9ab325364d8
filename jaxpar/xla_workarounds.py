"""Compiler workarounds: where the model departs from the plain form to steer XLA's SPMD partitioner (GSPMD:
Xu et al. 2021) or JAX's autodiff, each in one function whose plain form is one line.

    gathered(w, names, dtype)     w.astype(dtype): a weight read by two dots gathered once, not per dot
    float8_gathered(q, layout)    q: a float8 weight's FSDP all-gather kept in float8
    lookup(table, ids, ...)       jnp.take: an embedding lookup whose table's width (or, under ZeRO-1, its
                                  gradient's) is sharded over the batch's axes, moved by one all-to-all,
                                  not replicated and permuted
    top_k(scores, k)              lax.top_k: the router's choice as k argmax passes, kept batch-sharded
    loop_variant(*arrays)         arrays: a kernel's inputs through one optimization barrier, so the scan
                                  over layers hoists no per-layer mask or score block as a residual
    ragged_all_to_all_runs, ragged_dot_nests   the backends that compile the grouped MoE kernel's ragged ops
    compile_initializer(lowered, platform)   lowered.compile(): on XLA:CPU at backend optimisation level 1, the
                                  same bits in a quarter of the time (the parameters' random initialiser)

`disabled(name)` restores the plain form while a step is traced, so the compiled difference can be seen
(tests/test_xla_workarounds.py compiles a step both ways and asserts what each saves, with the loss equal):

    with xla_workarounds.disabled("lookup"):
        trainer = Trainer(model, strategy, tc)       # a fresh one: a jitted step keeps its first trace

Workarounds that are part of a kernel or a schedule stay there, each stated where it lives; docs/design.md
("Compiler workarounds") tells what each avoids and lists those.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core.rules import DATA_AXES, spec_entry
from jaxpar.core.sharding import constrain, current_layout, spec_for

NAMES = ("gathered", "float8_gathered", "lookup", "top_k", "loop_variant")

_OFF: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("jaxpar_xla_workarounds_off",
                                                                      default=frozenset())


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """While tracing inside it, the named workarounds (all of them when none is named) take their plain
    form, so that the compiled step shows what XLA does without them. For tests and for the curious: a
    jitted function traced once keeps what it saw, so build a fresh one (a new Trainer) inside."""
    unknown = set(names) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown XLA workaround(s) {sorted(unknown)}; known: {', '.join(NAMES)}")
    token = _OFF.set(_OFF.get() | frozenset(names or NAMES))
    try:
        yield
    finally:
        _OFF.reset(token)


def active(name: str) -> bool:
    """Whether workaround `name` is in force (it is, unless inside `disabled`)."""
    return name not in _OFF.get()


# ---- gathered: a weight gathered once for all its reads -----------------------------------------

def gathered(w: jax.Array, names: Sequence[str | None], dtype) -> jax.Array:
    """`w.astype(dtype)`, gathered once to the layout its matmuls read (rules "compute": FSDP's
    all-gather target) for all its uses; its gradient goes back to the stored layout in float32 (the
    cast's transpose first, so the sums are float32 as in the plain form). Module docstring: why.

    A custom VJP rather than a plain constraint: under the pipeline's vmap over stages a weight may be
    shared by every stage (the LM head), and a constraint's transpose would act on the gradient after
    the sum over stages (the whole head summed over pipeline, then scattered over fsdp); the custom
    VJP's backward runs per stage, so each stage's gradient is scattered over fsdp first and only its
    shard summed."""
    layouts = _weight_layouts(names)
    if layouts is None or not active("gathered"):
        return w.astype(dtype)
    compute, stored = layouts

    @jax.custom_vjp
    def gather(w):
        return jax.lax.with_sharding_constraint(w.astype(dtype), compute)

    def forward(w):
        return gather(w), None

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g.astype(w.dtype), stored),)

    gather.defvjp(forward, backward)
    return gather(w)


def _weight_layouts(names: Sequence[str | None]) -> tuple[NamedSharding, NamedSharding] | None:
    """(compute, stored): the layout a weight with logical `names` is gathered to for its matmuls and the one
    it is stored in; None outside a layout, or inside a vmap over the batch's shards (a pipeline's per-shard
    weight copies: the weight arrives gathered, and its sharded axes are the vmap's, which no constraint may
    name)."""
    layout = current_layout()
    if layout is None:
        return None
    mesh = layout.mesh
    compute = NamedSharding(mesh, spec_for(names, layout.rules("compute"), mesh))
    stored = NamedSharding(mesh, spec_for(names, layout.rules("params"), mesh))
    held = {a for d in stored.spec if d is not None for a in ((d,) if isinstance(d, str) else d)}
    batch = {a for a in DATA_AXES if mesh.shape[a] > 1}
    return None if held & (batch - set(layout.axes("batch"))) else (compute, stored)


def cast(w: jax.Array, names: Sequence[str | None], dtype) -> jax.Array:
    """`gathered`'s plain form: `w.astype(dtype)`, gathered by the partitioner for each read (for a weight whose
    reads all sit in one pass, which a gathered copy would only keep alive)."""
    del names
    return w.astype(dtype)


# ---- float8_gathered: a float8 weight gathered as float8 ---------------------------------------------

def float8_gather_layout(names: Sequence[str | None]) -> NamedSharding | None:
    """The layout `float8_gathered` gathers a weight with logical `names` to (rules "compute"), resolved
    while the forward pass is traced (the backward, traced later, has no current layout); None where the
    weight is not gathered so (outside a layout, or the workaround disabled)."""
    layouts = _weight_layouts(names)
    return None if layouts is None or not active("float8_gathered") else layouts[0]


def float8_gathered(q: jax.Array, layout: NamedSharding | None) -> jax.Array:
    """`q`, a weight quantized to float8 in its stored layout (jaxpar/ops/fp8.py), constrained to `layout`
    (`float8_gather_layout`), so that FSDP's all-gather moves float8. Through uint8: constrained as float8,
    XLA:TPU (libtpu 0.0.52) moves the dequantizing convert and multiply ahead of the gather and gathers
    float32 (4 bytes an element, twice bfloat16's), XLA:CPU likewise; as uint8 both gather the float8
    bytes (XLA:CPU widens them to float16: `Compiler.float8_bytes`). Plain form: `q`."""
    if layout is None:
        return q
    bits = jax.lax.with_sharding_constraint(jax.lax.bitcast_convert_type(q, jnp.uint8), layout)
    return jax.lax.bitcast_convert_type(bits, q.dtype)


# ---- lookup: an embedding lookup whose table is sharded over the batch's axes ----------------------

def lookup(table: jax.Array, ids: jax.Array, names: Sequence[str | None], dtype,
           rows: Sequence[str | None]) -> jax.Array:
    """`jnp.take(table, ids, axis=0).astype(dtype)` for a parameter table [vocab, width] with logical
    `names` and ids [batch, seq], the rows leaving in the layout of the activation names `rows` ([batch,
    seq, width] with the batch sharded as the activations say). Module docstring: why.

    When the table's width is sharded over axes that also split the batch (FSDP: `embed` on fsdp),
    each device holds a slice of every row but only its own sequences' ids. The lookup is then stated
    step by step: the ids are gathered over those axes, every device looks its width slice of all
    their rows up (the table stays put; a vocab dim sharded over `tensor` gives partial rows), the
    rows are cast and then constrained to `rows`: one all-to-all over the width axes (its transpose
    backward, so the table's gradient needs no reduction over them) and the sum of the partial rows
    over `tensor`. Without such axes only the last step remains: the rows pass through `rows` before
    whatever layout the caller constrains them to next. Under ZeRO-1 (the gradient's width sharded where
    the table's is not): `_lookup_scattering_gradient`."""
    layout = current_layout()
    if layout is None or not active("lookup"):
        return jnp.take(table, ids, axis=0).astype(dtype)
    if _width_axes(names, layout, "params") != _width_axes(names, layout, "optimizer"):
        return constrain(_lookup_scattering_gradient(table, ids, names, dtype, layout), rows)
    return constrain(_lookup_in_table_layout(table, ids, names, layout).astype(dtype), rows)


def _width_axes(names: Sequence[str | None], layout, purpose: str) -> tuple[str, ...]:
    """The mesh axes the table's width (its second dim) is sharded over under the rules of `purpose`."""
    width = tuple(spec_for(names, layout.rules(purpose), layout.mesh))
    width = width[1] if len(width) > 1 else None
    return () if width is None else (width,) if isinstance(width, str) else tuple(width)


def _batch_layout(layout) -> tuple[tuple[str, ...], object]:
    """(the mesh axes the batch dim is split over, in order; the seq dim's spec entry) of the activations."""
    acts = tuple(spec_for(("batch", "seq"), layout.rules("activations"), layout.mesh)) + (None, None)
    return (acts[0],) if isinstance(acts[0], str) else tuple(acts[0] or ()), acts[1]


def _lookup_scattering_gradient(table: jax.Array, ids: jax.Array, names: Sequence[str | None], dtype,
                                layout) -> jax.Array:
    """`lookup` under ZeRO-1: the table whole over the batch's axes, its gradient's width sharded over them
    (rules "optimizer"). Forward the plain take; backward the rows' gradient goes to the width layout by
    one all-to-all and each device scatters its width slice of every row, so the gradient needs no sum
    over those axes. Left to the partitioner under data x tensor (the vocab on tensor), the gradient's
    shard propagates into the backward and XLA warns of an involuntary full rematerialization
    (llama3-8b's data4 x tensor2 pick: 16 GiB of all-gathers over data, and the token ids moved)."""
    mesh, width_axes = layout.mesh, _width_axes(names, layout, "optimizer")
    batch, seq = _batch_layout(layout)
    kept = tuple(a for a in batch if a not in width_axes)
    if not set(width_axes) <= set(batch) or any(batch.index(a) > max(map(batch.index, width_axes)) for a in kept):
        return jnp.take(table, ids, axis=0).astype(dtype)
    spread = NamedSharding(mesh, P(spec_entry(kept), seq))
    by_width = NamedSharding(mesh, P(spec_entry(kept), seq, spec_entry(width_axes)))
    grad = NamedSharding(mesh, spec_for(names, layout.rules("optimizer"), mesh))

    @jax.custom_vjp
    def take(table, ids):
        return jnp.take(table, ids, axis=0).astype(dtype)

    def forward(table, ids):
        return take(table, ids), ids

    def backward(ids, g):   # g in the compute dtype, as the cast's transpose gives it; summed in the table's
        ids = jax.lax.with_sharding_constraint(ids, spread)
        g = jax.lax.with_sharding_constraint(g, by_width).astype(table.dtype)
        return jax.lax.with_sharding_constraint(jnp.zeros(table.shape, table.dtype).at[ids].add(g), grad), None

    take.defvjp(forward, backward)
    return take(table, ids)


def _lookup_in_table_layout(table: jax.Array, ids: jax.Array, names: Sequence[str | None], layout) -> jax.Array:
    """The rows of `ids` in the table's layout: [batch without the width axes, seq, width on them]."""
    mesh = layout.mesh
    width_axes = _width_axes(names, layout, "params")
    width = spec_entry(width_axes) if width_axes else None
    batch, seq = _batch_layout(layout)
    if not set(width_axes) & set(batch):
        return jnp.take(table, ids, axis=0)
    kept = tuple(a for a in batch if a not in width_axes)
    last = max(batch.index(a) for a in width_axes)
    if any(batch.index(a) > last for a in kept):
        return _split_lookup(table, ids, batch, width_axes, width, seq)
    kept_dim = spec_entry(kept)
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(mesh, P(kept_dim, seq)))
    rows = jnp.take(table, ids, axis=0)
    return jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, P(kept_dim, seq, width)))


def _split_lookup(table: jax.Array, ids: jax.Array, batch: tuple[str, ...], width_axes: tuple[str, ...],
                  width, seq) -> jax.Array:
    """`lookup` when a batch axis that keeps its split comes after one of the table's width axes in the
    batch's order (fsdp x expert: the batch split fsdp-major, `embed` on fsdp). The device at (f, e)
    holds batch block f*E + e; gathering over fsdp gives it blocks {e, E + e}, which no sharding of one
    batch dim over `expert` describes (P(expert) means blocks 2e, 2e + 1). So the batch dim is split
    into one dim per batch axis up to the last width axis, each sharded over its axis, and the rest,
    split over the batch axes after it ([F, B/F] sharded (fsdp, expert)): the gather over the width
    axes and the all-to-all back are then the plain ones `lookup` describes. The rows leave in the
    batch layout (width dim whole, `seq` as the activations), and the reshape back to [batch, seq,
    width] moves nothing."""
    mesh = current_layout().mesh
    last = max(batch.index(a) for a in width_axes) + 1
    lead, after = batch[:last], batch[last:]           # one dim per leading axis, the rest split over `after`
    sizes = tuple(mesh.shape[a] for a in lead)
    b, s = ids.shape
    n = 1
    for k in sizes:
        n *= k
    tail = spec_entry(after)

    def spec(gathered: tuple[str, ...], *rest) -> NamedSharding:
        return NamedSharding(mesh, P(*(None if a in gathered else a for a in lead), tail, seq, *rest))

    split = jax.lax.with_sharding_constraint(ids.reshape(*sizes, b // n, s), spec(()))
    rows = jnp.take(table, jax.lax.with_sharding_constraint(split, spec(width_axes)), axis=0)
    rows = jax.lax.with_sharding_constraint(rows, spec(width_axes, width))
    rows = jax.lax.with_sharding_constraint(rows, spec((), None))
    return rows.reshape(b, s, table.shape[1])


# ---- top_k: the router's choice as k argmax passes ----------------------------------------------

def top_k(scores: jax.Array, k: int) -> jax.Array:
    """`jax.lax.top_k(scores, k)[1]` (indices of the k largest scores along the last dim, largest
    first, ties to the lower index) as k argmax passes: an argmax is a reduction over the last dim,
    which the partitioner leaves sharded as its operand. Module docstring: why."""
    if not active("top_k"):
        return jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    picked = []
    for _ in range(k):
        i = jnp.argmax(scores, axis=-1)
        picked.append(i)
        scores = jnp.where(jax.nn.one_hot(i, scores.shape[-1], dtype=jnp.bool_), -jnp.inf, scores)
    return jnp.stack(picked, axis=-1).astype(jnp.int32)


# ---- ragged_all_to_all_runs: which all-to-all the grouped MoE kernel uses ----------------------------

RAGGED_ALL_TO_ALL_PLATFORMS = ("gpu", "tpu")


def loop_variant(*arrays):
    """`arrays`, through one optimization barrier: each counts as depending on all the others, so none
    that depends only on loop-invariant values (an attention kernel's positions inside the scan over
    layers) is hoisted out of an enclosing scan's loop as a stacked residual (module docstring)."""
    if not active("loop_variant"):
        return arrays
    return jax.lax.optimization_barrier(arrays)


def ragged_all_to_all_runs(platform: str) -> bool:
    """Whether a `platform` (a jax Device.platform: cpu | gpu | tpu) compiles `jax.lax.ragged_all_to_all`:
    XLA's GPU and TPU backends do, XLA:CPU does not (unimplemented in jax 0.12's XLA), so there the grouped
    MoE kernel sends fixed-capacity buckets by a plain all_to_all (jaxpar/ops/moe_grouped.py). Module
    docstring: why."""
    return platform in RAGGED_ALL_TO_ALL_PLATFORMS


def ragged_dot_nests(platform: str) -> bool:
    """Whether `jax.lax.ragged_dot` lowers under nested vmaps on a `platform` (cpu | gpu | tpu): GPU and TPU
    lower it to a ragged dot instruction with batch dims; XLA:CPU's dense expansion fails for two batch
    dims in JAX 0.12. Module docstring: why."""
    return platform in RAGGED_ALL_TO_ALL_PLATFORMS


# ---- compile_initializer: the random initialiser at XLA:CPU's backend optimisation level 1 --------------

INITIALIZER_CPU_OPTIONS = {"xla_backend_optimization_level": 1}


def compile_initializer(lowered: jax.stages.Lowered, platform: str) -> jax.stages.Compiled:
    """`lowered.compile()` for a function that only creates parameters (threefry bits, erf_inv): on XLA:CPU
    at backend optimisation level 1, which writes the default level's bits (tests/test_xla_workarounds.py)
    in a quarter of the time (llama-tiny 3.3 -> 1.2 s, hybrid-tiny 40 -> 10.5 s), so a tiny model's
    start-up is not slower than its step's compile. Level 0 changes erf_inv's bits. `platform`: the devices'
    (a jax Device.platform); other backends, and a process whose XLA_FLAGS choose a level (the test
    suite's), compile as they would."""
    chosen = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    return lowered.compile(compiler_options=None if platform != "cpu" or chosen else INITIALIZER_CPU_OPTIONS)
