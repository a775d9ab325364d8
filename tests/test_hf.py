"""Hugging Face LLaMA-layout checkpoints (jaxpar/serving/hf.py) against a plain numpy forward of the same weights.

The test writes a tiny checkpoint as `transformers` lays one out (config.json, two *.safetensors files,
Linear weights [out, in], RoPE in the rotate-half form with Llama 3.1's scaling) and computes the
logits with numpy straight from those tensors: embedding, RMSNorm, q/k/v, RoPE, causal GQA softmax
attention, SwiGLU, final norm, head. jaxpar's model loaded from the directory must give the same logits,
and `jaxpar generate --model hf:DIR --hf-checkpoint DIR` on data x tensor the numpy greedy tokens.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main as cli
from jaxpar.errors import ConfigError
from jaxpar.serving.hf import load_params, read_config
from jaxpar.models import decode
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM

CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=16))


def write_checkpoint(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import save_file
    c, rng = CONFIG, np.random.default_rng(0)
    d, h, kv, hd, f, v = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "intermediate_size", "vocab_size"))
    w = lambda *shape: (rng.normal(size=shape) * 0.2).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d), "lm_head.weight": w(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d),
              p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
              p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
              p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d), p + "mlp.down_proj.weight": w(d, f)}
    names = sorted(t)
    save_file({k: t[k] for k in names[: len(names) // 2]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[len(names) // 2:]}, str(directory / "model-00002-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return t


def numpy_logits(t: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """LLaMA's forward written out in float64 numpy from the Hugging Face tensors."""
    c = CONFIG
    h, kv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    s = tokens.shape[-1]
    t = {k: a.astype(np.float64) for k, a in t.items()}

    def norm(x, wt):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * wt

    sc = c["rope_scaling"]
    inv = c["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    wavelen = 2 * np.pi / inv
    lo, hi = sc["original_max_position_embeddings"] / sc["low_freq_factor"], sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    smooth = (sc["original_max_position_embeddings"] / wavelen - sc["low_freq_factor"]) / (sc["high_freq_factor"] - sc["low_freq_factor"])
    inv = np.where(wavelen > lo, inv / sc["factor"], np.where(wavelen < hi, inv, (1 - smooth) * inv / sc["factor"] + smooth * inv))
    ang = np.arange(s)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # x [s, heads, hd]; rotate half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    x = t["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = norm(x, t[p + "input_layernorm.weight"])
        q = rope((a @ t[p + "self_attn.q_proj.weight"].T).reshape(s, h, hd))
        k = rope((a @ t[p + "self_attn.k_proj.weight"].T).reshape(s, kv, hd))
        v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(s, kv, hd)
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((s, s), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(s, h * hd) @ t[p + "self_attn.o_proj.weight"].T
        m = norm(x, t[p + "post_attention_layernorm.weight"])
        gate = m @ t[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    return directory, write_checkpoint(directory)


def test_loaded_model_gives_the_numpy_logits(checkpoint):
    directory, tensors = checkpoint
    cfg = read_config(str(directory))
    assert (cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.rope_scaling) == (2, 2, 16, (8.0, 1.0, 4.0, 16))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
    params = load_params(str(directory), cfg, nnx.state(abstract, nnx.Param))
    model = nnx.merge(graphdef, params)
    tokens = np.array([3, 17, 99, 5, 64, 1, 120, 42, 8, 33, 7, 90, 2, 11, 56, 77, 31, 4, 100, 6])  # past the 16 of rope
    got = np.asarray(decode.full_logits(model, jax.numpy.asarray(tokens[None])))[0]
    np.testing.assert_allclose(got, numpy_logits(tensors, tokens), rtol=0, atol=2e-4)


def test_generate_from_the_checkpoint_on_data_x_tensor(checkpoint, tmp_path):
    directory, tensors = checkpoint
    prompt, new = [3, 17, 99, 5], 4
    out = tmp_path / "g.json"
    assert cli.main(["generate", "--model", f"hf:{directory}", "--hf-checkpoint", str(directory), "--mesh",
                     "data=4,tensor=2", *sum((["--prompt", ",".join(map(str, prompt))] for _ in range(4)), []),
                     "--max-new-tokens", str(new), "--json", str(out)]) == 0
    seq = list(prompt)
    for _ in range(new):  # numpy greedy decoding
        seq.append(int(numpy_logits(tensors, np.array(seq))[-1].argmax()))
    assert json.loads(out.read_text())["tokens"] == [seq[len(prompt):]] * 4


@pytest.mark.parametrize("change, words", [
    (dict(model_type="gpt2"), "model_type='gpt2'"),
    (dict(hidden_act="gelu"), "SwiGLU without biases"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)), "only the llama3 and yarn rules"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "YaRN needs factor and original_max_position_embeddings"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=0.9)),
     "derives the attention factor"),
])
def test_unsupported_checkpoints_are_refused(tmp_path, change, words):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | change))
    with pytest.raises(ConfigError, match=words):
        read_config(str(tmp_path))


def test_another_models_checkpoint_is_refused(checkpoint, capsys):
    directory, _ = checkpoint
    assert cli.main(["generate", "--model", "llama-tiny", "--hf-checkpoint", str(directory), "--mesh", "data=8",
                     *sum((["--prompt", "1,2"] for _ in range(8)), [])]) == 2
    assert "is another model" in capsys.readouterr().err


def test_training_starts_from_the_checkpoint(checkpoint, tmp_path):
    """`train --hf-checkpoint`: the first step's loss is the numpy model's cross-entropy on the same
    synthetic batch (rows 0..7 of step 0, seed 0)."""
    from jaxpar.training.data import Synthetic
    directory, tensors = checkpoint
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["train", "--model", f"hf:{directory}", "--hf-checkpoint", str(directory), "--mesh", "data=8",
                     "--steps", "1", "--batch", "8", "--seq", "16", "--metrics", str(metrics)]) == 0
    toks = Synthetic(CONFIG["vocab_size"], 0).rows(0, range(8), 16)
    losses = []
    for row in toks:
        logits = numpy_logits(tensors, row[:-1])
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        losses.append(-logp[np.arange(16), row[1:]].mean())
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(np.mean(losses), abs=1e-4)
