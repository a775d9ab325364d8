"""Hugging Face Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints (jaxpar/serving/hf.py, hf_moe.py, hf_deepseek.py)
against `transformers` itself.

tests/data/hf_moe/<name>/ holds a tiny random checkpoint written by `transformers` and the logits and greedy
continuations `transformers` computed from it (tests/data/hf_moe/make_golden.py, run once by hand in a
separate environment): Mixtral with every layer sparse and top-2 of 4 renormalised, Qwen3-MoE with q/k
norms, top-2 of 8 without renormalisation (norm_topk_prob false) and a dense first layer (mlp_only_layers),
DeepSeek-V3 with latent attention (interleaved RoPE), a dense first layer, a shared expert and sigmoid
scores with a random correction bias, 2 of 4 groups, scaled by 2.5.
jaxpar's model loaded from the directory must give those logits, `jaxpar generate` those tokens under a
tensor and an expert layout, and `jaxpar train` must start from the weights.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxpar.cli import main as cli
from jaxpar.cli.args import hf_params
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models import decode
from jaxpar.models.config import parse_model, pattern_of
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.serving.hf import load_params, read_config, read_tensors
from jaxpar.serving.hf_moe import layer_kinds
from jaxpar.training.config import TrainConfig
from jaxpar.training.data import Synthetic
from jaxpar.training.trainer import Trainer

DATA = pathlib.Path(__file__).parent / "data" / "hf_moe"
NAMES = ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn")


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
                                mlp_dim=64),
              "deepseek_v3": dict(pattern="A+2*E", experts=8, top_k=2, router_norm=True, shared_experts=1,
                                  moe_mlp_dim=16, mlp_dim=96, kv_lora_rank=16, q_lora_rank=24, head_dim=12,
                                  qk_rope_head_dim=4, v_head_dim=8, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, router_bias=True)}
    expect["deepseek_v3_yarn"] = expect["deepseek_v3"] | dict(rope_type="yarn", rope_scaling_factor=4.0,
                                                              rope_original_max_seq=16, rope_mscale_all_dim=0.5)
    assert {k: getattr(cfg, k) for k in expect[name]} == expect[name]
    router = "sigmoid" if name.startswith("deepseek_v3") else "softmax"
    assert (cfg.router, cfg.aux_loss_coef, cfg.z_loss_coef) == (router, 0.02, 0.0)


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


@pytest.mark.parametrize("mesh", [
    "data=2,expert=2,tensor=2",   # the latent cache replicated over tensor, the experts split over expert
    pytest.param("data=8", marks=pytest.mark.slow),
    pytest.param("data=4,tensor=2", marks=pytest.mark.slow),
    pytest.param("data=4,expert=2", marks=pytest.mark.slow),
])
def test_deepseek_v3_greedy_generation_is_transformers(mesh, tmp_path):
    """Latent attention's compressed cache read absorbed, group-limited routing with the checkpoint's bias:
    transformers' greedy tokens (8 sequences: data 8 is one device's model per sequence)."""
    assert generate("deepseek_v3", mesh, tmp_path / "g.json") == golden("deepseek_v3")["continuations"] * 4


@pytest.mark.slow
def test_deepseek_v3_with_yarn_generates_transformers_tokens(tmp_path):
    """YaRN's RoPE and softmax mscale in the decode steps too (the absorbed read of the latent cache)."""
    got = generate("deepseek_v3_yarn", "data=2,expert=2,tensor=2", tmp_path / "g.json")
    assert got == golden("deepseek_v3_yarn")["continuations"] * 4


# deepseek-ai/DeepSeek-V3's config.json as released (transformers 4.33 fields), for `deepseek-v3`
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False,
                   aux_loss_alpha=0.001, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
                   intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048,
                   moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
                   num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
                   num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                            weight_block_size=[128, 128]),
                   rms_norm_eps=1e-6, rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0,
                                                        mscale_all_dim=1.0, original_max_position_embeddings=4096,
                                                        type="yarn"),
                   rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True,
                   tie_word_embeddings=False, topk_group=4, topk_method="noaux_tc", v_head_dim=128, vocab_size=129280)


def test_the_released_deepseek_v3_config_reads_as_the_preset_once_its_refusals_are_met(tmp_path):
    """As released: the block-FP8 weights, refused in one line; dequantized: the shapes and routing of
    `deepseek-v3`, with YaRN's 160K-context RoPE (factor 40 over 4K; softmax scale x (0.1 ln 40 + 1)^2)."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    with pytest.raises(ConfigError, match="weight_block_size") as e:
        read_config(str(tmp_path))
    assert "\n" not in str(e.value)
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(config | dict(max_position_embeddings=4096)))
    cfg, want = read_config(str(tmp_path)), parse_model("deepseek-v3")
    assert (cfg.rope_type, cfg.rope_scaling_factor, cfg.rope_original_max_seq) == ("yarn", 40.0, 4096)
    assert cfg.latent_softmax_scale == pytest.approx((0.1 * np.log(40) + 1) ** 2) and cfg.rope_scaling.cos_sin == 1.0
    fields = ("layers", "d_model", "heads", "kv_heads", "head_dim", "vocab", "pattern", "experts", "top_k",
              "shared_experts", "moe_mlp_dim", "mlp_dim", "router", "router_norm", "routed_scaling_factor", "n_group",
              "topk_group", "router_bias", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
              "rope_theta", "norm_eps", "max_seq")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(want, f) for f in fields}


def test_multi_token_prediction_layers_are_named_and_not_loaded(tmp_path, capsys):
    """A checkpoint with DeepSeek-V3's MTP module (layer num_hidden_layers): loaded without it, and said so."""
    directory = tmp_path / "ckpt"
    shutil.copytree(DATA / "deepseek_v3", directory)
    tensors = {n: v for n, v in read_tensors(str(directory)).items()}
    tensors["model.layers.3.enorm.weight"] = np.ones(64, np.float32)
    tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
    (directory / "model.safetensors").unlink()
    save_file(tensors, str(directory / "mtp.safetensors"))
    cfg = read_config(str(directory))
    load_params(str(directory), cfg, nnx.state(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))), nnx.Param))
    err = capsys.readouterr().err
    assert "layers 3 (multi-token prediction modules, 2 tensors) are not loaded" in err


@pytest.mark.parametrize("name, change, words", [
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("mixtral", dict(sliding_window=32), "sliding_window=32"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "top_k=9 must be <= experts=8"),
    ("qwen3_moe", dict(attention_bias=True), "without biases"),
    ("qwen3_moe", dict(rope_parameters=dict(rope_type="longrope", factor=4.0)), "only the llama3 and yarn rules"),
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
