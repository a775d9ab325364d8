"""Hugging Face Mixtral and Qwen3-MoE checkpoints (jaxpar/serving/hf.py, hf_moe.py) against `transformers` itself.

tests/data/hf_moe/<name>/ holds a tiny random checkpoint written by `transformers` and the logits and greedy
continuations `transformers` computed from it (tests/data/hf_moe/make_golden.py, run once by hand in a
separate environment): Mixtral with every layer sparse and top-2 of 4 renormalised, Qwen3-MoE with q/k
norms, top-2 of 8 without renormalisation (norm_topk_prob false) and a dense first layer (mlp_only_layers).
jaxpar's model loaded from the directory must give those logits, `jaxpar generate` those tokens under a
tensor and an expert layout, and `jaxpar train` must start from the weights.
"""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main as cli
from jaxpar.cli.args import hf_params
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models import decode
from jaxpar.models.config import parse_model, pattern_of
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.serving.hf import load_params, read_config
from jaxpar.serving.hf_moe import layer_kinds
from jaxpar.training.config import TrainConfig
from jaxpar.training.data import Synthetic
from jaxpar.training.trainer import Trainer

DATA = pathlib.Path(__file__).parent / "data" / "hf_moe"
NAMES = ("mixtral", "qwen3_moe")


def golden(name: str) -> dict:
    return json.loads((DATA / name / "golden.json").read_text())


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    """(name, model config, jaxpar's model with the checkpoint's weights on one device)."""
    name = request.param
    cfg = read_config(str(DATA / name))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
    params = load_params(str(DATA / name), cfg, nnx.state(abstract, nnx.Param))
    return name, cfg, nnx.merge(graphdef, params)


def test_configs_map_the_routing_and_the_layers(loaded):
    name, cfg, _ = loaded
    expect = {"mixtral": dict(pattern="E", experts=4, top_k=2, router_norm=True, qk_norm=False, moe_mlp_dim=32),
              "qwen3_moe": dict(pattern="A+E", experts=8, top_k=2, router_norm=False, qk_norm=True, moe_mlp_dim=16,
                                mlp_dim=64)}[name]
    assert {k: getattr(cfg, k) for k in expect} == expect
    assert (cfg.router, cfg.aux_loss_coef, cfg.z_loss_coef) == ("softmax", 0.02, 0.0)


def test_logits_equal_the_reference_implementations(loaded):
    name, _, model = loaded
    g = golden(name)
    got = np.asarray(decode.full_logits(model, jax.numpy.asarray([g["prompt"]])))[0]
    np.testing.assert_allclose(got, np.load(DATA / name / g["logits"]), rtol=1e-4, atol=1e-4)


def generate(name: str, mesh: str, out: pathlib.Path) -> list[list[int]]:
    """`jaxpar generate --model hf:DIR --hf-checkpoint DIR` of the golden prompts, each 4 times over."""
    g, directory = golden(name), DATA / name
    prompts = [",".join(map(str, p)) for p in g["prompts"] * 4]
    assert cli.main(["generate", "--model", f"hf:{directory}", "--hf-checkpoint", str(directory), "--mesh", mesh,
                     *sum((["--prompt", p] for p in prompts), []), "--max-new-tokens", str(len(g["continuations"][0])),
                     "--json", str(out)]) == 0
    return json.loads(out.read_text())["tokens"]


# Qwen3-MoE's greedy generation on data=4 x tensor=2 runs under -m slow with the other layouts;
# its logits against the reference stay in make test (test_logits_equal_the_reference_implementations)
@pytest.mark.parametrize("name, mesh", [("mixtral", "data=2,expert=4"),
                                        pytest.param("qwen3_moe", "data=4,tensor=2", marks=pytest.mark.slow)])
def test_greedy_generation_is_the_reference_implementations(name, mesh, tmp_path):
    assert generate(name, mesh, tmp_path / "g.json") == golden(name)["continuations"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", [("mixtral", "data=4,tensor=2"), ("qwen3_moe", "data=2,expert=4"),
                                        ("qwen3_moe", "ep8"), ("mixtral", "ep4-tp2")])
def test_greedy_generation_under_more_layouts(name, mesh, tmp_path):
    assert generate(name, mesh, tmp_path / "g.json") == golden(name)["continuations"] * 4


def test_training_state_is_the_checkpoint_sharded_over_experts():
    """`train --hf-checkpoint`'s start on an expert layout (Trainer.state_from_params of the loaded weights):
    every parameter holds the checkpoint's values, the experts split 4 ways over `expert`."""
    directory = str(DATA / "qwen3_moe")
    cfg = read_config(directory)
    trainer = Trainer(cfg, parse_strategy("data=2,expert=4"), TrainConfig(batch=8, seq=16))
    host = load_params(directory, cfg, trainer.abstract_params)
    state = trainer.state_from_params(hf_params(directory, cfg, trainer.abstract_params))
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
    w_gate = state.params["runs"][1]["blocks"][0]["moe"]["w_gate"]   # the checkpoint's layer 1: A+E
    assert w_gate.addressable_shards[0].data.shape == (1, cfg.experts // 4, cfg.d_model, cfg.moe_mlp_dim)


@pytest.mark.slow
def test_training_starts_from_the_checkpoint(tmp_path):
    """`train --hf-checkpoint` on an expert layout: the first step's loss is the cross-entropy of the
    loaded model's one-device logits on the same synthetic batch (rows 0..7 of step 0, seed 0) plus the
    checkpoint's router_aux_loss_coef times the balance loss the step reports."""
    directory, metrics = DATA / "mixtral", tmp_path / "m.jsonl"
    assert cli.main(["train", "--model", f"hf:{directory}", "--hf-checkpoint", str(directory), "--mesh",
                     "data=2,expert=4", "--steps", "1", "--batch", "8", "--seq", "16", "--metrics", str(metrics)]) == 0
    cfg = read_config(str(directory))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, load_params(str(directory), cfg, nnx.state(abstract, nnx.Param)))
    rows = Synthetic(cfg.vocab, 0).rows(0, range(8), 16)
    logits = np.asarray(decode.full_logits(model, jax.numpy.asarray(rows[:, :-1])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    cross_entropy = -np.take_along_axis(logp, rows[:, 1:, None], axis=-1).mean()
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(cross_entropy + cfg.aux_loss_coef * first["moe_aux_loss"], abs=1e-4)


def test_sparse_layers_become_a_pattern():
    """transformers' rule (layer i sparse unless in mlp_only_layers, and when (i + 1) % decoder_sparse_step
    == 0) written as the shortest pattern that repeats, or as runs when none does (models/config.py)."""
    c = dict(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[])
    assert layer_kinds(c, "qwen3_moe", 6) == "AEAEAE" and pattern_of("AEAEAE") == "AE"
    c = dict(num_experts=4, decoder_sparse_step=1, mlp_only_layers=[0])
    assert pattern_of(layer_kinds(c, "qwen3_moe", 4)) == "A+3*E"
    assert pattern_of(layer_kinds(dict(num_experts=0), "qwen3_moe", 4)) == "A"
    assert layer_kinds(dict(decoder_sparse_step=3), "mixtral", 3) == "EEE"


# the released checkpoints' config.json (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B), as transformers 4 wrote them
RELEASED = {
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_act="silu",
                         hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
                         num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8,
                         num_local_experts=8, output_router_logits=False, rms_norm_eps=1e-05, rope_theta=1e6,
                         router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False, vocab_size=32000),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False,
                          decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048,
                          intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
                          mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
                          num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
                          rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1e6, router_aux_loss_coef=0.001,
                          sliding_window=None, tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936),
}


@pytest.mark.parametrize("preset", RELEASED)
def test_released_configs_read_as_the_presets(tmp_path, preset):
    """The released config.json files give the shapes and routing of the presets written from the papers."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[preset]))
    cfg, want = read_config(str(tmp_path)), parse_model(preset)
    fields = ("layers", "d_model", "heads", "kv_heads", "head_dim", "vocab", "pattern", "experts", "top_k",
              "moe_mlp_dim", "router", "router_norm", "rope_theta", "norm_eps", "aux_loss_coef", "z_loss_coef")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert cfg.qk_norm == (preset == "qwen3-30b-a3b")


@pytest.mark.parametrize("name, change, words", [
    ("mixtral", dict(sliding_window=32), "sliding_window=32"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "top_k=9 must be <= experts=8"),
    ("qwen3_moe", dict(attention_bias=True), "without biases"),
    ("qwen3_moe", dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "only the llama3 rule"),
])
def test_unsupported_checkpoints_are_refused_in_one_line(tmp_path, name, change, words):
    config = json.loads((DATA / name / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=words) as e:
        read_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_another_moe_models_checkpoint_is_refused(capsys):
    """--hf-checkpoint of Qwen3-MoE (pattern AE) for --model of Mixtral's shape (pattern E): named, not loaded."""
    assert cli.main(["generate", "--model", f"hf:{DATA / 'mixtral'}", "--hf-checkpoint", str(DATA / "qwen3_moe"),
                     "--mesh", "data=8", *sum((["--prompt", "1,2"] for _ in range(8)), [])]) == 2
    assert "is another model" in capsys.readouterr().err


def test_qk_norm_needs_attention_blocks():
    with pytest.raises(ConfigError, match="qk_norm normalises attention heads: pattern 'M'"):
        parse_model("mamba2-tiny:qk_norm=true")
