"""Generation under inference layouts: a context-parallel prefill, and separate [prefill] / [decode]
layouts with the weights and the filled cache resharded between them (jaxpar/serving/generate.py,
jaxpar/core/strategy.py's phases, jaxpar/core/validate.py's check_phases).

The reference is tests/test_inference.py's: the one-device training forward over each prompt and
the generated tokens. The prefill's logits (column 0 of the result's) and every decode step's must
equal it (float32, 1e-5), and every greedy token must be its argmax. The default run compiles one
generator: jamba-tiny (Mamba-2, attention and MoE layers) prefilled on data=2 x context=2 x tensor=2
(ring attention, zigzag tokens) and decoded on data=2 x tensor=4, the shipped mesh config; the
sweep over models and context kernels is `slow`.
"""
from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from jaxpar.cli import main as cli

from jaxpar.core import validate
from jaxpar.errors import ConfigError
from jaxpar.serving.generate import Generator, prompt_width
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import MESH_CONFIG_DIR, parse_strategy
from tests.test_inference import NEW, PROMPTS, assert_collectives_as_estimated, host_params, reference_logits

SERVE = "infer-prefill-cp2-decode-tp4"


@functools.cache
def run(model: str, mesh: str, options: tuple = ()):
    """(generator, greedy Result with logits) for PROMPTS, once per module."""
    gen = Generator(parse_model(model), parse_strategy(mesh).with_options(**dict(options)), PROMPTS, NEW)
    return gen, gen.generate(gen.place_params(host_params(model)), PROMPTS, keep_logits=True)


def assert_matches_unsharded(model: str, mesh: str, options: tuple = ()) -> None:
    _, result = run(model, mesh, options)
    ref = reference_logits(model, result.tokens)
    np.testing.assert_allclose(result.logits[:, 0], ref[:, 0], rtol=0, atol=1e-5)   # the prefill
    np.testing.assert_allclose(result.logits, ref, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(result.tokens, ref.argmax(-1))


JAMBA = "jamba-tiny:ngroups=4"  # Mamba-2, attention and MoE layers (MMME); 4 groups for tensor=4


def test_prefill_on_context_then_decode_on_tensor():
    """The shipped two-layout config: the prefill splits the (padded) prompt over context=2, the
    decode runs on another mesh of the same 8 devices; tokens and logits equal one device's. One
    compile covers the three context-parallel paths (ring attention, Mamba-2's state passing, MoE
    routing of a split sequence) and MoE decode."""
    assert_matches_unsharded(JAMBA, SERVE)
    gen, result = run(JAMBA, SERVE)
    assert gen.resharded and result.reshard_s > 0
    assert dict(gen.prefill.strategy.sizes) == {"data": 2, "fsdp": 1, "pipeline": 1, "context": 2,
                                                    "expert": 1, "tensor": 2}
    assert gen.prefill.strategy.options.attention == "ring" and gen.decode.strategy.options.attention == "dense"
    assert gen.decode.strategy.size("tensor") == 4 and gen.decode.strategy.size("context") == 1
    # the prompt (5 tokens) is padded to 2 x context pieces, each at least the conv halo (3 tokens)
    assert gen.prompt_len == prompt_width(gen.model_cfg, gen.prefill.strategy, 5) == 12
    # the cache is born in the prefill layout and decoded in the decode layout: K/V heads over tensor=2, then 4
    k = gen.cache_layout["runs"][0][3]["k"]                       # [units, b, S, kv_heads, head_dim]
    assert gen.prefill.cache["runs"][0][3]["k"].shard_shape(k.shape)[3] == 2
    assert gen.decode.cache["runs"][0][3]["k"].shard_shape(k.shape)[3] == 1
    assert "prefill on" in gen.describe() and "decode on" in gen.describe()


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, options", [
    ("llama-tiny", "data=2,context=2,tensor=2", (("attention", "ring"),)),
    ("llama-tiny", "context=8", (("attention", "ring"), ("cp_layout", "zigzag"))),
    ("llama-tiny", "context=4,tensor=2", (("attention", "allgather"),)),
    ("mamba2-tiny", "data=2,context=2,tensor=2", ()),
    ("mamba2-tiny", "data=2,context=4", (("cp_layout", "zigzag"),)),
    ("hybrid-tiny", "context=4,tensor=2", (("attention", "allgather"),)),
    ("hybrid-tiny", "data=2,context=2,tensor=2", (("attention", "ring"), ("cp_layout", "zigzag"))),
    ("llama-tiny", SERVE, ()), ("hybrid-tiny:ngroups=8", SERVE, ()),
])
def test_context_parallel_prefill_sweep(model, mesh, options):
    assert_matches_unsharded(model, mesh, options)


@pytest.mark.slow
def test_decode_layout_replicating_kv_heads(tmp_path):
    """Prefill with K/V heads sharded (tensor=2 <= kv_heads=4), decode with them replicated (tensor=8):
    the cache holds 2 copies of each head, written by the prefill for the decode layout."""
    path = tmp_path / "cp-then-tp8.toml"
    path.write_text('[mesh]\ntensor = 8\n[prefill.mesh]\ncontext = 4\ntensor = 2\n[prefill.options]\n'
                    'attention = "allgather"\n')
    assert_matches_unsharded("hybrid-tiny:ngroups=8", str(path))
    gen, _ = run("hybrid-tiny:ngroups=8", str(path))
    assert gen.kv_copies == 2


# ---- mixture of experts ---------------------------------------------------------------------------

@pytest.mark.slow
def test_moe_decode_on_experts_and_tensor():
    """moe-tiny (8 experts, top-2, dropless) with experts split over expert=4 and their width over tensor=2."""
    assert_matches_unsharded("moe-tiny", "expert=4,tensor=2")


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, options", [
    ("moe-tiny", "expert=2,tensor=4", ()), ("moe-tiny", "data=2,expert=2,tensor=2", ()),
    ("jamba-tiny", "data=2,expert=2,tensor=2", ()),
])
def test_moe_decode_sweep(model, mesh, options):
    assert_matches_unsharded(model, mesh, options)


def test_moe_decode_refuses_a_context_mesh():
    st = parse_strategy("context=2,expert=2,tensor=2").with_options(attention="ring").resolved(8)
    with pytest.raises(ConfigError, match=r"decode step on context=2 with mixture-of-experts.*\[decode\] layout"):
        validate.check_generate(parse_model("moe-tiny"), st, PROMPTS, NEW)


def test_expected_experts_touched():
    """The occupancy formula against a hand count (one token touches exactly k experts; no token none)
    and a Monte-Carlo draw of uniform top-k routing; the decode estimate's routed weights grow with the
    batch from k experts' worth towards all of them."""
    from jaxpar.cost.inference import Request, expected_experts_touched, inference_estimate
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2) and expected_experts_touched(8, 2, 0) == 0
    rng = np.random.default_rng(0)
    for e, k, t in ((8, 2, 3), (64, 6, 10), (256, 8, 32)):
        draws = [len(np.unique(np.concatenate([rng.choice(e, k, replace=False) for _ in range(t)])))
                 for _ in range(800)]
        assert expected_experts_touched(e, k, t) == pytest.approx(np.mean(draws), rel=0.03), (e, k, t)
    m = parse_model("mixtral-8x7b")
    st = parse_strategy("expert=8").resolved(8)
    one, many = (inference_estimate(m, st, "h100-sxm", Request("decode", b, 512, 64)) for b in (1, 256))
    assert one.experts_touched == pytest.approx(2) and many.experts_touched == pytest.approx(8, rel=1e-6)
    assert one.routed_weights_bytes < many.routed_weights_bytes == pytest.approx(many.weights_bytes)


# ---- parsing and validation (nothing compiles) --------------------------------------------------

def test_phases_inherit_from_the_top_level(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[mesh]\ndata = 2\ntensor = 4\n[options]\ndtype = "bfloat16"\n'
                    '[prefill.options]\nattention = "ring"\n[decode.mesh]\ndata = 8\n')
    st = parse_strategy(str(path))
    pre, dec = st.phase("prefill"), st.phase("decode")
    assert pre.mesh == st.mesh and pre.options.attention == "ring" and pre.options.dtype == "bfloat16"
    assert dec.size("data") == 8 and dec.size("tensor") == 1 and dec.options == st.options
    flagged = st.with_options(dtype="float32")                   # a flag wins over every table
    assert {flagged.phase(p).options.dtype for p in ("prefill", "decode")} == {"float32"}
    assert flagged.phase("prefill").options.attention == "ring"
    shipped = parse_strategy(SERVE)
    assert shipped.phase("decode") is shipped and (MESH_CONFIG_DIR / f"{SERVE}.toml").exists()


@pytest.mark.parametrize("text, words", [
    ("[mesh]\ntensor = 8\n[decode.mesh]\ntensor = 4\n", ["prefill layout", "8 devices", "decode layout", "4"]),
    ("[mesh]\ntensor = 8\n[prefill]\nbatch = 2\n", ["[prefill] takes", "not batch"]),
    ("[mesh]\ntensor = 8\n[prefill.options]\nattention = \"spiral\"\n", ["attention='spiral'"]),
    ("[mesh]\ntensor = 8\n[prefill.mesh]\ncontext = 8\n", ["prefill layout", "context-parallel prefill",
                                                          "attention=dense"]),
    ("[mesh]\ntensor = 8\n[prefill.mesh]\ncontext = 2\ntensor = 4\n[prefill.options]\nattention = \"ring\"\n",
     ["prefill layout", "tensor=4 > kv_heads=2"]),
    ("[mesh]\ndata = 4\ntensor = 2\n[options]\nsequence_parallel = true\n", ["one token per sequence",
                                                                             "drop --sequence-parallel"]),
], ids=["device-counts", "unknown-key", "bad-option", "dense-context", "cp-vs-kv-heads", "sequence-parallel"])
def test_bad_phase_layouts(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        st = parse_strategy(str(path))
        validate.check_phases(st)
        validate.check_generate(parse_model("llama-tiny:kv_heads=2,heads=8"), st.resolved(8), PROMPTS, NEW)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_cli_generate_names_both_layouts(capsys):
    """`jaxpar generate --mesh <two-layout config>` refuses a bad prompt before compiling, naming the
    layout it checked (the full run's report is covered by the layouts' test above)."""
    argv = ["generate", "--model", "llama-tiny", "--mesh", SERVE, "--prompt", "1,2,3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "the prefill layout" in err and "batch=1 prompts is not divisible" in err
    assert jax.device_count() == 8


# ---- plan --phase prefill|decode (the cost model only) ---------------------------------------------

@pytest.mark.parametrize("phase, argv", [
    ("decode", ["--model", "llama3-70b", "--global-batch", "32", "--seq", "1024", "--gen-len", "256"]),
    ("prefill", ["--model", "llama3-8b", "--global-batch", "8", "--seq", "4096", "--gen-len", "16"]),
])
def test_plan_inference(tmp_path, phase, argv, capsys):
    """The listed layouts are ranked by step time and each fits; the top one's figures equal
    `estimate --phase` run on that layout; a candidate that does not fit is never listed."""
    from jaxpar.cost.inference import Request, inference_estimate
    from jaxpar.planning.inference import candidates
    out, est_out = tmp_path / "plan.json", tmp_path / "est.json"
    assert cli.main(["plan", "--hardware", "h100-sxm", "--devices", "8", "--phase", phase, *argv,
                     "--json", str(out)]) == 0
    plans = json.loads(out.read_text())["plans"]
    assert plans and [p["step_s"] for p in plans] == sorted(p["step_s"] for p in plans)
    assert all(p["fits"] for p in plans)
    top = plans[0]
    mesh = ",".join(f"{a}={n}" for a, n in top["mesh"].items() if n > 1)
    assert cli.main(["estimate", "--hardware", "h100-sxm", "--mesh", mesh, "--phase", phase, "--attention",
                     top["attention"], *argv, "--json", str(est_out)]) == 0
    est = json.loads(est_out.read_text())
    for key in ("step_s", "tokens_per_s", "memory", "matmul_flops", "hbm_bytes"):
        assert est[key] == pytest.approx(top[key], rel=1e-12), key
    m = parse_model(argv[1])
    b, s, g = (int(argv[i]) for i in (3, 5, 7))
    listed = {tuple(sorted(p["mesh"].items())) for p in plans}
    too_big = [st for st in candidates(m, 8, phase, 8)
               if not inference_estimate(m, st, "h100-sxm", Request(phase, b, s, g)).fits]
    assert all(tuple(sorted(dict(st.mesh).items())) not in listed for st in too_big)
    if phase == "decode":
        assert too_big   # 70b in float32 masters does not fit on fewer than 8 tensor ranks
    assert f"{phase} layouts" in capsys.readouterr().out


def test_moe_steps_collectives_equal_the_cost_model():
    """moe-tiny on expert=2 x tensor=4, compiled only: the prefill's and the decode step's collectives
    (HLO tally, scalars aside) equal jaxpar/cost/inference.py's per kind and axes (counts exact, bytes
    within 1%), and the decode step's expert all-to-alls are the hand count: 2 per MoE layer, each a
    device's buckets to its 2 expert owners (the grouped kernel on CPU, jaxpar/ops/moe_grouped.py) of
    4 rows each (its 2 sequences' one token sends at most min(k, E/n) = 2 copies to an owner) x d=64 float32."""
    from jaxpar.cost.inference import Request, inference_estimate
    model = parse_model("moe-tiny")
    gen = Generator(model, parse_strategy("expert=2,tensor=4"), PROMPTS, NEW)
    for phase, compiled in zip(("prefill", "decode"), gen.compiled_steps()):
        est = inference_estimate(model, gen.strategy, "h100-sxm", Request(phase, gen.batch, gen.prompt_len, NEW), compiler="cpu")
        got = assert_collectives_as_estimated(compiled, gen.mesh, est, phase)
    assert got["all-to-all", ("expert",)] == [2 * model.moe_layers, 2 * model.moe_layers * 2 * 4 * 64 * 4]


@pytest.mark.parametrize("mesh", [SERVE, "data=4,context=2"])
def test_context_prefill_collectives_equal_the_cost_model(mesh):
    """llama-tiny prefilled on data=2 x context=2 x tensor=2 (ring, zigzag: the shipped config) and on
    data=4 x context=2 (ring, contiguous), compiled only: every collective of the prefill step (ring K/V
    permutes, the key positions' ring, the cache fill's K/V all-gathers, the last token's slice and sum
    over context, the tensor sums over the context rank's share of the tokens) equals the cost model's, counts
    exact and bytes within 1%."""
    from jaxpar.cost.inference import Request, inference_estimate
    model = parse_model("llama-tiny")
    strategy = parse_strategy(mesh)
    if "=" in mesh:
        strategy = strategy.with_options(attention="ring")
    gen = Generator(model, strategy, PROMPTS, NEW)
    pre = gen.prefill
    est = inference_estimate(model, pre.strategy, "h100-sxm", Request("prefill", gen.batch, gen.prompt_len, NEW), compiler="cpu")
    got = assert_collectives_as_estimated(gen.compiled_steps()[0], pre.mesh, est, "prefill")
    assert ("all-gather", ("context",)) in got
