"""Compiler workarounds: where the model departs from the plain form to steer XLA's SPMD partitioner.

The model states what it computes and which logical names its arrays carry; the rules table and
jaxpar/core/sharding.py turn the names into shardings, and XLA's SPMD partitioner (GSPMD: Xu et al.
2021, "GSPMD: General and Scalable Parallelization for ML Computation Graphs") inserts the collectives.
At a few places the partitioner, left to itself, moves more than the layouts require. Each such place
calls a function of this module, which spells out the form that moves only what is needed; its plain
form is one line, and `disabled(name)` restores it while a step is traced, so that the compiled
difference can be seen (tests/test_xla_workarounds.py compiles a training step both ways, tallies the
collectives of each and checks that the loss is the same):

    with xla_workarounds.disabled("lookup"):
        trainer = Trainer(model, strategy, tc)       # a fresh one: a jitted step keeps its first trace
        report = jaxpar.analysis.comm.analyze(trainer)

gathered(w, names, dtype)           plain form: w.astype(dtype)
    Avoids: a weight stored sharded over fsdp and read by two dots (a product and the transpose that
    gives its input gradient) gathered once per dot. Used for the norm scales (models/layers.py,
    RMSNorm: the product and, backward, the input gradient), the LM head (models/lm.py: the logits and
    the input gradient; at llama3-70b's shapes under `plan --verify`, 1 GiB per step) and, under
    remat, the attention output projection (models/transformer.py: the recomputed product and the
    input gradient). Here the weight is cast and constrained once to its compute layout (rules
    "compute": the params table without fsdp) and the gradient constrained back to the stored layout.
    Seen on llama-tiny fsdp=2 x tensor=2, sequence parallel, remat = "full" (test_gathered_...):
    without it, 5 more all-gathers of a norm scale over fsdp (2 per layer and the final norm), one
    more of o-proj per layer, one more of the head. Under fsdp8 the norm scales alone differ.

lookup(table, ids, names, dtype, rows)   plain form: jnp.take(table, ids, axis=0).astype(dtype)
    Avoids: the partitioner finding no path from the table's layout to the batch's when the table's
    width is sharded over an axis that also splits the batch (fsdp), with its vocab on tensor or
    the batch also split over a later axis (expert): it replicates the rows over the mesh ("Involuntary
    full rematerialization" in the compile log) and moves them by collective-permutes. Here the ids are
    gathered over the width's axes, each device looks up its width slice of every row, and one
    all-to-all over fsdp takes the rows to the batch layout (its transpose backward, so the table's
    gradient needs no reduction over fsdp); the rows then pass through the [batch, seq, width] layout
    before the residual one (sequence parallelism: straight to a sequence-sharded residual the
    partitioner gathers the ids over tensor). Seen on llama-tiny fsdp=2 x tensor=2 and fsdp=2 x
    expert=2 (the split form, `_split_lookup`; test_lookup_...): without it, collective-permutes over
    fsdp x tensor (fsdp x expert); with it, none, and an all-to-all over fsdp each way. At llama3-70b's
    shapes under pipeline x tensor the plain form all-reduced whole micro-batches over pipeline x tensor.

top_k(scores, k)                    plain form: jax.lax.top_k(scores, k)[1]
    Avoids: the partitioner gathering a batch-sharded lax.top_k operand (the router scores [batch, seq,
    experts]) onto every device. Here the top k are k argmax passes, reductions over the unsharded
    last dim, which stay sharded as their operand. Seen on moe-tiny data=2 (test_top_k_...): without
    it, each layer's scores all-gathered over data.

loop_variant(*arrays)               plain form: arrays
    Avoids: JAX's scan partial evaluation hoisting loop-invariant intermediates out of the loop as stacked
    residuals (jax/_src/lax/control_flow/loops.py, "hoist loop-invariant residuals"; a JAX behaviour, not
    XLA's). An attention kernel inside the model's scan over layers closes over the token positions,
    which are the same in every layer, so every block's causal mask (and, in ring attention, every score
    block computed from a mask) is loop-invariant and would be computed once and kept for every layer:
    the quadratic memory a blockwise or ring kernel exists to avoid. Here the kernel's inputs pass
    through one optimization barrier together, so positions count as depending on q, k, v (no copy).
    Used by jaxpar/ops/blockwise_attention.py (forward and backward) and jaxpar/ops/attention.py
    `ring_attention` (each fold ties the positions to its K block; the positions' own permutes stay
    hoisted). Seen on llama-tiny d_model=256 fsdp=2 x context=4, ring attention, 2 sequences of 2,048 per
    data shard (XLA:CPU's memory analysis, test_loop_variant_...): without it 252 / 219 MiB peak under
    remat none / full, with it 138 / 108 MiB.

ragged_all_to_all_runs(platform)    the backend rule for the grouped MoE kernel's transfer
    Avoids: `jax.lax.ragged_all_to_all` on XLA:CPU, which does not implement it (the compile fails).
    jaxpar/ops/moe_grouped.py moves its routed copies by a ragged all-to-all on GPU and TPU and by a
    fixed-capacity bucketed all_to_all elsewhere; the cost model (jaxpar/cost/comm_expert.py) prices
    whichever form this rule picks for the platform it prices.

ragged_dot_nests(platform)          the backend rule for the grouped MoE kernel's matmuls in nested vmaps
    Avoids: jax.lax.ragged_dot under two vmaps on XLA:CPU, whose lowering (JAX's dense expansion of
    ragged_dot_general) fails for two batch dims (JAX 0.12: "vmap in_axes must be an int ... got
    (np.int64(0), 0)"); GPU and TPU lower it to one ragged dot instruction. Inside the pipeline's vmaps
    over stages and weight copies on CPU, jaxpar/ops/moe_grouped.py writes the same product as the dense
    masked einsum XLA:CPU expands ragged_dot into. Seen on moe-tiny:layers=4 pipeline=2,expert=2,data=2
    (tests/test_cost_vs_hlo.py).

release_compiled_code(share)        for a long-lived process that compiles thousands of steps
    Avoids: XLA:CPU segfaulting in a compile once the process holds the kernel's limit of memory
    mappings (Linux vm.max_map_count, 65,530 by default). Each executable XLA:CPU compiles maps its
    machine code (about 7 mappings for a small jitted function here), and JAX keeps every executable
    while its jitted function's cache lives; when mmap fails inside LLVM's code allocator the compile
    dies with SIGSEGV, not an error. Seen in the slow test run's long-lived pytest worker, after ~50,000
    mappings (tests/conftest.py checks between tests). When the mappings pass `share` of the
    limit, it empties JAX's caches (`jax.clear_caches`: later calls compile again) and collects garbage.

Workarounds that are part of a kernel or a schedule stay there, each stated where it lives:
  - jaxpar/ops/collective_matmul.py: the custom VJPs compute a weight's gradient as one dot with the
    gathered activation, not the n partial dots autodiff of the ring gives, which XLA:CPU would
    all-reduce over the batch axes one by one (it does not reassociate all-reduces).
  - jaxpar/ops/moe.py `moe_experts`: an expert width split over tensor runs in shard_map, each shard
    summing its output after the combine, where the partitioner would sum the E-times-larger dispatch
    buffers; `_varying` makes the backward sum the tokens' gradient, not the buffers'.
  - jaxpar/pipeline/stages.py and one_f_one_b.py: the weights read inside the pipeline loop are
    gathered over fsdp before it and copied once per batch shard, so that their gradient is reduced
    over the batch axes once per step, not in every iteration.
  - jaxpar/ops/blockwise_attention.py `RESIDUAL_NAMES`: the kernel names its output and logsumexp, and the
    remat policies that save dots save them too (models/lm.py), because a custom VJP's forward rule is
    rematerialised under the enclosing checkpoint's policy, and a policy that saves dots alone keeps every
    block pair's scores to rerun it (a JAX behaviour). Seen on llama3-70b fsdp=256 x tensor=2, seq 8,192,
    under `dots` (XLA:CPU's memory analysis): without the names 726 GiB per device, with them 64.
  - jaxpar/ops/attention.py `ring_attention`: each fold is recomputed backward through a custom VJP
    rather than jax.checkpoint, because an enclosing checkpoint's policy (a pipeline iteration's)
    would overrule a nested one and keep every block's scores (a JAX behaviour, not XLA's); and its
    moved K/V blocks and running statistics carry `RING_NAMES`, saved by the policies that save dots, for
    the reason of the blockwise kernel's names (same repro, remat dots: 511 MiB with neither fix, 289 with
    the barrier alone, 131 with the names too). The cost model's ring collectives follow: no K/V moved
    again backward under those policies (jaxpar/cost/comm_context.py RING_KEPT).
"""
from __future__ import annotations

import contextlib
import contextvars
import gc
import pathlib
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core.rules import DATA_AXES
from jaxpar.core.sharding import constrain, current_layout, spec_for

NAMES = ("gathered", "lookup", "top_k", "loop_variant")

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
    layout = current_layout()
    if layout is None or not active("gathered"):
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
    whatever layout the caller constrains them to next."""
    layout = current_layout()
    if layout is None or not active("lookup"):
        return jnp.take(table, ids, axis=0).astype(dtype)
    return constrain(_lookup_in_table_layout(table, ids, names, layout).astype(dtype), rows)


def _lookup_in_table_layout(table: jax.Array, ids: jax.Array, names: Sequence[str | None], layout) -> jax.Array:
    """The rows of `ids` in the table's layout: [batch without the width axes, seq, width on them]."""
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
    tail = None if not after else after[0] if len(after) == 1 else after

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


# ---- release_compiled_code: a long-lived process under the kernel's memory-mapping limit ------------

MAPS = pathlib.Path("/proc/self/maps")
MAP_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")


def memory_mappings() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where Linux's /proc does not say."""
    try:
        with MAPS.open() as f:
            held = sum(1 for _ in f)
        return held, int(MAP_LIMIT.read_text())
    except (OSError, ValueError):
        return None


def near_map_limit(share: float = 0.5) -> bool:
    """Whether this process holds more than `share` of the kernel's limit of memory mappings."""
    counts = memory_mappings()
    return counts is not None and counts[0] >= share * counts[1]


def release_compiled_code(share: float = 0.5) -> bool:
    """Empty JAX's caches of compiled executables when this process's memory mappings pass `share` of the
    kernel's limit, so that XLA:CPU's next compile can map its code (module docstring: why). Executables the
    caller holds itself (a `Compiled`, a cache of them) stay mapped: drop those first. Returns whether it
    released."""
    if not near_map_limit(share):
        return False
    jax.clear_caches()
    gc.collect()
    return True
