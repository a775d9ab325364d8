"""A model that is not one repeating unit: its layers as runs (models/config.py), each stacked and scanned.

The reference for the runs' scans is the same model written as a list of layers in a Python loop (each
unit's parameters sliced from its run's stack); the reference for every strategy is one device; the
reference for the cost model is a hand count of DeepSeek-V3's 3 dense + 58 MoE layers from its config.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main as cli
from jaxpar.core.schedule import schedule_of, schedule_summary
from jaxpar.core.strategy import parse_strategy
from jaxpar.cost import flops as cost_flops
from jaxpar.cost import program_flops
from jaxpar.cost.params import total_params
from jaxpar.cost.shape import step_shape
from jaxpar.errors import ConfigError
from jaxpar.models.config import Run, parse_model, pattern_of
from jaxpar.models.lm import LM
from jaxpar.models.moe import aux_sum
from jaxpar.models.run import RunConfig
from jaxpar.training.checkpoint import Checkpointer
from jaxpar.training.trainer import gather
from tests import harness
from tests.test_cost_vs_hlo import assert_prediction_matches

MODEL = "moe-tiny:pattern=A+3*E"   # DeepSeek-V3's shape in small: a dense layer, then three MoE layers


# ---- the schema ----------------------------------------------------------------------------------------

def test_patterns_read_as_runs():
    """A unit repeated to fill `layers`, or runs that fix it; equal neighbours merge; a checkpoint's
    per-layer letters become the shortest repeating unit, or runs when none repeats."""
    assert parse_model("hybrid-tiny").runs == (Run("MMMA", 1),)
    m = parse_model(MODEL)
    assert (m.layers, m.runs, m.units, m.layer_kinds, m.moe_layers) == (4, (Run("A", 1), Run("E", 3)), 4, "AEEE", 3)
    assert parse_model("jamba-tiny:pattern=M+M+2*AE").runs == (Run("M", 2), Run("AE", 2))
    assert parse_model("moe-tiny:pattern=A+3*E").layers_of(1, 0) == [1, 2, 3]
    assert [pattern_of(k) for k in ("AEEE", "AEAE", "MMMAMMMA", "E")] == ["A+3*E", "AE", "MMMA", "E"]


@pytest.mark.parametrize("spec, words", [
    ("moe-tiny:pattern=A+3*E,layers=3", ["pattern 'A+3*E' has 4 layers", "layers=3"]),
    ("moe-tiny:pattern=A+0*E", ["term '0*E'", "count*unit"]),
    ("moe-tiny:pattern=A+3*X", ["pattern must be", "'A+3*X'"]),
    ("llama-tiny:pattern=2*A+E", ["experts must be >= 1"]),
], ids=["layers", "zero-count", "letter", "no-experts"])
def test_bad_patterns_are_one_line_errors(spec, words, capsys):
    assert cli.main(["estimate", "--model", spec, "--mesh", "data=8", "--hardware", "h100-sxm", "--seq", "64",
                     "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_explain_names_each_run(capsys):
    """A weight of two runs is ambiguous by its block's name alone; its run's path explains it, its
    collectives executed once per unit of that run (3 MoE units: x3)."""
    argv = ["explain", "--model", MODEL, "--mesh", "fsdp8"]
    assert cli.main(argv + ["attn.wq"]) == 2
    assert "runs.0.blocks.0.attn.wq, runs.1.blocks.0.attn.wq" in capsys.readouterr().err
    assert cli.main(argv + ["runs.1.blocks.0.moe.w_gate"]) == 0
    out = capsys.readouterr().out
    assert "shape [3, 8, 64, 32]" in out and re.search(r"forward +all-gather +fsdp +x3 ", out), out


# ---- the scans against a plain loop, and every strategy against one device -----------------------------

def unrolled_loss(model: LM, tokens, positions, labels):
    """The model as a list of layers applied in a Python loop, each unit's parameters sliced from its run."""
    x, stats = model.embed(tokens), []
    for units in model.runs:
        graphdef, stacked = nnx.split(units)
        for u in range(jax.tree.leaves(stacked)[0].shape[0]):
            for block in nnx.merge(graphdef, jax.tree.map(lambda a: a[u], stacked)).blocks:
                y = block(x, positions)
                x, a = y if isinstance(y, tuple) else (y, None)
                stats += [] if a is None else [a]
    return model.loss(x, labels, aux=aux_sum(model.cfg, jnp.concatenate(stats)) if stats else None)


@pytest.mark.parametrize("spec", [MODEL, pytest.param("jamba-tiny:pattern=2*M+A+E", marks=pytest.mark.slow)])
def test_runs_equal_an_unrolled_loop(spec):
    """Loss and every gradient of the scanned runs equal the plain loop's (float32, 1e-6)."""
    cfg = parse_model(spec)
    graphdef, state = nnx.split(LM(cfg, RunConfig(), rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab)
    positions = jnp.broadcast_to(jnp.arange(32), (2, 32))

    def scanned(s):
        return nnx.merge(graphdef, s)(tokens, positions, jnp.roll(tokens, -1, axis=1))

    def looped(s):
        return unrolled_loss(nnx.merge(graphdef, s), tokens, positions, jnp.roll(tokens, -1, axis=1))
    (got, g_got), (want, g_want) = (jax.jit(jax.value_and_grad(f))(state) for f in (scanned, looped))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.max(np.abs(b)), err_msg=jax.tree_util.keystr(path))


# The strategies' cases compile an 8-device step each (6 to 17 s): `make test-slow` runs them; `make test`
# checks the runs' scans against the plain loop, and test_hf_moe.py's Qwen3-MoE (pattern A+E) on its meshes.
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["pp2-tp2-dp2", "fsdp8", "tp4-sp", "ep8"])
def test_runs_equal_one_device(mesh):
    """Loss and gradients of the two-run model under each strategy equal one device's; the pipeline cuts
    the 4 units 2 + 2, so the dense layer runs in the first stage alone (its slot on stage 1 is padding)."""
    harness.assert_matches_one_device(MODEL, mesh)
    if mesh.startswith("pp"):
        sched = schedule_of(harness.trainer(MODEL, mesh).strategy, parse_model(MODEL).run_units)
        assert (sched.run_split(0), sched.run_split(1), sched.run_slots) == ((1, 0), (1, 2), (1, 2))


@pytest.mark.slow
def test_a_checkpoint_moves_between_layouts(tmp_path):
    """Saved from the pipeline (each run's weights in the uneven split's at-rest layout) and restored on one
    device: every parameter is the one saved."""
    source, target = harness.trainer(MODEL, "pp2-tp2-dp2"), harness.trainer(MODEL, "data=1", devices=1)
    ckpt = Checkpointer(str(tmp_path / "ck"), every=1)
    assert ckpt.maybe_save(1, source.state_from_params(harness.reference_params(MODEL)), source)
    ckpt.wait()
    restored, step, _ = Checkpointer(str(tmp_path / "ck"), every=1).restore(target)
    want = harness.leaves_with_paths(harness.reference_params(MODEL))
    assert step == 1 and [p for p, _ in want] == [p for p, _ in harness.leaves_with_paths(gather(restored.params))]
    for (path, a), (_, b) in zip(want, harness.leaves_with_paths(gather(restored.params))):
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh", [("moe-tiny:pattern=2*A+2*E", m) for m in ("fsdp8", "tp4-sp", "ep8")]
                         + [("hybrid-tiny:pattern=2*A+2*M", m) for m in ("pp2-tp2-dp2", "dp2-fsdp2-tp2")])
def test_runs_prediction_equals_hlo(model, mesh):
    """The cost model's collectives of a two-run model (each run's layer loop apart: jaxpar/cost/held.py
    runs, shape.run_execs; a pipeline's slots of every run) equal the compiled step's, kind by kind and
    axis by axis. Two units per run: XLA drops a one-trip loop and combines its sums otherwise
    (tests/test_cost_vs_hlo.py's hybrid note). The pipeline and data x fsdp x tensor cases run a dense
    two-run model: with MoE blocks those two layouts are not modelled for any MoE model yet (moe-tiny
    itself: the counts of the data and tensor all-reduces differ there)."""
    assert_prediction_matches(model, mesh)


@pytest.mark.slow
def test_runs_under_1f1b_equal_one_device():
    harness.assert_matches_one_device(MODEL, "pipeline=2,data=4", pp_schedule="1f1b", microbatches=2)


def test_each_run_compiles_one_body():
    """The compiled loss of a dense layer + n MoE layers has the same matmuls for n = 3 and n = 6 (each
    run's body once, in a loop of n trips), not n copies."""
    def compiled(spec):
        cfg = parse_model(spec)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
        tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

        def loss(s, t):
            return nnx.merge(graphdef, s)(t, jnp.broadcast_to(jnp.arange(16), t.shape), t)
        return jax.jit(loss).lower(state, tokens).compile().as_text()
    three, six = compiled(MODEL), compiled("moe-tiny:pattern=A+6*E")
    dots = [len(re.findall(r"\bdot\(", t)) + len(re.findall(r"custom-call\(|ragged-dot\(", t)) for t in (three, six)]
    assert dots[0] == dots[1] > 0
    assert '"n":"3"' in three and '"n":"6"' in six


# ---- the cost model: DeepSeek-V3's sequence by hand ------------------------------------------------------

def test_deepseek_v3_sequence_counts_by_hand():
    """DeepSeek-V3's 3 dense layers (SwiGLU 18432) and 58 MoE layers (256 routed experts of 2048, 1 shared,
    top-8), attention as jaxpar's GQA of 128 x 128 heads: the parameters (and the abstract model's) and
    the step's FLOPs equal the count from the config (model FLOPs the causal half of the scores), and full remat's rerun drops each dense unit's
    dead MLP output projection (the MoE units have none: the router's gradient reads the experts')."""
    m = parse_model("deepseek-v3-moe:pattern=3*A+58*E")
    d, h, f, fe, e, k, v = 7168, 128 * 128, 18432, 2048, 256, 8, 129280
    attention = d * h * 4 + 2 * d                       # q, k, v, o (128 K/V heads) and the two norms
    dense, moe = attention + 3 * d * f, attention + d * e + e * 3 * d * fe + 3 * d * fe
    hand = 3 * dense + 58 * moe + 2 * v * d + d        # embedding, head, final norm
    assert total_params(m) == hand
    abstract = nnx.eval_shape(lambda: LM(m, RunConfig(), rngs=nnx.Rngs(0)))
    assert sum(a.size for a in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == hand
    batch, seq = 8, 4096
    t = batch * seq
    qkvo, scores = 2 * t * d * h * 4, 4 * t * seq * h
    forward = (3 * (qkvo + scores + 6 * t * d * f)
               + 58 * (qkvo + scores + 2 * t * d * e + 6 * t * k * d * fe + 2 * t * k * d + 6 * t * d * fe)
               + 2 * t * d * v)
    step = cost_flops.step_flops(m, "none", batch, seq)
    assert step.hardware == pytest.approx(3 * forward, rel=1e-12)            # the dense kernel: every score
    assert step.model == pytest.approx(3 * (forward - 61 * scores / 2), rel=1e-12)  # MFU: the causal half
    rerun = cost_flops.step_flops(m, "full", batch, seq, cost_flops.Kernels(rerun_outputs=False))
    assert rerun.recompute == pytest.approx(forward - 2 * t * d * v - 3 * 2 * t * f * d, rel=1e-12)
    with pytest.raises(ConfigError, match="has 61 layers"):
        parse_model("deepseek-v3-moe:pattern=3*A+58*E,layers=60")


def test_pipeline_padding_slots_are_priced():
    """On pp2 the 4 units cut 2 + 2, so each stage runs a dense slot and two MoE slots: one dense and one MoE
    padding slot execute beside the real layers, each a layer's forward, backward (x3) in jaxpar's program."""
    m, st = parse_model(MODEL), parse_strategy("pipeline=2,data=4").resolved(8)
    sh = step_shape(m, st, 16, 64)
    assert (sh.run_slots, sh.per_chunk) == ((1, 2), 3)
    assert "units per chunk 2+2 = 4 (k=1+2 slots of its 2 runs per chunk, 2 padding)" in schedule_summary(st, m.run_units)
    fl = cost_flops.step_flops(m, "none", 16, 64)
    padded = program_flops.pipeline_padding(fl, m, sh, "none", 16, 64, cost_flops.Kernels())
    one_of_each = (cost_flops.attention_block_flops(m, 16, 64).matmul + cost_flops.moe_block_flops(m, 16, 64).matmul)
    assert padded.padding - fl.padding == pytest.approx(3 * one_of_each, rel=1e-12)
    assert padded.model == fl.model and padded.hardware - fl.hardware == pytest.approx(3 * one_of_each, rel=1e-12)

