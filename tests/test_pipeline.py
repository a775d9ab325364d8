"""Pipeline parallelism (jaxpar/pipeline/gpipe.py, jaxpar/pipeline/one_f_one_b.py): GPipe, circular and 1F1B schedules,
even and uneven stage splits,
compute what one device computes, communicate what the schedule (and jaxpar.cost.comm) says, run the
head once per step, gather FSDP-sharded stage weights once per step, and bad configurations fail
before compiling.

Each case compiles once: `jax.jit(trainer.loss_and_grads)` lowered and compiled gives both the
numbers (the compiled executable is called) and the HLO tally (forward and backward phases). The
1-device reference runs the same way, from the same host-made parameters.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.hlo_text import executed_instructions, parse_module
from jaxpar.analysis.patterns import dims, one_dot_flops
from jaxpar.analysis.tally import collective_ops, tally_compiled
from jaxpar.core.mesh import make_mesh
from jaxpar.core.schedule import default_split, schedule_of, schedule_summary, stored_spec
from jaxpar.core.sharding import Layout, use_layout
from jaxpar.core.strategy import parse_strategy
from jaxpar.core import validate
from jaxpar.core.validate import check_pipeline
from jaxpar.cost import comm as cost_comm
from jaxpar.cost.comm_data import fsdp_gathers
from jaxpar.cost.compiler import CPU
from jaxpar.cost.shape import step_shape
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.pipeline import pipelined_stack
from jaxpar.training.trainer import TrainConfig, Trainer, gather
from tests import harness

LLAMA = "llama-tiny:layers=8"
UNEVEN = "llama-tiny:layers=10"   # 2+3+3+2 on 4 stages; 1+1+1+2+2+1+1+1 on 4 stages x 2 repeats
MAMBA = "mamba2-tiny:layers=5"    # 2+3 on 2 stages
CIRCULAR = dict(pp_schedule="circular", pp_repeats=2)

# (model, mesh, options): S in {2, 4}, M in {2, 4, 8} (M < S: the head's micro-batches padded), GPipe and
# circular (v=2), uneven splits (default and explicit `pp_stages`; the even ones run in the catalogue:
# tests/test_strategies.py), tensor=2 or fsdp=2 inside the stages, data beside them, remat and SP.
CASES = {
    "U10-S4-M2-gpipe-fsdp2": (UNEVEN, "pipeline=4,fsdp=2", dict(microbatches=2)),
    "U10-S4-M4-circular-tp2-sp-remat": (UNEVEN, "pipeline=4,tensor=2",
                                        dict(microbatches=4, sequence_parallel=True, remat="full", **CIRCULAR)),
    "S2-M8-circular-tp2-dp2-split": (LLAMA, "pipeline=2,tensor=2,data=2",
                                     dict(microbatches=8, pp_stages="1,3,3,1", **CIRCULAR)),
    "mamba-U5-S2-M4-gpipe-tp2-dp2": (MAMBA, "pipeline=2,tensor=2,data=2", dict(microbatches=4)),
    "S4-M4-circular-fsdp2": (LLAMA, "pipeline=4,fsdp=2", dict(microbatches=4, **CIRCULAR)),
    # 1F1B (jaxpar/pipeline/one_f_one_b.py: its own backward, not jax.grad): uneven with fsdp, even with tensor + SP
    "U10-S4-M4-1f1b-fsdp2": (UNEVEN, "pipeline=4,fsdp=2", dict(microbatches=4, pp_schedule="1f1b")),
    "S2-M8-1f1b-tp2-sp-dp2": (LLAMA, "pipeline=2,tensor=2,data=2",
                              dict(microbatches=8, pp_schedule="1f1b", sequence_parallel=True)),
    # context parallelism inside the stages: ring attention on the zigzag token layout
    "S2-M2-gpipe-cp2-ring-zigzag": (LLAMA, "pipeline=2,context=2,data=2",
                                    dict(microbatches=2, attention="ring", cp_layout="zigzag")),
    # 1F1B with the units' remat policy inside its chunks (jaxpar/pipeline/stages.py)
    "S4-M4-1f1b-remat-full": (LLAMA, "pipeline=4,data=2", dict(microbatches=4, pp_schedule="1f1b", remat="full")),
    # interleaved 1F1B (v = 2 chunks per stage): even with data, uneven with tensor + SP
    "S4-M8-1f1b-v2-dp2": (LLAMA, "pipeline=4,data=2", dict(microbatches=8, pp_schedule="1f1b", pp_repeats=2)),
    "U10-S2-M4-1f1b-v2-tp2-sp": (UNEVEN, "pipeline=2,tensor=2,data=2", dict(microbatches=4, pp_schedule="1f1b",
                                                                             pp_repeats=2, sequence_parallel=True)),
    # Mamba-2's context-parallel kernels (conv halo, SSD state passing) inside the stages too
    "hybrid-U8-S2-M2-gpipe-cp2-ring-zigzag": ("hybrid-tiny:layers=8", "pipeline=2,context=2,data=2",
                                              dict(microbatches=2, attention="ring", cp_layout="zigzag")),
    "mamba-U4-S2-M4-1f1b-cp2-zigzag": ("mamba2-tiny:layers=4", "pipeline=2,context=2,data=2",
                                       dict(microbatches=4, pp_schedule="1f1b", cp_layout="zigzag")),
    "S2-M4-1f1b-cp2-ring": (LLAMA, "pipeline=2,context=2,data=2", dict(microbatches=4, attention="ring",
                                                                      pp_schedule="1f1b")),
}


# The cases whose compiles take longest (20 to 40 s each on 2 cores): `make test-slow` runs them (CI runs it
# after `make test`); each layout they add is also covered, in a cheaper form, by a case above.
SLOW_CASES = {"hybrid-U8-S2-M2-gpipe-cp2-ring-zigzag", "mamba-U5-S2-M4-gpipe-tp2-dp2", "S2-M8-circular-tp2-dp2-split",
              "S2-M4-1f1b-cp2-ring", "mamba-U4-S2-M4-1f1b-cp2-zigzag", "U10-S2-M4-1f1b-v2-tp2-sp"}
CASE_PARAMS = [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]


# XLA:CPU code generation at -O0: the HLO passes (SPMD partitioning, collectives) are unchanged,
# compiling is several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def host_params(model: str):
    """Reference parameters made on the host (no initialiser to compile): 0.1 * normal."""
    rng = np.random.default_rng(0)
    abstract = harness.trainer(model, "data=1", devices=1).abstract_params
    return jax.tree.map(lambda a: (0.1 * rng.normal(size=a.shape)).astype(a.dtype), abstract)


@functools.cache
def run(model: str, mesh: str, devices: int = 8, **options):
    """(trainer, loss, grads, tally, per-op collectives, HLO text) of one batch from the host parameters,
    from one compile."""
    tr = harness.trainer(model, mesh, devices, **options)
    params = jax.device_put(tr.reorder(host_params(model)), tr.param_shardings)   # the stored order
    batch = tr.batch(harness.source(model), 0)
    compiled = tr.stored_loss_and_grads.lower(params, batch).compile(FAST_COMPILE)
    loss, grads = compiled(params, batch)
    text = compiled.as_text()
    ops = collective_ops(text, tr.mesh.axis_names, np.arange(tr.mesh.size).reshape(tuple(tr.mesh.shape.values())))
    return tr, float(loss), tr.reorder(gather(grads), inverse=True), tally_compiled(compiled, tr.mesh), ops, text


def compiled_case(name: str):
    model, mesh, options = CASES[name]
    return run(model, mesh, **options)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_loss_and_gradients_match_one_device(case):
    model = CASES[case][0]
    _, ref_loss, ref_grads, *_ = run(model, "data=1", devices=1)
    _, loss, grads, *_ = compiled_case(case)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref = dict(harness.leaves_with_paths(ref_grads))
    got = dict(harness.leaves_with_paths(grads))
    assert got.keys() == ref.keys()
    for path, g in got.items():
        scale = np.max(np.abs(ref[path]))
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * scale, err_msg=path)


def _pipeline_ops(ops, axes: tuple[str, ...] = ("pipeline",)) -> dict[str, list[int]]:
    """kind -> [count, bytes] over `axes` (sub-axes as their axis), scalars left out as in
    tests/test_cost_vs_hlo.py."""
    out: dict[str, list[int]] = {}
    for op in ops:
        if tuple(dict.fromkeys(a.split(":")[0] for a in op.axes)) == axes and op.bytes > op.scalar_bytes:
            acc = out.setdefault(op.kind, [0, 0])
            acc[0], acc[1] = acc[0] + op.times, acc[1] + op.times * (op.bytes - op.scalar_bytes)
    return out


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_pipeline_collectives_as_predicted(case):
    """T = v*M + S - 1 shifts of the stage state forward and their transposes backward (one op each
    way; 1F1B: M + S - 1 of its ticks shift the state up, as many the cotangent down); and every collective over `pipeline` (the head's all-to-all, the uneven or circular weight
    view's all-to-alls, the input's and head's gradient sums) is what jaxpar.cost.comm predicts for
    XLA:CPU: bytes within 1%, counts exact (but the all-reduces': below)."""
    tr, _, _, tally, ops, _ = compiled_case(case)
    sched = schedule_of(tr.strategy, tr.model_cfg.units)
    rows = harness.TC.batch // tr.layout.size("batch") // sched.microbatches   # per device and micro-batch
    seq = harness.TC.seq // (tr.strategy.size("tensor") if tr.strategy.options.sequence_parallel else 1)
    seq //= tr.strategy.size("context")
    state_bytes = rows * seq * tr.model_cfg.d_model * 4
    for phase in ("forward", "backward"):
        permutes = [c for c in tally if c.kind == "collective-permute" and c.axes == ("pipeline",) and c.phase == phase]
        assert len(permutes) == 1, tally
        if sched.even or sched.repeats == 1:
            # 1F1B at S = 2: the cool-down's one tick is unrolled and its unused cotangent send removed
            n = sched.iterations - (phase == "backward" and sched.kind == "1f1b" and sched.stages == 2
                                    and sched.repeats == 1)
            assert (permutes[0].count, permutes[0].bytes) == (n, n * state_bytes)
    m = tr.model_cfg
    want: dict[str, list[float]] = {}
    for c in cost_comm.collectives(m, tr.strategy, step_shape(m, tr.strategy, harness.TC.batch, harness.TC.seq),
                                   compiler=CPU):
        if c.axes == ("pipeline",):
            acc = want.setdefault(c.kind, [0, 0])
            acc[0], acc[1] = acc[0] + c.count, acc[1] + c.bytes
    got = _pipeline_ops(ops)
    if tr.strategy.size("fsdp") > 1:   # the embedding lookup's reshard (not modelled: tests/test_cost_vs_hlo.py)
        got.pop("all-gather", None)
    assert want.keys() == got.keys(), (want, got)
    for kind, (count, nbytes) in got.items():
        # the gradient sums' op count is the combiner's: one op in the train step (tests/test_cost_vs_hlo.py
        # checks it there), one or two in this gradient-only program
        assert want[kind][0] == count or kind == "all-reduce", (kind, want, got)
        assert want[kind][1] == pytest.approx(nbytes, rel=0.01), (kind, want, got)


def test_circular_weights_stay_on_their_stages():
    """An even circular split stores the stacked units stage-major (jaxpar/pipeline/order.py): the only
    all-to-alls over `pipeline` are the head's spread and its transpose, the only collective-permutes the
    stage shifts (one op each way, run T times), and the permutation itself round-trips."""
    tr, _, _, _, ops, _ = compiled_case("S4-M4-circular-fsdp2")
    sched = schedule_of(tr.strategy, tr.model_cfg.units)
    assert tr.unit_order is not None and sorted(tr.unit_order) == list(range(tr.model_cfg.units))
    pp = [op for op in ops if op.axes == ("pipeline",)]
    assert sorted(op.times for op in pp if op.kind == "all-to-all") == [1, 1], [(o.name, o.times) for o in pp]
    assert sorted(op.times for op in pp if op.kind == "collective-permute") == [sched.iterations] * 2
    params = host_params(LLAMA)
    state = tr.state_from_params(params)            # stored stage-major ...
    assert not np.array_equal(gather(state.params["runs"][0]["blocks"][0]["attn"]["wq"][...]),
                              params["runs"][0]["blocks"][0]["attn"]["wq"][...])
    saved = tr.stored_state(state, inverse=True)     # ... what a checkpoint holds: layer order again
    for (path, a), (_, b) in zip(harness.leaves_with_paths(params), harness.leaves_with_paths(gather(saved.params))):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_fsdp_gathers_stage_weights_once_per_step():
    """FSDP inside the stages: every all-gather over fsdp runs once per step (none in the schedule's loop),
    one per weight array of a unit (each its stage's v*k slots at once) plus the head and final norm
    (and the final norm again backward), as jaxpar.cost.comm_data predicts."""
    tr, _, _, _, ops, _ = compiled_case("U10-S4-M2-gpipe-fsdp2")
    gathers = [op for op in ops if op.kind == "all-gather" and op.axes == ("fsdp",)]
    assert gathers and all(op.times == 1 for op in gathers), [(op.name, op.times) for op in gathers]
    m, st = tr.model_cfg, tr.strategy
    # the weights' gathers; the embedding lookup's token ids (int32 [B, s], gathered over fsdp by
    # jaxpar.xla_workarounds.lookup) are not a weight: not compared
    gathers = [op for op in gathers if op.bytes != harness.TC.batch * harness.TC.seq * 4]
    want = fsdp_gathers(m, st, step_shape(m, st, harness.TC.batch, harness.TC.seq), 4)   # sites (jaxpar/cost/sites.py)
    assert sum(execs * n for _, _, execs, n, *_ in want) == len(gathers)
    assert sum(execs * total for _, _, execs, _, total, *_ in want) == pytest.approx(sum(op.bytes for op in gathers),
                                                                                     rel=0.01)


def _fsdp_reductions(case: str):
    """(HLO bytes of the gradient reductions over fsdp, all of which must run once per step; predicted bytes of
    the stage weights' reduction alone)."""
    tr, _, _, _, ops, _ = compiled_case(case)
    red = [op for op in ops if op.kind in ("all-reduce", "reduce-scatter") and op.axes == ("fsdp",)]
    assert red and all(op.times == 1 for op in red), [(op.name, op.times) for op in red]
    m, st = tr.model_cfg, tr.strategy
    sched = schedule_of(st, m.units)
    want = [c for c in cost_comm.collectives(m, st, step_shape(m, st, harness.TC.batch, harness.TC.seq), compiler=CPU)
            if c.axes == ("fsdp",) and c.kind in ("all-reduce", "reduce-scatter") and c.phase == "backward"]
    assert sum(c.count for c in want) == 1
    # hand count: the stage's v*k unit slots of every fsdp-sharded stacked weight, float32
    leaves = jax.tree_util.tree_leaves_with_path(tr.abstract_params)
    specs = [sh.spec for sh in jax.tree.leaves(tr.param_shardings)]
    hand = sum(math.prod(a.shape[1:]) * sched.repeats * sched.per_chunk * 4 for (path, a), spec in zip(leaves, specs)
               if "runs" in jax.tree_util.keystr(path)
               and any("fsdp" in (d if isinstance(d, tuple) else (d,)) for d in spec if d is not None))
    assert sum(c.bytes for c in want) == pytest.approx(hand, rel=0.01)
    return sum(op.bytes for op in red), hand


def test_fsdp_reduces_stage_gradients_once_per_step():
    """FSDP inside the stages: each fsdp shard accumulates its stage weights' gradient through the schedule's
    loop and the reduction over fsdp runs once per step (no reduction in the loop), as jaxpar.cost.comm_data
    predicts: the stage's v*k unit slots (hand count), combined with the head's, final norm's and
    embedding's reductions, which are the same bytes under GPipe (10 units) and circular (8 units)."""
    gpipe, gpipe_weights = _fsdp_reductions("U10-S4-M2-gpipe-fsdp2")
    circ, circ_weights = _fsdp_reductions("S4-M4-circular-fsdp2")
    assert gpipe - gpipe_weights == circ - circ_weights > 0


def _flops_outside_loops(text: str) -> float:
    """Dot FLOPs of the instructions that run once per step (the layer stack runs in loops; embedding,
    head and loss do not)."""
    module = parse_module(text)
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    return sum(one_dot_flops(i, shapes) for i, times, _ in executed_instructions(module)
               if i.opcode == "dot" and times == 1)


def test_head_flops_once_per_step():
    """The head's (and loss's) dot FLOPs of the compiled train step, summed over the pipeline x data
    devices, equal one device's: each stage runs the head on M/S micro-batches, not on all of them.
    The steps are the catalogue's (compiled once per session, shared with tests/test_strategies.py)."""
    one = _flops_outside_loops(harness.compiled_text(LLAMA, "data=1", devices=1))
    tr = harness.trainer(LLAMA, "pp4-dp2")
    per_device = _flops_outside_loops(harness.compiled_text(LLAMA, "pp4-dp2"))
    assert one > 0 and per_device * tr.mesh.size == pytest.approx(one, rel=1e-6)


def _head_flops(text: str, vocab: int) -> float:
    """Dot FLOPs of the head (forward logits, their input and weight gradients: the dots with a vocab dim
    in an operand or the result), times how often each runs: a 1F1B step's head runs inside its loop."""
    module = parse_module(text)
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    return sum(times * one_dot_flops(i, shapes) for i, times, _ in executed_instructions(module)
               if i.opcode == "dot" and any(vocab in dims(s) for s in [i.shape] + [shapes[o] for o in i.operands[:2]]))


@pytest.mark.parametrize("case", [c for c in CASES if "1f1b" in c and CASES[c][0].startswith("llama")])
def test_1f1b_head_flops_once_per_step(case):
    """1F1B spreads the last stage's output over the stages for the head (jaxpar/pipeline/one_f_one_b.py): the
    head's dot FLOPs, summed over the devices, equal one device's, not S times them (vocab 256, no other
    dim of the tiny model is 256, or 128 when tensor=2 shards the vocab)."""
    model = CASES[case][0]
    one = _head_flops(run(model, "data=1", devices=1)[5], 256)
    tr, *_, text = compiled_case(case)
    per_device = _head_flops(text, 256 // tr.strategy.size("tensor"))
    assert one > 0 and per_device * tr.mesh.size == pytest.approx(one, rel=1e-6)


def test_uneven_circular_schedule_forward():
    """v=3 repeats and M=3 micro-batches over S=2 stages (M % S != 0, M > S: outputs wait in the
    buffer for a round), 7 units in 6 chunks (1+1+1+2+1+1: padding slots), forward only: the
    pipelined stack equals the plain scan."""
    cfg = parse_model("llama-tiny:layers=7")
    strategy = parse_strategy("pipeline=2").with_options(microbatches=3, pp_schedule="circular",
                                                         pp_repeats=3).resolved(2)
    check_pipeline(cfg, strategy)
    layout = Layout(make_mesh(strategy, jax.devices()[:2]), strategy)
    graphdef, state = nnx.split(LM(cfg, RunConfig(), rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (6, 16, cfg.d_model))
    positions = jnp.broadcast_to(jnp.arange(16), (6, 16))

    def pipelined(state, x, positions):
        with use_layout(layout):
            return pipelined_stack(nnx.merge(graphdef, state), x, positions, strategy, layout)

    want = jax.jit(lambda s, x, p: nnx.merge(graphdef, s).apply_stack(x, p))(state, x, positions)
    got = jax.jit(pipelined).lower(state, x, positions).compile(FAST_COMPILE)(state, x, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_schedule_summary():
    gpipe = parse_strategy("pipeline=4,data=2").with_options(microbatches=8)
    assert schedule_of(gpipe, 8).iterations == 11
    assert "gpipe" in schedule_summary(gpipe, 8) and "11 iterations" in schedule_summary(gpipe, 8)
    assert "3/11 = 27.3%" in schedule_summary(gpipe, 8) and "units per chunk 2+2+2+2 = 8" in schedule_summary(gpipe, 8)
    circ = parse_strategy("pipeline=4,data=2").with_options(microbatches=4, **CIRCULAR)
    text = schedule_summary(circ, 8)
    assert "circular" in text and "2 repeats" in text and "11 iterations" in text and "27.3%" in text
    assert "units per chunk 2+3+3+2 = 10 (k=3 slots per chunk, 2 padding)" in schedule_summary(gpipe, 10)
    one_f = parse_strategy("pipeline=4,data=2").with_options(microbatches=8, pp_schedule="1f1b")
    assert schedule_of(one_f, 8).iterations == 8 + 3 and schedule_of(one_f, 8).repeats == 1
    text = schedule_summary(one_f, 8)
    assert "1f1b" in text and "14 ticks, 11 forwards" in text and "(S-1)/(M+S-1) = 3/11 = 27.3%" in text
    interleaved = one_f.with_options(pp_repeats=2)   # 2 x 8 + 3 forwards, 7 more ticks of warm-up and cool-down
    text = schedule_summary(interleaved, 8)
    assert "4 stages x 2 repeats" in text and "26 ticks, 19 forwards" in text and "= 3/19 = 15.8%" in text
    assert schedule_summary(parse_strategy("data=8"), 8) == "pipeline: none (pipeline=1)"


def test_default_split_lightens_the_ends():
    """Even when S*v divides U; else one unit off the first and last chunks, then the second and
    second-to-last: Llama 3 405B's 126 layers on 16 stages are 7 + 8 x 14 + 7."""
    assert default_split(126, 16) == (7,) + (8,) * 14 + (7,)
    assert default_split(10, 4) == (2, 3, 3, 2)
    assert default_split(8, 4) == (2, 2, 2, 2)
    assert default_split(5, 4) == (1, 1, 2, 1)
    assert default_split(7, 6) == (1, 1, 1, 2, 1, 1)
    st = parse_strategy("pipeline=16,tensor=8").with_options(microbatches=16)
    sched = schedule_of(st, 126)
    assert (sched.per_chunk, sched.slots, sched.stage_split) == (8, 128, (7,) + (8,) * 14 + (7,))
    explicit = schedule_of(st.with_options(pp_stages=",".join(["6"] + ["8"] * 14 + ["8"])), 126)
    assert explicit.split[0] == 6 and not explicit.even


def test_uneven_weights_stored_off_the_layers_dim():
    """jit needs even shards: with an uneven split the stacked weights keep `pipeline`, on the next dim
    it divides (with that dim's own axes), so a device still holds 1/S of them."""
    st = parse_strategy("pipeline=4,fsdp=2").resolved(8)
    assert stored_spec(P("pipeline", "fsdp", "tensor"), (8, 64, 8, 8), st) == P("pipeline", "fsdp", "tensor")
    assert stored_spec(P("pipeline", "fsdp", "tensor"), (10, 64, 8, 8), st) == P(None, ("fsdp", "pipeline"), "tensor")
    assert stored_spec(P("pipeline"), (10, 6), st) == P()
    split = st.with_options(pp_stages="1,3,3,1")
    assert stored_spec(P("pipeline", "fsdp"), (8, 64), split) == P(None, ("fsdp", "pipeline"))


@pytest.mark.parametrize("model, mesh, options, message", [
    ("llama-tiny", "pipeline=4,data=2", {},
     "pipeline=4 x repeats=1 = 4 stage chunks need at least 4 stacked layer units, the model has 2"),
    ("llama-tiny:layers=6", "pipeline=4,data=2", dict(microbatches=8, pp_schedule="circular", pp_repeats=2),
     "pipeline=4 x repeats=2 = 8 stage chunks need at least 8 stacked layer units, the model has 6"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(microbatches=2, **CIRCULAR),
     "the circular schedule needs microbatches >= pipeline: microbatches=2 < pipeline=4"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(pp_repeats=2), "pp_repeats=2 needs pp_schedule=circular or 1f1b"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(pp_repeats=2, pp_schedule="1f1b", microbatches=6),
     "interleaved 1F1B (pp_repeats=2) takes micro-batches in groups of pipeline=4: microbatches=6 must be a "
     "multiple of 4"),
    ("llama-tiny", "data=8", dict(microbatches=4), "microbatches=4 needs a pipeline axis > 1"),
    ("llama-tiny", "data=8", dict(pp_stages="1,1"), "option pp_stages='1,1' splits layers over pipeline stages, "
                                                     "but the mesh has pipeline=1"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(pp_stages="2,2,4"),
     "option pp_stages='2,2,4' lists 3 chunk(s), gpipe runs 4"),
    ("llama-tiny:layers=8", "pipeline=2,data=4", dict(pp_stages="3,3,1,2", **CIRCULAR),
     "option pp_stages='3,3,1,2' sums to 9 units, the model has 8"),
    ("llama-tiny:layers=8", "pipeline=2,data=4", dict(pp_stages="3,6", ), "option pp_stages='3,6' sums to 9 units, "
                                                                         "the model has 8"),
    ("llama-tiny:layers=8", "pipeline=2,data=4", dict(pp_stages="8,0"), "must list positive unit counts"),
    ("llama-tiny:layers=8", "pipeline=2,data=4", dict(pp_stages="four,four"), "must list positive unit counts"),
])
def test_bad_pipeline_configs(model, mesh, options, message):
    strategy = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(parse_model(model), strategy)


def test_1f1b_needs_each_sequence_piece_divisible_by_the_stages():
    """1F1B spreads each device's tokens of the last stage's output over the stages (jaxpar/pipeline/one_f_one_b.py):
    refused, naming the numbers, before anything compiles."""
    st = parse_strategy("pipeline=4,tensor=2").with_options(microbatches=4, pp_schedule="1f1b",
                                                            sequence_parallel=True).resolved(8)
    with pytest.raises(ConfigError, match=r"seq=20 / \(context x tensor = 2\) = 10 tokens must be divisible by "
                                          r"pipeline=4"):
        validate.check(parse_model("llama-tiny:layers=8"), st, batch=8, seq=20)
    validate.check(parse_model("llama-tiny:layers=8"), st, batch=8, seq=24)


def test_good_pipeline_configs_pass():
    for model, mesh, options in CASES.values():
        check_pipeline(parse_model(model), parse_strategy(mesh).with_options(**options).resolved(8))


def _temp_bytes(schedule: str, microbatches: int) -> int:
    """Compiled temp bytes per device of loss + gradients at S = 4 (pipeline=4, data=2), one row per data
    shard and micro-batch: the batch grows with M, the micro-batch stays."""
    strategy = parse_strategy("pipeline=4,data=2").with_options(microbatches=microbatches, pp_schedule=schedule)
    tc = TrainConfig(batch=2 * microbatches, seq=16)
    tr = Trainer(parse_model("llama-tiny:layers=4"), strategy, tc, devices=jax.devices()[:8])
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tr.abstract_params,
                          tr.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((tc.batch, tc.seq), jnp.int32, sharding=tr.batch_sharding)
             for k in ("inputs", "labels", "positions")}
    return tr.stored_loss_and_grads.lower(params, batch).compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes


@pytest.mark.slow   # four compiles; experiments/bench_pipeline.py prints the same figures for M = 4, 8, 16
def test_1f1b_memory_flat_in_microbatches():
    """At a fixed micro-batch size, GPipe keeps every micro-batch's stage inputs and inventories for its
    backward (T = M + S - 1 iterations' worth), 1F1B at most 2S-1 stashed stage inputs: from M = 4 to 16
    GPipe's compiled temp memory grows by more than its M = 4 figure, 1F1B's by less than a tenth of GPipe's
    growth (what it still grows by is the batch itself: embedding output and its cotangent)."""
    gpipe = [_temp_bytes("gpipe", m) for m in (4, 16)]
    one_f = [_temp_bytes("1f1b", m) for m in (4, 16)]
    assert gpipe[1] - gpipe[0] > gpipe[0]
    assert one_f[1] - one_f[0] < 0.1 * (gpipe[1] - gpipe[0])
    assert one_f[1] < gpipe[0]
