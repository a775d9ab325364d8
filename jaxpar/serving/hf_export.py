"""jaxpar's parameters as a checkpoint `transformers` loads: config.json and *.safetensors with their index.

The inverse of jaxpar/serving/hf.py for the architectures written so far: LlamaForCausalLM (pattern "A",
SwiGLU, GQA heads) and Mamba2ForCausalLM (pattern "M"). Each jaxpar weight goes back to the tensor it was read
from (hf.py's table, read right to left: [in, out] weights transposed to PyTorch's [out, in], heads merged,
Mamba-2's z, x, B, C, dt packed into in_proj and x, B, C into conv1d). Tensors are produced one at a time
from `leaf` (a jaxpar parameter path -> its host array, gathered on demand) and written in shards of at most
SHARD_BYTES, so the host holds one shard, not the model twice. A model with no hub equivalent (a hybrid unit
such as "MMMA", GeLU MLPs) or one not written yet (mixtures of experts, latent attention, Qwen3's q/k norms)
is refused in one line before anything is written; the directory appears whole or not at all.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterator

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig, Yarn

SHARD_BYTES = 2 * 2**30
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
Leaf = Callable[[str], np.ndarray]


def params_leaf(params) -> Leaf:
    """A parameter tree's path (hf.py's keys) -> that array on the host, gathered when asked."""
    arrays = {jax.tree_util.keystr(path).removesuffix(".value"): a
              for path, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    return lambda key: np.asarray(jax.device_get(arrays[key]))


def architecture(cfg: ModelConfig) -> str:
    """The transformers class the model exports as, or ConfigError naming why there is none."""
    kinds = set(cfg.layer_kinds)
    if kinds == {"M"}:
        return "Mamba2ForCausalLM"
    if kinds == {"A"} and not cfg.mla and not cfg.qk_norm and cfg.mlp_type == "swiglu" and not cfg.mtp_depth:
        return "LlamaForCausalLM"
    why = ("a hybrid of Mamba-2 and attention blocks has no Hugging Face equivalent" if "M" in kinds
           else "export of mixtures of experts, latent attention, q/k norms and MTP modules is not written yet"
           if kinds & {"E"} or cfg.mla or cfg.qk_norm or cfg.mtp_depth else "GeLU MLPs have no LLaMA equivalent")
    raise ConfigError(f"model {cfg.name} (pattern {cfg.pattern!r}): {why}; export writes LlamaForCausalLM "
                      "(A blocks, SwiGLU) and Mamba2ForCausalLM (M blocks)")


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json: the fields jaxpar/serving/hf.py reads back, as transformers 5 writes them."""
    common = dict(architectures=[architecture(cfg)], hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
                  vocab_size=cfg.vocab, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", dtype=dtype)
    if common["architectures"] == ["Mamba2ForCausalLM"]:
        return common | dict(model_type="mamba2", num_heads=cfg.ssm_heads, head_dim=cfg.ssm_head_dim,
                             expand=cfg.expand, n_groups=cfg.ngroups, state_size=cfg.d_state, conv_kernel=cfg.d_conv,
                             layer_norm_epsilon=cfg.norm_eps, chunk_size=cfg.chunk, use_bias=False,
                             use_conv_bias=True, residual_in_fp32=True)
    return common | dict(model_type="llama", num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                         head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_seq,
                         rms_norm_eps=cfg.norm_eps, attention_bias=False, mlp_bias=False,
                         rope_parameters=rope_parameters(cfg))


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters: the base, and Llama 3.1's or YaRN's scaling."""
    s, theta = cfg.rope_scaling, cfg.rope_theta
    if s is None:
        return dict(rope_type="default", rope_theta=theta)
    if isinstance(s, Yarn):
        return dict(rope_type="yarn", rope_theta=theta, factor=s.factor, original_max_position_embeddings=s.original,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=cfg.rope_mscale,
                    mscale_all_dim=cfg.rope_mscale_all_dim)
    factor, low, high, original = s
    return dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=original)


def hf_tensors(cfg: ModelConfig, leaf: Leaf) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every checkpoint tensor, layer by layer."""
    mamba = architecture(cfg) == "Mamba2ForCausalLM"
    top = "backbone" if mamba else "model"
    yield f"{top}.{'embeddings' if mamba else 'embed_tokens'}.weight", leaf("['embedding']")
    for r, run in enumerate(cfg.runs):
        for j in range(len(run.unit)):
            block = f"['runs'][{r}]['blocks'][{j}]"
            for u, layer in enumerate(cfg.layers_of(r, j)):
                one = layer_slice(leaf, block, u)
                yield from (mamba_layer(cfg, one, layer) if mamba else llama_layer(cfg, one, layer))
    yield f"{top}.{'norm_f' if mamba else 'norm'}.weight", leaf("['final_norm']['scale']")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", leaf("['head']").T


def layer_slice(leaf: Leaf, block: str, unit: int) -> Leaf:
    """A block member's path -> its slice of the stacked array for one unit (one checkpoint layer)."""
    return lambda member: leaf(block + member)[unit]


def llama_layer(cfg: ModelConfig, one: Leaf, i: int) -> Iterator[tuple[str, np.ndarray]]:
    """One LLaMA decoder layer: PyTorch's [out, in] weights from jaxpar's [in, (heads, head_dim)]."""
    p, d = f"model.layers.{i}", cfg.d_model
    yield f"{p}.input_layernorm.weight", one("['attn_norm']['scale']")
    for name in ("q", "k", "v"):
        yield f"{p}.self_attn.{name}_proj.weight", one(f"['attn']['w{name}']").reshape(d, -1).T
    yield f"{p}.self_attn.o_proj.weight", one("['attn']['wo']").reshape(-1, d).T
    yield f"{p}.post_attention_layernorm.weight", one("['mlp_norm']['scale']")
    for name in ("gate", "up", "down"):
        yield f"{p}.mlp.{name}_proj.weight", one(f"['mlp']['w_{name}']").T


def mamba_layer(cfg: ModelConfig, one: Leaf, i: int) -> Iterator[tuple[str, np.ndarray]]:
    """One Mamba-2 layer: in_proj rows z | x | B | C | dt and conv1d channels x | B | C packed again."""
    p, d, k = f"backbone.layers.{i}", cfg.d_model, cfg.d_conv
    yield f"{p}.norm.weight", one("['norm']['scale']")
    w = [one(f"['{n}']").reshape(d, -1) for n in ("w_z", "w_x", "w_B", "w_C", "w_dt")]
    yield f"{p}.mixer.in_proj.weight", np.concatenate(w, axis=1).T
    conv = [one(f"['conv_{n}']").reshape(k, -1) for n in "xBC"]
    yield f"{p}.mixer.conv1d.weight", np.concatenate(conv, axis=1).T[:, None, :]
    yield f"{p}.mixer.conv1d.bias", np.concatenate([one(f"['conv_{n}_bias']").reshape(-1) for n in "xBC"])
    for name in ("dt_bias", "A_log", "D"):
        yield f"{p}.mixer.{name}", one(f"['{name}']")
    yield f"{p}.mixer.norm.weight", one("['gate_norm']").reshape(-1)
    yield f"{p}.mixer.out_proj.weight", one("['w_out']").reshape(-1, d).T


def export(cfg: ModelConfig, leaf: Leaf, out_dir: str, dtype: str = "float32") -> list[str]:
    """Write the checkpoint into `out_dir` (new or empty), built in a sibling temporary directory and renamed
    into place; returns the files written."""
    hf_config(cfg, dtype)   # refuses before anything is written
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; export writes a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = _write(cfg, leaf, tmp, dtype)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def _write(cfg: ModelConfig, leaf: Leaf, tmp: pathlib.Path, dtype: str) -> list[str]:
    """The shards (each written as soon as it is full), the index (weight_map and total_size) and config.json,
    into `tmp`."""
    parts, shard, size, total, weight_map = [], {}, 0, 0, {}

    def flush():
        parts.append(tmp / f"part-{len(parts)}")
        save_file(shard, str(parts[-1]), metadata={"format": "pt"})
        weight_map.update((n, len(parts) - 1) for n in shard)
    for name, array in hf_tensors(cfg, leaf):
        array = np.ascontiguousarray(np.asarray(array, np.float32).astype(DTYPES[dtype]))
        if shard and size + array.nbytes > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name], size, total = array, size + array.nbytes, total + array.nbytes
    flush()
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for part, name in zip(parts, names):
        part.rename(tmp / name)
    index = dict(metadata=dict(total_size=total), weight_map={n: names[i] for n, i in weight_map.items()})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return names + ["model.safetensors.index.json", "config.json"]
