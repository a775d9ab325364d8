"""Pipeline parallelism (jaxpar/pipeline.py): GPipe and circular schedules compute what one device
computes, communicate what the schedule says, and bad configurations fail before compiling.

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

from jaxpar.analysis.tally import tally_compiled
from jaxpar.errors import ConfigError
from jaxpar.mesh import make_mesh
from jaxpar.pipeline import pipelined_stack
from jaxpar.schedule import schedule_of, schedule_summary
from jaxpar.validate import check_pipeline
from jaxpar.sharding import Layout, use_layout
from jaxpar.strategy import parse_strategy
from jaxpar.train import gather
from jaxpar.models.config import RunConfig, parse_model
from jaxpar.models.lm import LM
from tests import harness

LLAMA = "llama-tiny:layers=8"
MAMBA = "mamba2-tiny:layers=8"
CIRCULAR = dict(pp_schedule="circular", pp_repeats=2)

# (model, mesh, options): S in {2, 4}, M in {4, 8}, GPipe and circular (v=2), with and without
# tensor=2 inside the stages, data and fsdp beside them, remat and sequence parallelism.
CASES = {
    "S4-M8-gpipe-dp2": (LLAMA, "pipeline=4,data=2", dict(microbatches=8)),
    "S2-M4-gpipe-fsdp2-dp2": (LLAMA, "pipeline=2,fsdp=2,data=2", dict(microbatches=4)),
    "S4-M4-circular-tp2-sp-remat": (LLAMA, "pipeline=4,tensor=2",
                                    dict(microbatches=4, sequence_parallel=True, remat="full", **CIRCULAR)),
    "S2-M8-circular-tp2-dp2": (LLAMA, "pipeline=2,tensor=2,data=2", dict(microbatches=8, **CIRCULAR)),
    "mamba-S2-M4-gpipe-tp2-dp2": (MAMBA, "pipeline=2,tensor=2,data=2", dict(microbatches=4)),
}


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
    """(trainer, loss, grads, tally) of one batch from the host parameters, from one compile."""
    tr = harness.trainer(model, mesh, devices, **options)
    params = jax.device_put(host_params(model), tr.param_shardings)
    batch = tr.batch(harness.source(model), 0)
    compiled = jax.jit(tr.loss_and_grads).lower(params, batch).compile(FAST_COMPILE)
    loss, grads = compiled(params, batch)
    return tr, float(loss), gather(grads), tally_compiled(compiled, tr.mesh)


def compiled_case(name: str):
    model, mesh, options = CASES[name]
    return run(model, mesh, **options)


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_one_device(case):
    model = CASES[case][0]
    _, ref_loss, ref_grads, _ = run(model, "data=1", devices=1)
    _, loss, grads, _ = compiled_case(case)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref = dict(harness.leaves_with_paths(ref_grads))
    got = dict(harness.leaves_with_paths(grads))
    assert got.keys() == ref.keys()
    for path, g in got.items():
        scale = np.max(np.abs(ref[path]))
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * scale, err_msg=path)


def _stage_weight_bytes(tr) -> int:
    """Bytes of one device's stacked-unit weights (its stage's v*k units, after tensor/fsdp splits)."""
    total = 0
    for path, sh in jax.tree_util.tree_leaves_with_path(tr.param_shardings):
        if "units" in jax.tree_util.keystr(path):
            leaf = next(v for p, v in jax.tree_util.tree_leaves_with_path(tr.abstract_params) if p == path)
            total += math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


@pytest.mark.parametrize("case", CASES)
def test_one_permute_per_iteration_each_way(case):
    """T = v*M + S - 1 shifts of the stage state forward and their transposes backward; the
    circular schedule also moves each stage's weights once each way (the [U] -> [S, v, k] view)."""
    tr, _, _, tally = compiled_case(case)
    sched = schedule_of(tr.strategy, tr.model_cfg.units)
    T = sched.iterations
    rows = harness.TC.batch // tr.layout.size("batch") // sched.microbatches   # per device and micro-batch
    seq = harness.TC.seq // (tr.strategy.size("tensor") if tr.strategy.options.sequence_parallel else 1)
    state_bytes = rows * seq * tr.model_cfg.d_model * 4
    weight_bytes = _stage_weight_bytes(tr)
    for phase in ("forward", "backward"):
        permutes = [c for c in tally if c.kind == "collective-permute" and c.axes == ("pipeline",)
                    and c.phase == phase]
        moves = [c for c in tally if c.kind == "all-to-all" and c.phase == phase]
        assert len(permutes) == 1, tally
        (permute,) = permutes
        if sched.kind == "gpipe":
            assert (permute.count, permute.bytes) == (T, T * state_bytes), (phase, permute)
            assert not moves, moves
        else:
            # the weights' [S, v, k] view: an all-to-all per leaf (plus a permute per leaf if v < S)
            assert moves and sum(c.bytes for c in moves) == weight_bytes, moves
            extra = permute.bytes - T * state_bytes
            assert extra in (0, weight_bytes), (phase, permute, weight_bytes)
            assert permute.count == T + (0 if extra == 0 else sum(c.count for c in moves)), (phase, permute)


def test_uneven_circular_schedule_forward():
    """v=3 repeats and M=3 micro-batches over S=2 stages (M % S != 0, M > S: outputs wait in the
    buffer for a round), forward only: the pipelined stack equals the plain scan."""
    cfg = parse_model("llama-tiny:layers=6")
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
    assert "3/11 = 27.3%" in schedule_summary(gpipe, 8)
    circ = parse_strategy("pipeline=4,data=2").with_options(microbatches=4, **CIRCULAR)
    text = schedule_summary(circ, 8)
    assert "circular" in text and "2 repeats" in text and "11 iterations" in text and "27.3%" in text
    assert schedule_summary(parse_strategy("data=8"), 8) == "pipeline: none (pipeline=1)"


@pytest.mark.parametrize("model, mesh, options, message", [
    ("llama-tiny", "pipeline=4,data=2", {}, "pipeline=4 needs at least 4 stacked layer units, the model has 2"),
    ("llama-tiny:layers=6", "pipeline=4,data=2", {},
     "pipeline=4 x repeats=1 = 4 stages do not divide the model's 6 layer units"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(microbatches=8, pp_schedule="circular", pp_repeats=4),
     "pipeline=4 x repeats=4 = 16 stages do not divide the model's 8 layer units"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(microbatches=2, **CIRCULAR),
     "the circular schedule needs microbatches >= pipeline: microbatches=2 < pipeline=4"),
    ("llama-tiny:layers=8", "pipeline=4,data=2", dict(pp_repeats=2), "pp_repeats=2 needs pp_schedule=circular"),
    ("llama-tiny", "data=8", dict(microbatches=4), "microbatches=4 needs a pipeline axis > 1"),
    ("llama-tiny:layers=8", "pipeline=2,context=2,data=2", dict(attention="ring"),
     "pipeline=2 with context=2 is not supported yet"),
])
def test_bad_pipeline_configs(model, mesh, options, message):
    strategy = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(parse_model(model), strategy)


def test_good_pipeline_configs_pass():
    for model, mesh, options in CASES.values():
        check_pipeline(parse_model(model), parse_strategy(mesh).with_options(**options).resolved(8))
