"""The analytic collectives (jaxpar.cost.comm, XLA:CPU traits) equal the compiled HLO's, strategy by strategy.

For every strategy of the catalogue that resolves on 8 devices (the h100x16-*, h100x64-* and tpu-*
layouts need 128 or more and are analysed with `jaxpar comm --abstract` instead), on llama-tiny
(pipelines: llama-tiny:layers=8, as tests/test_strategies.py), and for the Mamba-2 and hybrid models
under the strategies of tests/test_mamba_model.py, the prediction for `jaxpar.cost.compiler.CPU` is compared with
the collectives of the compiled step (the same executable tests/test_comm.py tallies: compiled once
per session, tests/harness.py) per (kind, mesh axes): counts exactly, bytes within 1%.

Normalisation, the whole of it:
  * scalar operands (f32[]: the loss, the partial sums of the gradient norms) are taken out of every
    op and ops left with nothing are dropped. The model does not predict them: the all-reduce
    combiner merges them into whichever op is near, which is scheduling, not communication
    (at most a few hundred bytes a step);
  * phases are summed: the combiner gives a merged op one phase (a forward-only sum such as the
    label logit is tallied as `optimizer` when it rides with the norm partials);
  * a sub-axis ('pipeline:(1)2': which factor of an axis an all-to-all decomposition uses) is
    compared as its axis.
Everything else, every tensor-sized collective, must match. The per-op walk is checked against
`jaxpar.analysis.tally.tally` first, so the comparison is with the tally, not with a second reading of the HLO.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar.analysis import tally
from jaxpar.cost import comm as cost_comm
from jaxpar.cost import floor as cost_floor
from jaxpar.cost.compiler import CPU, GPU
from jaxpar.cost.shape import step_shape
from jaxpar.core.strategy import catalogue, parse_strategy
from jaxpar.models.config import parse_model
from tests import harness

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

MODEL, PIPELINE_MODEL, MOE_MODEL = "llama-tiny", "llama-tiny:layers=8", "moe-tiny"


def model_for(strategy) -> str:
    """As tests/test_strategies.py (so each compiled step serves both): expert-parallel layouts run moe-tiny."""
    if strategy.size("expert") > 1:
        return MOE_MODEL
    return PIPELINE_MODEL if strategy.size("pipeline") > 1 else MODEL


CATALOGUE = [s for s in harness.distinct(catalogue()) if s.num_devices <= 8]  # same mesh + options: once
TOO_BIG = [s.name for s in catalogue() if s.num_devices > 8]

# Collectives the model does not predict, strategy by strategy, and why (strict xfails: a fix shows).
# None left: the embedding lookup takes the predicted path under fsdp x tensor and fsdp x expert
# (`jaxpar.xla_workarounds.lookup`), norms and o-proj are gathered once under remat (models/layers.py,
# models/transformer.py), and the norms' and head's reductions under data x fsdp are modelled
# (jaxpar/cost/comm_data.py `_without_norms`).
NOT_MODELLED: dict[str, str] = {}

# tests/test_mamba_model.py's strategies (model, mesh, devices, options, why not modelled). Under fsdp the
# hybrid has two pattern units (layers=8), a layer loop as in any real model: with one, XLA drops the
# 1-trip layer loop and its combiner then chains each weight's gradient all-reduce with a gradient-norm
# partial sum (20 ops where the loop has 1), which is scheduling, not communication.
MAMBA_CASES = [
    ("mamba2-tiny", "data=8", 8, {}, None),
    ("mamba2-tiny", "fsdp=8", 8, {}, None),
    ("mamba2-tiny", "data=4,tensor=2", 8, {}, None),
    ("mamba2-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True}, None),
    ("mamba2-tiny", "context=4", 4, {}, None),
    ("mamba2-tiny", "data=2,context=2,tensor=2", 8, {"cp_layout": "zigzag"},
     "the gradients of the weights used inside the shard_map kernels (conv weights and biases, A_log) are "
     "all-reduced over data x context at once and the others over data and over context separately, and the "
     "combiner splits each group's per-layer reduction in two: 5 ops per layer over 3 groups, predicted 2 over 2"),
    ("hybrid-tiny", "context=2,tensor=2", 4, {"attention": "ring"}, None),
    ("hybrid-tiny:layers=8", "fsdp=8", 8, {}, None),
]
# MoE beyond the catalogue's ep* layouts (moe-tiny there): experts over `tensor` without expert parallelism
# (with and without sequence parallelism),
# shared experts with capacity mode, a Jamba-style hybrid, and expert x context (the queue's count gathers).
MOE_CASES = [
    ("moe-tiny", "data=4,tensor=2", 8, {}, None),
    ("moe-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True}, None),
    ("moe-tiny:shared_experts=1,capacity_factor=1.0", "data=2,expert=2,tensor=2", 8, {}, None),
    ("jamba-tiny:layers=8", "data=4,expert=2", 8, {}, None),
    ("moe-tiny", "data=2,context=2,expert=2", 8, {"attention": "ring"}, None),
    # pipeline x expert (jaxpar/pipeline/gpipe.py: the expert kernel inside the stages' vmap): the stage permutes,
    # the head's spread, the expert all-to-alls per layer execution, the dense weights' gradient sums over
    # `expert` in the loop and the router statistics' sums
    ("moe-tiny:layers=4", "pipeline=2,expert=4", 8, {"microbatches": 4}, None),
    ("moe-tiny:layers=4", "pipeline=2,expert=2,data=2", 8, {"microbatches": 4}, None),
]
DEFAULT_MOE = {("moe-tiny", "data=4,tensor=2", ())}

# The remat policies that save dot outputs (`dots`, `dots_no_batch`) still rerun what is no dot output
# in the backward pass: SP's gathered inputs, the context-parallel kernels' moved blocks (found by
# `plan --verify` on llama3-70b plans); the MoE router's statistics are summed once, in the forward pass.
REMAT_CASES = [
    ("llama-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True, "remat": "dots_no_batch"}, None),
    ("llama-tiny", "context=4,tensor=2", 8, {"attention": "ring", "remat": "dots_no_batch"}, None),
    ("mamba2-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True, "remat": "dots_no_batch"}, None),
    ("moe-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True, "remat": "dots"}, None),
    ("llama-tiny:layers=8", "data=2,pipeline=2,tensor=2", 8,
     {"sequence_parallel": True, "remat": "dots_no_batch", "microbatches": 4}, None),
]
DEFAULT_REMAT = {("llama-tiny", "data=4,tensor=2", (("remat", "dots_no_batch"), ("sequence_parallel", True)))}

# overlap=collective_matmul (jaxpar/ops/collective_matmul.py): the all-gathers and reduce-scatters of tensor x SP
# become rings of collective-permutes. By default the layout tests/test_collective_matmul.py compiles (shared);
# the bidirectional ring, remat=full (the recomputed rings) and a MoE model's attention half under `-m slow`.
CM = {"sequence_parallel": True, "overlap": "collective_matmul"}
OVERLAP_CASES = [
    ("llama-tiny", "data=2,tensor=4", 8, CM, None),
    ("llama-tiny", "data=2,tensor=4", 8, {**CM, "overlap": "collective_matmul_bidir"}, None),
    ("llama-tiny", "tensor=8", 8, {**CM, "remat": "full"}, None),
    ("moe-tiny", "data=4,tensor=2", 8, CM, None),
]
DEFAULT_OVERLAP = {("llama-tiny", "data=2,tensor=4", tuple(sorted(CM.items())))}

# 1F1B (jaxpar/pipeline/one_f_one_b.py): per steady tick the head's spread (an all-to-all over `pipeline` each way)
# and its tensor-parallel sums on 1/S of the tokens, and every backward tick's chunk recompute (its gathers
# and sums again, whatever the remat policy); the gradients summed after the loop. By default tensor x SP
# with data (all of these at once); `-m slow` the rest.
ONE_F = {"pp_schedule": "1f1b"}
ONE_F_ONE_B_CASES = [
    ("llama-tiny:layers=8", "data=2,pipeline=2,tensor=2", 8, {**ONE_F, "microbatches": 4, "sequence_parallel": True},
     None),
    ("llama-tiny:layers=8", "data=2,pipeline=2,tensor=2", 8, {**ONE_F, "microbatches": 4}, None),
    ("llama-tiny:layers=8", "pipeline=2,tensor=4", 8,
     {**ONE_F, "microbatches": 2, "sequence_parallel": True, "remat": "full"}, None),
    ("mamba2-tiny:layers=4", "pipeline=2,tensor=2,data=2", 8,
     {**ONE_F, "microbatches": 2, "sequence_parallel": True}, None),
    # interleaved (v = 2): uneven, tensor x SP
    ("llama-tiny:layers=10", "pipeline=2,tensor=2,data=2", 8,
     {**ONE_F, "microbatches": 4, "pp_repeats": 2, "sequence_parallel": True}, None),
    ("llama-tiny:layers=10", "pipeline=4,fsdp=2", 8, {**ONE_F, "microbatches": 4},
     "XLA:CPU's combiner splits the fsdp gradient sums among the optimizer's norm partials: 5 ops over fsdp, "
     "predicted 4 (bytes equal)"),
]
DEFAULT_ONE_F_ONE_B = {("llama-tiny:layers=8", "data=2,pipeline=2,tensor=2",
                        tuple(sorted({**ONE_F, "microbatches": 4, "sequence_parallel": True}.items())))}

# Pipeline x context: the ring's K/V permutes per layer execution (1F1B: again in its chunk recompute), the
# positions per schedule iteration (1F1B: per tick, per layer with a ring of more than one hop), the weights'
# sums over `context` in the loop (their norm scales apart beside the data copies), the head's after it
# (1F1B: per steady tick). By default 1F1B with data (all of these); `-m slow` GPipe and context=4.
PP_CP_CASES = [
    ("llama-tiny:layers=8", "pipeline=2,context=2,data=2", 8, {**ONE_F, "microbatches": 4, "attention": "ring"}, None),
    ("llama-tiny:layers=8", "pipeline=2,context=2,data=2", 8,
     {"microbatches": 2, "attention": "ring", "cp_layout": "zigzag"}, None),
    ("llama-tiny:layers=8", "pipeline=2,context=4", 8, {"microbatches": 2, "attention": "allgather"}, None),
    ("llama-tiny:layers=8", "pipeline=2,context=4", 8, {**ONE_F, "microbatches": 2, "attention": "ring"}, None),
    # Mamba-2's halo permutes and state gathers inside the stages (1F1B: recomputed in its backward ticks)
    ("mamba2-tiny:layers=4", "pipeline=2,context=2,data=2", 8, {**ONE_F, "microbatches": 4, "cp_layout": "zigzag"}, None),
    ("hybrid-tiny:layers=8", "pipeline=2,context=2,data=2", 8,
     {"microbatches": 2, "attention": "ring", "cp_layout": "zigzag"}, None),
]
DEFAULT_PP_CP = {("llama-tiny:layers=8", "pipeline=2,context=2,data=2",
                  tuple(sorted({**ONE_F, "microbatches": 4, "attention": "ring"}.items())))}

# Gradient accumulation outside a pipeline: the accumulation loop's carry is the gradient in the parameters'
# layout, so every micro-batch's sums are issued in it, the embedding's, head's and final norm's after the layer
# loop included (jaxpar.cost.compiler_comm.Loop.after_layers; `plan --verify`'s llama3-8b pick on 8 H100 is
# data4-tensor2 ZeRO-1 with 64 micro-batches). By default ZeRO-1 over data x tensor with SP (the ZeRO-1 lookup's
# all-to-all too: jaxpar.xla_workarounds.lookup); `-m slow` plain data parallelism and FSDP.
ACCUM_CASES = [
    ("llama-tiny", "data=4,tensor=2", 8, {"zero": 1, "sequence_parallel": True, "grad_accum": 2}, None),
    ("llama-tiny", "data=8", 8, {"grad_accum": 2}, None),
    ("llama-tiny", "data=2,fsdp=4", 8, {"grad_accum": 2}, None),
]
DEFAULT_ACCUM = {("llama-tiny", "data=4,tensor=2",
                  tuple(sorted({"zero": 1, "sequence_parallel": True, "grad_accum": 2}.items())))}

# Compiling all eight costs ~2.5 minutes on 2 cores: by default only mamba2-tiny under data x tensor (Mamba
# TP over heads, ~10 s) runs; `pytest -m slow` runs the rest, among them context parallelism's conv-halo
# permutes and SSD state gathers (mamba2-tiny context=4, hybrid-tiny context=2,tensor=2 ring).
DEFAULT_MAMBA = {("mamba2-tiny", "data=4,tensor=2", ())}


def _case_param(model, mesh, devices, options, why, default=DEFAULT_MAMBA):
    marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
    if (model, mesh, tuple(sorted(options.items()))) not in default:
        marks.append(pytest.mark.slow)
    name = f"{model}-{mesh}" + "".join(f"-{k}={v}" for k, v in options.items())
    return pytest.param(model, mesh, devices, options, id=name, marks=marks)


# ---- what the compiled step holds, normalised -----------------------------------------------------

def _base(axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.split(":")[0] for a in axes))


def compiled_collectives(text: str, mesh) -> dict[tuple[str, tuple[str, ...]], list[int]]:
    """(kind, axes) -> [count, bytes] of the compiled module, normalised as the module docstring says.
    Checks on the way that the raw per-op sums are `tally.tally`'s."""
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    raw: dict[tuple, list[int]] = {}
    out: dict[tuple, list[int]] = {}
    for op in tally.collective_ops(text, mesh.axis_names, ids):
        acc = raw.setdefault((op.kind, op.axes), [0, 0])
        acc[0], acc[1] = acc[0] + op.times, acc[1] + op.times * op.bytes
        if op.bytes - op.scalar_bytes <= 0:
            continue
        acc = out.setdefault((op.kind, _base(op.axes)), [0, 0])
        acc[0], acc[1] = acc[0] + op.times, acc[1] + op.times * (op.bytes - op.scalar_bytes)
    tallied: dict[tuple, list[int]] = {}
    for c in tally.tally(text, mesh.axis_names, ids):
        acc = tallied.setdefault((c.kind, c.axes), [0, 0])
        acc[0], acc[1] = acc[0] + c.count, acc[1] + c.bytes
    assert raw == tallied
    return out


def predicted_collectives(model: str, strategy) -> dict[tuple[str, tuple[str, ...]], list[float]]:
    """(kind, axes) -> [count, bytes] of jaxpar.cost.comm's prediction for XLA:CPU, phases summed."""
    m, tc = parse_model(model), harness.TC
    out: dict[tuple, list[float]] = {}
    for c in cost_comm.collectives(m, strategy, step_shape(m, strategy, tc.batch, tc.seq), compiler=CPU):
        acc = out.setdefault((c.kind, c.axes), [0, 0])
        acc[0], acc[1] = acc[0] + c.count, acc[1] + c.bytes
    return out


def assert_prediction_matches(model: str, mesh: str, devices: int = 8, **options) -> None:
    tr = harness.trainer(model, mesh, **options) if devices == 8 else harness.trainer(model, mesh, devices, **options)
    got = compiled_collectives(harness.compiled_text(model, mesh, devices, **options), tr.mesh)
    want = predicted_collectives(model, tr.strategy)
    report = "\n".join(f"  {k}: predicted {want.get(k)}, compiled {got.get(k)}" for k in sorted(want.keys() | got.keys()))
    assert want.keys() == got.keys(), f"{mesh}: kinds x axes differ\n{report}"
    for key, (count, nbytes) in got.items():
        assert want[key][0] == count, f"{mesh} {key}: count\n{report}"
        assert want[key][1] == pytest.approx(nbytes, rel=0.01), f"{mesh} {key}: bytes\n{report}"


# ---- the walks ---------------------------------------------------------------------------------------

def _param(s):
    reason = NOT_MODELLED.get(s.name)
    marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
    return pytest.param(s.name, id=s.name, marks=marks)


def test_the_walk_covers_the_catalogue():
    """Every catalogue strategy is walked, named as too big for 8 devices, or an alias of one walked."""
    walked = {(s.mesh, s.options) for s in CATALOGUE}
    aliases = {s.name for s in catalogue() if (s.mesh, s.options) in walked}
    assert {s.name for s in CATALOGUE} | set(TOO_BIG) | aliases == {s.name for s in catalogue()}
    assert set(NOT_MODELLED) <= {s.name for s in CATALOGUE}
    assert all(parse_strategy(n).num_devices > 8 for n in TOO_BIG)


# The walk itself, test_catalogue_strategy_prediction_equals_hlo, runs in tests/test_strategies.py: the
# step it compiles per strategy is the one that file's trajectories run (tests/harness.py caches it per
# process, and `make test` gives each file to one process).


@pytest.mark.parametrize("model, mesh, devices, options", [_case_param(*case) for case in MAMBA_CASES])
def test_mamba_and_hybrid_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_MOE) for case in MOE_CASES])
def test_moe_prediction_equals_hlo(model, mesh, devices, options):
    """The expert all-to-alls (2 forward, 2 backward per MoE layer), the experts' gradients reduced over the
    data-like axes but `expert`, the router statistics' sums and the experts' tensor-parallel sums."""
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_OVERLAP) for case in OVERLAP_CASES])
def test_collective_matmul_prediction_equals_hlo(model, mesh, devices, options):
    """Per attention layer 4 rings of tensor-1 permutes of a residual chunk each way (a MoE layer: 2),
    in place of the all-gathers and reduce-scatters (and q/k/v's input-gradient sums)."""
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_REMAT) for case in REMAT_CASES])
def test_remat_policies_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_ONE_F_ONE_B) for case in ONE_F_ONE_B_CASES])
def test_one_f_one_b_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_PP_CP) for case in PP_CP_CASES])
def test_pipeline_context_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)


@pytest.mark.parametrize("model, mesh, devices, options",
                         [_case_param(*case, default=DEFAULT_ACCUM) for case in ACCUM_CASES])
def test_gradient_accumulation_prediction_equals_hlo(model, mesh, devices, options):
    assert_prediction_matches(model, mesh, devices, **options)


def test_compilers_differ_only_where_stated():
    """The GPU (textbook) prediction of tp4-sp has the reduce-scatters and reassociated sums that the
    CPU one has as all-reduces: same bytes moved in the forward, fewer ops backward."""
    m, st = parse_model(MODEL), parse_strategy("tp4-sp")
    sh = step_shape(m, st, harness.TC.batch, harness.TC.seq)
    gpu = {(c.kind, c.axes, c.phase): c for c in cost_comm.collectives(m, st, sh)}
    cpu = {(c.kind, c.axes, c.phase): c for c in cost_comm.collectives(m, st, sh, compiler="cpu")}
    assert ("reduce-scatter", ("tensor",), "forward") in gpu
    assert not any(k[0] == "reduce-scatter" for k in cpu)
    assert dataclasses.replace(CPU, name="gpu", reduce_scatter=True, reassociate=True, combine=False,
                               hoist=True, fold=True, promote_bf16=False, ragged_all_to_all=True) == GPU


# ---- the communication floor (jaxpar/cost/floor.py) -----------------------------------------------

def _floor(model: str, mesh: str) -> dict[str, float]:
    m, st = parse_model(model), parse_strategy(mesh)
    return cost_floor.floor(m, st, step_shape(m, st, harness.TC.batch, harness.TC.seq))


def test_floor_of_dp8_and_tp8_is_the_hand_count():
    """dp8: every gradient element (counted off the model's own parameter arrays) all-reduced once over 8
    devices, 2*7/8 of its f32 bytes sent. tp8: per layer 4 activation sums (o-proj and MLP down forward,
    q/k/v's and gate/up's input gradients backward) of the [batch, seq, d] f32 activation, plus the
    embedding output's and the head input gradient's sums and the 3 softmax reductions of [tokens] f32;
    each an all-reduce over 8 (2*7/8 of the buffer)."""
    tr, (b, s) = harness.trainer(MODEL, "dp8"), (harness.TC.batch, harness.TC.seq)
    m = tr.model_cfg
    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tr.abstract_params))
    assert _floor(MODEL, "dp8") == {"data": pytest.approx(2 * 7 / 8 * params * 4)}
    x, tokens = b * s * m.d_model * 4, b * s
    hand = 2 * 7 / 8 * (m.layers * 4 * x + 2 * x + 3 * tokens * 4)
    assert _floor(MODEL, "tp8") == {"tensor": pytest.approx(hand)}


def test_compiled_dp8_is_at_its_floor():
    """The compiled dp8 step (shared with the catalogue walk) sends its floor, within 1.05 (the loss's and
    the gradient norm's scalars are all it adds)."""
    tr = harness.trainer(MODEL, "dp8")
    ids = np.arange(tr.mesh.size).reshape(tuple(tr.mesh.shape.values()))
    wire = sum(c.wire_bytes for c in tally.tally(harness.compiled_text(MODEL, "dp8"), tr.mesh.axis_names, ids))
    floor = sum(_floor(MODEL, "dp8").values())
    assert floor <= wire <= 1.05 * floor
