"""The collectives one weight causes, by the textbook's rules: the per-weight view of comm_data.py and
comm_tensor.py, which `jaxpar explain` prints (jaxpar/planning/explain.py builds the `View` from the model's
shardings, and tests/test_explain.py finds each listed collective in the compiled step's HLO).

  * data parallelism (`data_moves`): the activations that read a weight are split over the batch and
    sequence axes, so its gradient is a sum over those splits: all-reduced over an axis the weight is
    replicated on (DDP; Li et al. 2020); over one it is sharded on (ZeRO-3 / FSDP) the shard is gathered
    before use, forward and again backward, and the gradient reduce-scattered back (Rajbhandari et al.
    2020, 5.3; Zhao et al. 2023, 3.2); over one only the optimizer rules shard (ZeRO-1) the gradient is
    reduce-scattered onto the moments' shards and the updated parameter gathered after the update. jaxpar
    keeps the norms' scales and the weights outside the layer loop gathered for the backward pass.
  * tensor parallelism (`tensor_moves`): a weight that reads the residual stream with another dim on
    `tensor` is column-parallel (its input gradient all-reduced backward), one that writes it row-parallel
    (its output all-reduced forward): Megatron's f and g (Shoeybi et al. 2019, 3); under sequence
    parallelism each all-reduce is a reduce-scatter and an all-gather (Korthikanti et al. 2022, 4.2.2).
  * the looked-up table (`lookup_moves`): vocab-parallel rows are partial sums over `tensor`; a table
    sharded on its width over a batch axis is not gathered: the ids are, and the rows go back by an
    all-to-all (jaxpar.xla_workarounds.lookup).
Bytes are per device per execution, the full buffer, as the HLO tally counts it; `times` executions per step.
Each `Move` names the cost-model function that predicts it for the whole step (`rule`).
"""
from __future__ import annotations

import dataclasses
import math

from jaxpar.core.strategy import AXES
from jaxpar.cost.flops import unit_policy

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "float8": 1}   # a buffer's element


@dataclasses.dataclass(frozen=True)
class Move:
    """One collective the step issues for the weight, `times` per step; `nbytes` per execution (the full
    buffer) of a buffer of `shape` and `dtype`; `rule`: the cost model's function (module.name) that
    predicts it for the whole step; `shared`: one op serves several weights (the input all-gather of every
    projection that reads the same activations)."""
    phase: str
    kind: str
    axes: tuple[str, ...]
    times: int
    shape: tuple[int, ...]
    dtype: str
    why: str
    rule: str
    shared: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Reads:
    """What sizes the buffers that read and write a weight: the mesh's axis sizes, the axes the activation
    rules split the batch, the sequence and the residual stream's sequence over, the batch and sequence
    one device holds per micro-batch, the model width, the compute dtype, micro-batches per step and the
    remat policy."""
    sizes: tuple[tuple[str, int], ...]
    batch_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    res_seq_axes: tuple[str, ...]
    batch: int
    seq: int
    d_model: int
    compute: str
    micro: int
    remat: str

    def axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes the activation rules give logical `name` (batch | seq | res_seq)."""
        return {"batch": self.batch_axes, "seq": self.seq_axes, "res_seq": self.res_seq_axes}[name]

    def size(self, axes) -> int:
        sizes = dict(self.sizes)
        return math.prod(sizes[a] for a in axes)

    def kept(self, axes) -> tuple[str, ...]:
        sizes = dict(self.sizes)
        return tuple(a for a in AXES if a in axes and sizes[a] > 1)


@dataclasses.dataclass(frozen=True)
class View:
    """The weight on the mesh: logical names and the mesh axes of each dim, per layout, for one layer's
    slice (the stacked `layers` dim dropped), how many slices one device holds, and whether it is stacked."""
    names: tuple[str | None, ...]
    stored: tuple[tuple[str, ...], ...]      # params rules
    optimizer: tuple[tuple[str, ...], ...]   # optimizer rules
    compute: tuple[tuple[str, ...], ...]     # the layout its matmuls read (params without fsdp)
    shape: tuple[int, ...]
    dtype: str
    layers: int                              # stacked slices on one device (its stage's; 1 outside the stack)
    stacked: bool = False                    # a slice of the stacked layer units

    def shard(self, dims: tuple[tuple[str, ...], ...], ctx: Reads) -> tuple[int, ...]:
        return tuple(n // ctx.size(axes) for n, axes in zip(self.shape, dims))

    @staticmethod
    def axes(dims) -> set[str]:
        return {a for axes in dims for a in axes}


def moves(v: View, ctx: Reads) -> list[Move]:
    """Every collective the step issues for the weight, forward first, then backward, then the optimizer's."""
    out = data_moves(v, ctx) + lookup_moves(v, ctx) + tensor_moves(v, ctx)
    return sorted(out, key=lambda m: ("forward", "backward", "optimizer").index(m.phase))


def data_moves(v: View, ctx: Reads) -> list[Move]:
    """Gathers and gradient sums over the axes the reading activations split (module docstring)."""
    lay, where, reduced = ctx, "comm_data.fsdp_gathers", "comm_data.data_parallel"
    vector = v.names == ("embed",)    # a norm's scale: read by the residual stream (`res_seq`)
    split = ctx.kept(lay.axes("batch") + lay.axes("res_seq" if vector else "seq"))
    # a batch axis on the `experts` dim is expert parallelism: the tokens move to the weights, and each
    # expert's gradient is its own; on another dim it is ZeRO: gathered (params rules) or scattered (optimizer)
    experts = v.axes(d for n, d in zip(v.names, v.stored) if n == "experts")
    held = ctx.kept(set(split) & v.axes(d for n, d in zip(v.names, v.stored) if n != "experts"))
    zero1 = ctx.kept(set(split) & v.axes(v.optimizer) - set(held) - experts)
    summed = tuple(a for a in split if a not in held + zero1 and a not in experts)
    execs, out = v.layers * ctx.micro, []
    lookup = v.names[0] == "vocab"
    if held and not lookup:
        gathered = v.shard(v.compute, ctx)
        dtype = "float32" if vector else ctx.compute
        out.append(Move("forward", "all-gather", held, execs, gathered, dtype,
                        "the shard gathered to the layout its reads use", where))
        # kept for the backward pass: a norm's scale (but recomputed where the unit is), the weights outside the loop
        if v.stacked and (not vector or unit_policy(ctx.remat) != "none"):
            out.append(Move("backward", "all-gather", held, execs, gathered, dtype,
                            "gathered again for the backward pass (the forward's copy was freed)", where))
        out.append(Move("backward", "reduce-scatter", held, execs, gathered, "float32",
                        "the gradient summed over the shards' batches, each keeping its shard", reduced))
    stored = v.shard(v.stored, ctx)
    if zero1:   # the update runs on the whole array (every stacked layer at once)
        whole = ((v.layers,) if v.stacked else ()) + stored
        if not lookup:
            out.append(Move("backward", "reduce-scatter", zero1, v.layers, stored, "float32",
                            "ZeRO-1: the gradient summed and scattered onto the moments' shards", reduced))
        out.append(Move("optimizer", "all-gather", zero1, 1, whole, "float32",
                        "ZeRO-1: the updated parameter gathered back to every replica", reduced))
    sequence = tuple(a for a in summed if a not in lay.axes("batch") + lay.axes("seq"))   # sequence parallelism's
    if sequence:
        out.append(Move("backward", "all-reduce", sequence, execs, v.shard(v.compute, ctx), "float32",
                        "sequence parallel: the partial gradients of the ranks' sequence shards, summed in the "
                        "layer's backward pass (Megatron's layer-norm gradient all-reduce)", reduced))
    replicas = tuple(a for a in summed if a not in sequence)
    if replicas:
        out.append(Move("backward", "all-reduce", replicas, v.layers, v.shard(v.stored, ctx), "float32",
                        "the gradient summed over the replicas, which read other tokens", reduced))
    return out


def tensor_moves(v: View, ctx: Reads) -> list[Move]:
    """Column- and row-parallel activations' collectives (module docstring)."""
    lay, where = ctx, "comm_tensor.tensor_parallel"
    inner = [n for n in v.names if n != "experts"]
    split = ctx.kept(v.axes(d for n, d in zip(v.names, v.stored) if n not in ("embed", "experts"))
                     - set(lay.axes("batch")))
    if not split or len(inner) < 2 or "embed" not in (inner[0], inner[-1]) or inner[0] == "vocab":
        return []
    sp = set(split) <= set(lay.axes("res_seq"))
    x = (ctx.batch, ctx.seq, ctx.d_model)   # the input or output, whole over `tensor` (gathered, or pre-scatter)
    execs = v.layers * ctx.micro
    if inner[0] == "embed":   # column-parallel: reads the residual stream
        if sp:
            return [Move("forward", "all-gather", split, execs, x, ctx.compute,
                         "sequence parallel: the input gathered over the sequence (one op for every "
                         "projection of this input)", where, shared=True),
                    Move("backward", "reduce-scatter", split, execs, x, ctx.compute,
                         "column-parallel: the input gradient's partial sums, scattered onto the sequence", where)]
        return [Move("backward", "all-reduce", split, execs, x, ctx.compute,
                     "column-parallel: the input gradient's partial sums over the ranks' outputs", where)]
    if sp:                    # row-parallel: writes the residual stream
        return [Move("forward", "reduce-scatter", split, execs, x, ctx.compute,
                     "row-parallel: the output's partial sums, scattered onto the sequence", where),
                Move("backward", "all-gather", split, execs, x, ctx.compute,
                     "sequence parallel: the output gradient gathered over the sequence", where)]
    return [Move("forward", "all-reduce", split, execs, x, ctx.compute,
                 "row-parallel: the output's partial sums over the ranks' inputs", where)]


def lookup_moves(v: View, ctx: Reads) -> list[Move]:
    """The table looked up by token id (module docstring). Its width sharded over batch axes by the
    params rules (ZeRO-3) or, for the gradient, the optimizer's (ZeRO-1): the ids are gathered over them
    and the rows (ZeRO-3) or their gradient (both) go between the table's layout and batch sharding by
    an all-to-all, which leaves the gradient sharded like the table, so it is not reduce-scattered."""
    if v.names[0] != "vocab":
        return []
    lay, where, vocab = ctx, "comm_data.embedding_lookup", "comm_tensor.tp_vocab"
    stored = ctx.kept(set(v.stored[1]) & set(lay.axes("batch")))
    width = ctx.kept(set(v.stored[1] + v.optimizer[1]) & set(lay.axes("batch")))
    rows_split = ctx.kept(set(v.stored[0]) - set(lay.axes("batch")))
    n, d, out = ctx.size(stored), ctx.d_model, []
    x = (ctx.batch, ctx.seq, d)   # the rows in batch sharding
    if width:
        out.append(Move("forward", "all-gather", width, ctx.micro, (ctx.batch * ctx.size(width), ctx.seq), "int32",
                        "the token ids gathered: the table's width shards look every id up", where))
    if rows_split:
        # sequence parallel: the sum is scattered onto the sequence, unless the rows still have to go
        # back to batch sharding (the table's width over batch axes): the scatter is then a slice after it
        scatter = set(rows_split) <= set(lay.axes("res_seq")) and not stored
        out.append(Move("forward", "reduce-scatter" if scatter else "all-reduce", rows_split, ctx.micro,
                        (ctx.batch * n, ctx.seq, d // n), v.dtype,
                        "vocab-parallel: each rank's rows are partial (zero outside its vocabulary), summed"
                        + (" and scattered onto the sequence" if scatter else ""), vocab))
        if set(rows_split) <= set(lay.axes("res_seq")):
            out.append(Move("backward", "all-gather", rows_split, ctx.micro, x, v.dtype,
                            "sequence parallel: the rows' gradient gathered over the sequence", vocab))
    phases = ("forward", "backward") if stored else ("backward",) if width else ()
    out += [Move(phase, "all-to-all", width, ctx.micro, x, v.dtype,
                 "the rows between the table's width layout and batch sharding", where) for phase in phases]
    return out
