"""Hugging Face LLaMA-layout checkpoints: config.json + *.safetensors into jaxpar's model and parameters.

A directory as `transformers` saves a LlamaForCausalLM (or a Mistral one, the same layout): config.json
(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
vocab_size, max_position_embeddings, rms_norm_eps, rope_theta, rope_scaling, tie_word_embeddings) and
one or more *.safetensors files. Each Linear stores its weight as [out, in] (y = x W^T); jaxpar's
weights are [in, out] with the heads split out, stacked over layers:

    model.embed_tokens.weight              [V, d]        -> embedding [V, d]
    layers.i.input_layernorm.weight        [d]           -> units.blocks[0].attn_norm.scale [i]
    layers.i.self_attn.q_proj.weight       [h*hd, d]     -> wq [i] = W^T as [d, h, hd]   (k, v: kv heads)
    layers.i.self_attn.o_proj.weight       [d, h*hd]     -> wo [i] = W^T as [h, hd, d]
    layers.i.post_attention_layernorm      [d]           -> mlp_norm.scale [i]
    layers.i.mlp.gate_proj / up_proj       [f, d]        -> w_gate / w_up [i] = W^T
    layers.i.mlp.down_proj                 [d, f]        -> w_down [i] = W^T
    model.norm.weight, lm_head.weight      [d], [V, d]   -> final_norm.scale, head = W^T
Hugging Face's LLaMA applies RoPE in the rotate-half form (its conversion script permutes Meta's q/k
weights into it), which is jaxpar's (models/layers.py `rope`), so q and k load as they are. Weights
are read as float32 (jaxpar's masters; a bf16 file is read through the flax framework of safetensors)
and each is given in its abstract parameter's dtype: float32 for training, bfloat16 for bf16 serving
(`jaxpar generate --dtype bfloat16`), converted on the host before it moves to the devices.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig

PREFIX = "hf:"  # --model hf:DIR reads DIR/config.json


def read_config(directory: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face LLaMA-layout directory (its config.json)."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (a Hugging Face checkpoint directory holds config.json and "
                          "*.safetensors)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    kind = c.get("model_type")
    if kind not in ("llama", "mistral"):
        raise ConfigError(f"{path}: model_type={kind!r}; jaxpar loads the LLaMA layout (model_type llama or mistral)")
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise ConfigError(f"{path}: hidden_act={c.get('hidden_act')!r}, attention_bias={c.get('attention_bias')}, "
                          f"mlp_bias={c.get('mlp_bias')}: jaxpar's LLaMA block is SwiGLU without biases")
    try:
        heads, d = int(c["num_attention_heads"]), int(c["hidden_size"])
        fields = dict(name=path.parent.name or "hf", layers=int(c["num_hidden_layers"]), d_model=d, heads=heads,
                      kv_heads=int(c.get("num_key_value_heads", heads)), head_dim=int(c.get("head_dim") or d // heads),
                      mlp_dim=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                      max_seq=int(c.get("max_position_embeddings", 2048)), norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                      rope_theta=float(c.get("rope_theta", 10_000.0)),
                      tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: missing or malformed field ({e})") from None
    scaling = c.get("rope_scaling")
    if scaling:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ConfigError(f"{path}: rope_scaling {scaling}: only the llama3 rule is implemented")
        fields.update(rope_scaling_factor=float(scaling["factor"]),
                      rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                      rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                      rope_original_max_seq=int(scaling.get("original_max_position_embeddings", 8192)))
    cfg = ModelConfig(**fields)
    cfg.validate()
    return cfg


def read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the directory's *.safetensors files, as float32 numpy arrays."""
    files = sorted(pathlib.Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files")
    out = {}
    for f in files:
        with safe_open(str(f), framework="flax") as reader:
            for name in reader.keys():
                out[name] = np.asarray(reader.get_tensor(name), dtype=np.float32)
    return out


def _leaf(cfg: ModelConfig, tensors: dict[str, np.ndarray], key: str) -> np.ndarray:
    """The array for one parameter path of jaxpar's LM (its jax.tree_util.keystr)."""
    d, h, kv, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ConfigError(f"the checkpoint has no tensor {name!r} (a LLaMA-layout checkpoint of "
                              f"{cfg.layers} layers needs it)")
        return tensors[name]

    def layers(suffix: str, shape, transpose: bool = True) -> np.ndarray:
        return np.stack([(get(f"model.layers.{i}.{suffix}").T if transpose else get(f"model.layers.{i}.{suffix}"))
                         .reshape(shape) for i in range(cfg.layers)])

    table = {
        "['embedding']": lambda: get("model.embed_tokens.weight"),
        "['final_norm']['scale']": lambda: get("model.norm.weight"),
        "['head']": lambda: get("lm_head.weight").T,
        "['units']['blocks'][0]['attn_norm']['scale']": lambda: layers("input_layernorm.weight", (d,), False),
        "['units']['blocks'][0]['mlp_norm']['scale']": lambda: layers("post_attention_layernorm.weight", (d,), False),
        "['units']['blocks'][0]['attn']['wq']": lambda: layers("self_attn.q_proj.weight", (d, h, hd)),
        "['units']['blocks'][0]['attn']['wk']": lambda: layers("self_attn.k_proj.weight", (d, kv, hd)),
        "['units']['blocks'][0]['attn']['wv']": lambda: layers("self_attn.v_proj.weight", (d, kv, hd)),
        "['units']['blocks'][0]['attn']['wo']": lambda: layers("self_attn.o_proj.weight", (h, hd, d)),
        "['units']['blocks'][0]['mlp']['w_gate']": lambda: layers("mlp.gate_proj.weight", (d, cfg.mlp_dim)),
        "['units']['blocks'][0]['mlp']['w_up']": lambda: layers("mlp.up_proj.weight", (d, cfg.mlp_dim)),
        "['units']['blocks'][0]['mlp']['w_down']": lambda: layers("mlp.down_proj.weight", (cfg.mlp_dim, d)),
    }
    base = key.removesuffix(".value")
    if base not in table:
        raise ConfigError(f"no Hugging Face LLaMA tensor maps to jaxpar parameter {base}")
    return table[base]()


def load_params(directory: str, cfg: ModelConfig, abstract_params):
    """jaxpar's parameter tree (the structure of `abstract_params`, an nnx.State of shapes) filled from
    the directory's tensors, as host arrays of each abstract leaf's dtype; shapes checked against the model."""
    import jax  # deferred: JAX stays out of `jaxpar estimate --model hf:DIR`, which reads only config.json

    if cfg.pattern != "A":
        raise ConfigError(f"model {cfg.name}: Hugging Face LLaMA checkpoints load into attention-only models, "
                          f"got pattern={cfg.pattern!r}")
    tensors = read_tensors(directory)

    def fill(path, leaf):
        key = jax.tree_util.keystr(path)
        value = _leaf(cfg, tensors, key)
        if value.shape != tuple(leaf.shape):
            raise ConfigError(f"{directory}: {key.removesuffix('.value')} has shape {value.shape}, the model "
                              f"needs {tuple(leaf.shape)}")
        return value.astype(leaf.dtype, copy=False)
    return jax.tree_util.tree_map_with_path(fill, abstract_params)
