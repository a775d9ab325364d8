"""Hugging Face LLaMA-layout checkpoints: config.json + *.safetensors into jaxpar's model and parameters.

A directory as `transformers` saves a LlamaForCausalLM (or a Mistral one, the same layout): config.json
(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
vocab_size, max_position_embeddings, rms_norm_eps, rope_theta and rope_scaling (the llama3 or yarn rule)
or transformers 5's rope_parameters, tie_word_embeddings) and one or more *.safetensors files. Its mixtures of experts,
MixtralForCausalLM and Qwen3MoeForCausalLM, add a router and experts to some layers and Qwen3-MoE a
per-head q/k RMSNorm (jaxpar/serving/hf_moe.py). Each Linear stores its weight as [out, in] (y = x W^T);
jaxpar's weights are [in, out] with the heads split out, stacked over the units of each run of `pattern`
(block j of unit u of a run is the checkpoint's layer u * len(unit) + j after the earlier runs' layers:
ModelConfig.layers_of; below, pattern "A"):

    model.embed_tokens.weight              [V, d]        -> embedding [V, d]
    layers.i.input_layernorm.weight        [d]           -> runs[0].blocks[0].attn_norm.scale [i]
    layers.i.self_attn.q_proj.weight       [h*hd, d]     -> wq [i] = W^T as [d, h, hd]   (k, v: kv heads)
    layers.i.self_attn.o_proj.weight       [d, h*hd]     -> wo [i] = W^T as [h, hd, d]
    layers.i.post_attention_layernorm      [d]           -> mlp_norm.scale [i]
    layers.i.mlp.gate_proj / up_proj       [f, d]        -> w_gate / w_up [i] = W^T
    layers.i.mlp.down_proj                 [d, f]        -> w_down [i] = W^T
    model.norm.weight, lm_head.weight      [d], [V, d]   -> final_norm.scale, head = W^T
    layers.i.self_attn.q_norm / k_norm     [hd]          -> attn.q_norm.scale / k_norm.scale [i] (Qwen3)
Hugging Face's LLaMA applies RoPE in the rotate-half form (its conversion script permutes Meta's q/k
weights into it), which is jaxpar's (models/layers.py `rope`), so q and k load as they are. Weights
are read as float32 (jaxpar's masters; a bf16 file is read through the flax framework of safetensors)
and each is given in its abstract parameter's dtype: float32 for training, bfloat16 for bf16 serving
(`jaxpar generate --dtype bfloat16`), converted on the host before it moves to the devices.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
from safetensors import safe_open

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.serving import hf_deepseek, hf_mamba
from jaxpar.serving.hf_moe import ARCHITECTURES, expert_tensor, moe_fields

PREFIX = "hf:"  # --model hf:DIR reads DIR/config.json


def read_json(directory: str) -> dict:
    """The directory's config.json as a dict."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (a Hugging Face checkpoint directory holds config.json and "
                          "*.safetensors)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return c


def rope_fields(c: dict, where: str) -> dict:
    """RoPE's ModelConfig fields: rope_theta and rope_scaling as transformers 4 writes them, or the one
    rope_parameters dict of transformers 5 (rope_type "default": unscaled)."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    fields = dict(rope_theta=float(c.get("rope_theta") or params.get("rope_theta") or 10_000.0))
    if not scaling:
        return fields
    rule = scaling.get("rope_type", scaling.get("type"))
    if rule == "yarn":
        return fields | yarn_fields(scaling, where)
    if rule != "llama3":
        raise ConfigError(f"{where}: rope_scaling {scaling}: only the llama3 and yarn rules are implemented")
    return fields | dict(rope_scaling_factor=float(scaling["factor"]),
                         rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                         rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                         rope_original_max_seq=int(scaling.get("original_max_position_embeddings", 8192)))


def yarn_fields(scaling: dict, where: str) -> dict:
    """YaRN's ModelConfig fields from transformers' `yarn` rope_scaling (DeepSeek-V2 / V3 write it); an
    explicit attention_factor, truncate false, or a missing factor or original context refused in one line."""
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise ConfigError(f"{where}: rope_scaling {scaling}: jaxpar's YaRN derives the attention factor from "
                          "mscale and mscale_all_dim and rounds the correction range (truncate true)")
    if not scaling.get("factor") or not scaling.get("original_max_position_embeddings"):
        raise ConfigError(f"{where}: rope_scaling {scaling}: YaRN needs factor and original_max_position_embeddings")
    return dict(rope_type="yarn", rope_scaling_factor=float(scaling["factor"]),
                rope_original_max_seq=int(scaling["original_max_position_embeddings"]),
                rope_beta_fast=float(scaling.get("beta_fast") or 32.0),
                rope_beta_slow=float(scaling.get("beta_slow") or 1.0), rope_mscale=float(scaling.get("mscale") or 0.0),
                rope_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))


def read_config(directory: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face LLaMA, Mistral, Mixtral, Qwen3-MoE, DeepSeek-V3 or Mamba-2 directory
    (its config.json)."""
    c, path = read_json(directory), pathlib.Path(directory) / "config.json"
    kind = c.get("model_type")
    if hf_mamba.is_mamba_ssm(c):
        raise ConfigError(f"{path}: mamba_ssm's own config (d_model, n_layer, ssm_cfg); convert the checkpoint to "
                          "transformers' Mamba2ForCausalLM first (transformers/models/mamba2/"
                          "convert_mamba2_ssm_checkpoint_to_pytorch.py)")
    if kind not in ("llama", "mistral", *ARCHITECTURES, hf_deepseek.KIND, hf_mamba.KIND):
        raise ConfigError(f"{path}: model_type={kind!r}; jaxpar loads the LLaMA layout (model_type llama or mistral), "
                          f"its mixtures of experts ({', '.join(ARCHITECTURES)}), {hf_deepseek.KIND} and "
                          f"{hf_mamba.KIND}")
    if kind == hf_mamba.KIND:
        return _validated(path, lambda: dict(name=path.parent.name or "hf", **hf_mamba.mamba_fields(c, str(path))))
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise ConfigError(f"{path}: hidden_act={c.get('hidden_act')!r}, attention_bias={c.get('attention_bias')}, "
                          f"mlp_bias={c.get('mlp_bias')}: jaxpar's LLaMA block is SwiGLU without biases")
    def fields() -> dict:
        heads, d = int(c["num_attention_heads"]), int(c["hidden_size"])
        out = dict(name=path.parent.name or "hf", layers=int(c["num_hidden_layers"]), d_model=d, heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or d // heads), mlp_dim=int(c["intermediate_size"]),
                   vocab=int(c["vocab_size"]), max_seq=int(c.get("max_position_embeddings", 2048)),
                   norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)), **rope_fields(c, str(path)))
        if kind in ARCHITECTURES:
            out.update(moe_fields(c, kind, out["layers"], str(path)))
        if kind == hf_deepseek.KIND:
            out.update(hf_deepseek.deepseek_fields(c, out["layers"], str(path)))
        return out
    return _validated(path, fields)


def _validated(path: pathlib.Path, fields) -> ModelConfig:
    """ModelConfig(**fields()), validated; a missing or malformed config.json field named in one line."""
    try:
        cfg = ModelConfig(**fields())
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: missing or malformed field ({e})") from None
    cfg.validate()
    return cfg


def read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the directory's *.safetensors files, as float32 numpy arrays; a shard that
    model.safetensors.index.json lists and the directory lacks is named in one line."""
    files = sorted(pathlib.Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files")
    index = pathlib.Path(directory) / "model.safetensors.index.json"
    listed = set(json.loads(index.read_text()).get("weight_map", {}).values()) if index.is_file() else set()
    missing = sorted(listed - {f.name for f in files})
    if missing:
        raise ConfigError(f"{directory}: model.safetensors.index.json lists {', '.join(missing)}, which the "
                          f"directory lacks")
    out = {}
    for f in files:
        with safe_open(str(f), framework="flax") as reader:
            for name in reader.keys():
                out[name] = np.asarray(reader.get_tensor(name), dtype=np.float32)
    return out


# the tensor of layer i for a block's parameter (the path below ['runs'][r]['blocks'][j]): (name, jaxpar shape or
# None for a vector, transposed); the MoE block's router and experts come from hf_moe.expert_tensor
_BLOCK = {
    ("attn_norm", "scale"): ("input_layernorm.weight", None),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("attn", "wq"): ("self_attn.q_proj.weight", ("d", "h", "hd")),
    ("attn", "wk"): ("self_attn.k_proj.weight", ("d", "kv", "hd")),
    ("attn", "wv"): ("self_attn.v_proj.weight", ("d", "kv", "hd")),
    ("attn", "wo"): ("self_attn.o_proj.weight", ("h", "hd", "d")),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", None),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", ("d", "f")),
    ("mlp", "w_up"): ("mlp.up_proj.weight", ("d", "f")),
    ("mlp", "w_down"): ("mlp.down_proj.weight", ("f", "d")),
}
_UNITS = re.compile(r"\['runs'\]\[(\d+)\]\['blocks'\]\[(\d+)\]((?:\['\w+'\])+)")


def _leaf(cfg: ModelConfig, c: dict, tensors: dict[str, np.ndarray], key: str) -> np.ndarray:
    """The array for one parameter path of jaxpar's LM (its jax.tree_util.keystr): a whole-model tensor, or
    a block's stacked over its run's units (ModelConfig.layers_of); `c` the checkpoint's config.json."""
    kind = c.get("model_type")
    sizes = dict(d=cfg.d_model, h=cfg.heads, kv=cfg.kv_heads, hd=cfg.head_dim, f=cfg.mlp_dim)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ConfigError(f"the checkpoint has no tensor {name!r} (a {kind} checkpoint of {cfg.layers} layers "
                              "needs it)")
        return tensors[name]

    whole = {"['embedding']": "model.embed_tokens.weight", "['final_norm']['scale']": "model.norm.weight",
             **(hf_mamba.WHOLE if kind == hf_mamba.KIND else {})}
    base = key.removesuffix(".value")
    block = _UNITS.fullmatch(base)
    member = tuple(re.findall(r"'(\w+)'", block.group(3))) if block else ()
    if base in whole:
        return get(whole[base])
    if base == "['head']":
        return get("lm_head.weight").T
    if not block:
        raise ConfigError(f"no Hugging Face {kind} tensor maps to jaxpar parameter {base}")
    layers = cfg.layers_of(int(block.group(1)), int(block.group(2)))
    if kind == hf_mamba.KIND:
        return np.stack([hf_mamba.block_tensor(get, cfg, c, i, member) for i in layers])
    if member[0] == "attn" and cfg.mla:
        return np.stack([hf_deepseek.attention_tensor(get, cfg, c, i, member[1]) for i in layers])
    if member[0] == "moe" and member[1] in ("router_bias", "shared"):
        return np.stack([hf_deepseek.moe_tensor(get, i, member[1:]) for i in layers])
    if member[0] == "moe":
        return np.stack([expert_tensor(get, "qwen3_moe" if kind == hf_deepseek.KIND else kind, i, cfg.experts,
                                       member[1]) for i in layers])
    if member not in _BLOCK:
        raise ConfigError(f"no Hugging Face {kind} tensor maps to jaxpar parameter {base}")
    name, shape = _BLOCK[member]
    return np.stack([get(f"model.layers.{i}.{name}") if shape is None
                     else get(f"model.layers.{i}.{name}").T.reshape([sizes[a] for a in shape]) for i in layers])


def load_params(directory: str, cfg: ModelConfig, abstract_params):
    """jaxpar's parameter tree (the structure of `abstract_params`, an nnx.State of shapes) filled from
    the directory's tensors, as host arrays of each abstract leaf's dtype; shapes checked against the model.
    The caller places them in its strategy's shardings (Generator.place_params, Trainer.state_from_params)."""
    import jax  # deferred: JAX stays out of `jaxpar estimate --model hf:DIR`, which reads only config.json

    c = read_json(directory)
    if cfg.has_mamba and c.get("model_type") != hf_mamba.KIND:
        raise ConfigError(f"model {cfg.name}: a {c.get('model_type')} checkpoint has no Mamba-2 layers, the model's "
                          f"pattern is {cfg.pattern!r}")
    tensors = read_tensors(directory)
    note = hf_deepseek.unloaded_note(tensors, int(c.get("num_hidden_layers", cfg.layers)))
    if note:
        print(note, file=sys.stderr)

    def fill(path, leaf):
        key = jax.tree_util.keystr(path)
        value = _leaf(cfg, c, tensors, key)
        if value.shape != tuple(leaf.shape):
            raise ConfigError(f"{directory}: {key.removesuffix('.value')} has shape {value.shape}, the model "
                              f"needs {tuple(leaf.shape)}")
        return value.astype(leaf.dtype, copy=False)
    return jax.tree_util.tree_map_with_path(fill, abstract_params)
