"""`jaxpar explain`: the collectives it lists for a parameter are the compiled step's, and its chain points
at the lines it names.

The compiled side: each collective instruction of the step (jaxpar.analysis.tally.collective_ops) is
split into the buffers it moves (the elements of a combined, tuple-shaped op: XLA's combiner merges
the gradient sums of a layer's weights into one op), each with its kind, mesh axes, phase,
executions per step, dims and bytes. Every parameter's explanation is matched against them, one
compiled buffer per listed collective (a collective listed as shared by several weights, the input
gather of the projections that read one activation, matches without using its buffer up), by kind,
axes, phase, executions, bytes and dims (as a multiset without unit dims: XLA may transpose a buffer or
add a unit dim to it). One difference is XLA:CPU's, not the layout's: it forms no reduce-scatter, so a
listed reduce-scatter is found as an all-reduce of the same full buffer whose sum is sliced afterwards
(for the column-parallel input gradients, after adding the projections' sums: XLA:CPU does not
reassociate them); for the weights' gradients, the test checks that those all-reduces are only sliced.
Then, for the query projection, an MLP weight and the embedding, every listed collective was found, and
no compiled weight collective over the batch axes with the parameter's shape is left unclaimed; for
every other weight, every listed collective was found, or the compiler's other form of it
(`_compiler_forms`).
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from jaxpar.analysis import patterns
from jaxpar.analysis.hlo_text import is_scalar, parse_module, result_shape, shape_bytes, tuple_elements
from jaxpar.analysis.tally import collective_ops
from jaxpar.cli.main import main as cli
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.planning import explain
from tests import harness

MODEL = "llama-tiny"
LAYOUTS = ("dp2-fsdp2-tp2", "tp4-sp")
TARGETS = ("attn.wq", "mlp.w_up", "embedding")   # the query projection, an MLP weight, the embedding
BATCH_AXES = {"data", "fsdp"}

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer a compiled collective moves."""
    op: str
    kind: str
    axes: tuple[str, ...]
    phase: str
    times: int
    dims: tuple[int, ...] | None   # sorted; None for an all-to-all (matched by its bytes)
    nbytes: int


def _dims(shape) -> tuple[int, ...]:
    """Dims as a sorted multiset without 1s (XLA may transpose a buffer, or add a unit dim to it)."""
    if isinstance(shape, str):
        shape = [int(d) for d in shape[shape.index("[") + 1:shape.index("]")].split(",") if d]
    return tuple(sorted(d for d in shape if d != 1))


@functools.cache
def compiled_buffers(mesh: str) -> tuple[Buffer, ...]:
    tr = harness.trainer(MODEL, mesh)
    module = parse_module(harness.compiled_text(MODEL, mesh))
    instrs = {i.name: i for body in module.computations.values() for i in body}
    ids = np.arange(tr.mesh.size).reshape(tuple(tr.mesh.shape.values()))
    out = []
    for op in collective_ops(module, tr.mesh.axis_names, ids):
        if op.kind == "all-to-all":
            out.append(Buffer(op.name, op.kind, op.axes, op.phase, op.times, None, op.bytes))
            continue
        for element in tuple_elements(result_shape(instrs[op.name])):
            if not is_scalar(element):
                out.append(Buffer(op.name, op.kind, op.axes, op.phase, op.times, _dims(element), shape_bytes(element)))
    return tuple(out)


@functools.cache
def explanations(mesh: str) -> dict[str, explain.Explanation]:
    model = parse_model(MODEL)
    lm = explain.abstract_model(model)
    strategy = parse_strategy(mesh).resolved(8)
    return {path: explain.explain(model, MODEL, strategy, path, batch=harness.TC.batch, seq=harness.TC.seq, lm=lm)
            for path in explain.parameters(lm)}


def _fits(move: explain.Move, b: Buffer) -> bool:
    kinds = {"reduce-scatter", "all-reduce"} if move.kind == "reduce-scatter" else {move.kind}
    return (b.kind in kinds and b.axes == move.axes and b.phase == move.phase and b.times == move.times
            and b.nbytes == move.nbytes and (b.dims is None or b.dims == _dims(move.shape)))


@functools.cache
def matched(mesh: str) -> tuple[dict, set]:
    """({(param path, move index): the buffer it was found in, or None}, the buffers no move used)."""
    free = list(compiled_buffers(mesh))
    found = {}
    moves = [(path, i, m) for path, e in explanations(mesh).items() for i, m in enumerate(e.moves)]
    for path, i, m in sorted(moves, key=lambda x: x[2].shared):   # the shared ones last: they use nothing up
        pool = compiled_buffers(mesh) if m.shared else free
        hit = next((b for b in pool if _fits(m, b)), None)
        found[(path, i)] = hit
        if hit is not None and not m.shared:
            free.remove(hit)
    return found, set(free)


@pytest.mark.parametrize("mesh", LAYOUTS)
@pytest.mark.parametrize("query", TARGETS)
def test_collectives_equal_the_compiled_step(mesh: str, query: str):
    e = explain.explain(parse_model(MODEL), MODEL, parse_strategy(mesh).resolved(8), query,
                        batch=harness.TC.batch, seq=harness.TC.seq)
    assert e.moves, f"{query} on {mesh}: no collectives listed"
    found, left = matched(mesh)
    missing = [m for i, m in enumerate(e.moves) if found[(e.param.path, i)] is None]
    assert not missing, f"{query} on {mesh}: listed but not compiled: {missing}"
    # no weight collective with this parameter's shape that no explanation claimed
    shard = e.shard[1:] if e.param.names[0] == "layers" else e.shard
    shapes = {_dims(shard)} | {_dims(m.shape) for m in e.moves if set(m.axes) <= BATCH_AXES}
    unclaimed = [b for b in left if set(b.axes) <= BATCH_AXES and b.dims in shapes]
    assert not unclaimed, f"{query} on {mesh}: compiled but not listed: {unclaimed}"


@pytest.mark.parametrize("mesh", LAYOUTS)
def test_gradient_reduce_scatters_are_sliced_all_reduces(mesh: str):
    """The all-reduces found for listed gradient reduce-scatters (over the batch axes) are exactly the
    compiled step's all-reduces whose result is only sliced to 1/n: reduce-scatters on GPU and TPU."""
    found, _ = matched(mesh)
    listed: dict = {}
    for (path, i), b in found.items():
        move = explanations(mesh)[path].moves[i]
        if b is not None and move.kind == "reduce-scatter" and set(b.axes) <= BATCH_AXES:
            listed[(b.axes, b.phase)] = listed.get((b.axes, b.phase), 0) + b.times * b.nbytes
    tr = harness.trainer(MODEL, mesh)
    ids = np.arange(tr.mesh.size).reshape(tuple(tr.mesh.shape.values()))
    sliced = {(c.axes, c.phase): c.bytes
              for c in patterns.scatter_like_all_reduces(harness.compiled_text(MODEL, mesh), tr.mesh.axis_names, ids)
              if set(c.axes) <= BATCH_AXES}
    assert listed == sliced


def _compiler_forms(mesh: str, path: str, missing: list) -> list:
    """Of the `missing` collectives of parameter `path`, those the compiler does not issue in another
    form: (1) a norm's gradient reduce-scatter over fsdp and all-reduce over data, as one all-reduce of
    the whole vector over data x fsdp (then sliced); (2) the gradient sums of a weight outside the layer
    loop (head, final norm), combined with the optimizer's sums into an op the tally labels `optimizer`."""
    e = explanations(mesh)[path]
    buffers = compiled_buffers(mesh)
    if [n for n in e.param.names if n != "layers"] == ["embed"] and [m.kind for m in missing] == [
            "reduce-scatter", "all-reduce"]:
        rs, ar = missing
        both = tuple(a for a in ("data", "fsdp") if a in rs.axes + ar.axes)
        if any(_fits(dataclasses.replace(rs, kind="all-reduce", axes=both), b) for b in buffers):
            return []
    if e.param.names[0] != "layers":
        missing = [m for m in missing if not (m.kind in ("reduce-scatter", "all-reduce") and any(
            _fits(dataclasses.replace(m, phase="optimizer"), b) for b in buffers))]
    return missing


@pytest.mark.parametrize("mesh", [*LAYOUTS, pytest.param("zero1-dp8", marks=pytest.mark.slow),
                                  pytest.param("fsdp4-tp2-sp", marks=pytest.mark.slow)])
def test_every_weight(mesh: str):
    """Every parameter's collectives are found too (not only the tour's three), but for two forms the
    compiler chooses (`_compiler_forms`); in the slow cases also on ZeRO-1 and on FSDP x sequence-parallel
    tensor parallelism under full remat."""
    found, _ = matched(mesh)
    for path, e in explanations(mesh).items():
        missing = _compiler_forms(mesh, path, [m for i, m in enumerate(e.moves) if found[(path, i)] is None])
        assert not missing, f"{path} on {mesh}: listed but not compiled: {missing}"


def test_textbook_collectives_of_the_query_projection():
    """wq on dp2-fsdp2-tp2 (embed on fsdp, q_heads on tensor), by hand: gathered over fsdp forward and
    backward, its gradient reduce-scattered over fsdp and all-reduced over data, and the input gradient
    (column-parallel) all-reduced over tensor; 2 layers, float32."""
    cfg = parse_model(MODEL)
    e = explanations("dp2-fsdp2-tp2")["runs.0.blocks.0.attn.wq"]
    gathered = (cfg.d_model, cfg.heads // 2, cfg.head_dim)            # whole embed, half the heads
    x = (harness.TC.batch // 4, harness.TC.seq, cfg.d_model)           # batch over data x fsdp
    expect = {("forward", "all-gather", ("fsdp",), gathered), ("backward", "all-gather", ("fsdp",), gathered),
              ("backward", "reduce-scatter", ("fsdp",), gathered),
              ("backward", "all-reduce", ("data",), (cfg.d_model // 2, cfg.heads // 2, cfg.head_dim)),
              ("backward", "all-reduce", ("tensor",), x)}
    assert {(m.phase, m.kind, m.axes, m.shape) for m in e.moves} == expect
    assert all(m.times == cfg.layers for m in e.moves)
    assert str(e.spec) == str(jax.sharding.PartitionSpec(None, "fsdp", "tensor"))
    assert e.bytes["parameter"] == cfg.layers * cfg.d_model * cfg.heads * cfg.head_dim * 4 // 4


def test_chain_points_at_what_it_names():
    e = explanations("dp2-fsdp2-tp2")["runs.0.blocks.0.attn.wq"]
    assert e.param.declared.file.endswith("models/transformer.py")
    assert e.param.declared.text.startswith("self.wq = param(") and '"q_heads"' in e.param.declared.text
    embed = next(r for r in e.rules if r.name == "embed")
    assert embed.where[0].file.endswith("jaxpar/core/rules.py") and embed.where[0].text.startswith('"embed":')
    assert any("zero == 3" in w.text for w in embed.where)
    assert e.spec_source.text.startswith("def spec_for(")
    assert all(explain.where(m).line and explain.where(m).text.startswith("def ") for m in e.moves)


def test_cli(capsys, tmp_path):
    out = tmp_path / "wq.json"
    assert cli(["explain", "attn.wq", "--model", MODEL, "--mesh", "tp4-sp", "--batch", "16", "--seq", "32",
                "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P(None, None, 'tensor')" in text and "models/transformer.py:" in text and "reduce-scatter" in text
    data = json.loads(out.read_text())
    assert data["param"] == "runs.0.blocks.0.attn.wq" and len(data["collectives"]) == 3

    assert cli(["explain", "attn.wx", "--model", MODEL, "--mesh", "tp4-sp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no parameter 'attn.wx' in llama-tiny" in err and "attn.wq" in err


def test_find_by_path_or_tail():
    params = explain.parameters(explain.abstract_model(parse_model(MODEL)))
    for query in ("attn.wq", "wq", "layers.attn.wq", "blocks.0.attn.wq", "runs.0.blocks.0.attn.wq"):
        assert explain.find(params, query, MODEL).path == "runs.0.blocks.0.attn.wq"
    assert explain.find(params, "embedding", MODEL).path == "embedding"
    with pytest.raises(ConfigError, match="'scale' is ambiguous in llama-tiny: it names final_norm.scale, "):
        explain.find(params, "scale", MODEL)
