"""jaxpar's parameters as a checkpoint `transformers` loads: config.json and *.safetensors with their index.

The inverse of jaxpar/serving/hf.py: LlamaForCausalLM (A blocks), MixtralForCausalLM and Qwen3MoeForCausalLM
(E blocks with a softmax router; Qwen3-MoE's q/k norms and dense layers), DeepseekV3ForCausalLM (latent
attention, dense first layers, the biased sigmoid router; its MTP modules are left out, as transformers' model
has none) and Mamba2ForCausalLM (M blocks). Each jaxpar weight goes back to the tensor it was read from (each
architecture module's table read right to left: [in, out] weights transposed to PyTorch's [out, in], heads
merged, experts split, DeepSeek's RoPE columns interleaved again, Mamba-2's z, x, B, C, dt packed into in_proj).
Tensors are produced one at a time from `leaf` (a jaxpar parameter path -> its host array, gathered on demand)
and written in shards of at most SHARD_BYTES as each fills, so the host holds one shard, not the model twice.
The tokenizer a `jaxpar data` directory trained goes beside them (tokenizer.json, tokenizer_config.json). A
model with no hub equivalent (a hybrid unit such as "MMMA", GeLU MLPs, capacity-limited experts) is refused
in one line before anything is written; the directory appears whole or not at all.
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
from jaxpar.serving import hf_deepseek, hf_mamba, hf_moe
from jaxpar.training.tokenizer import Tokenizer

SHARD_BYTES = 2 * 2**30
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
Leaf = Callable[..., np.ndarray]   # (path, unit=None) -> the array, or its slice [unit] of a stacked one


def params_leaf(params) -> Leaf:
    """A parameter tree's path (hf.py's keys) -> that array on the host, gathered when asked; a stacked
    array's one unit is sliced on the devices first, so only that layer crosses to the host."""
    arrays = {jax.tree_util.keystr(path).removesuffix(".value"): a
              for path, a in jax.tree_util.tree_flatten_with_path(params)[0]}

    def leaf(key: str, unit: int | None = None) -> np.ndarray:
        return np.asarray(jax.device_get(arrays[key] if unit is None else arrays[key][unit]))
    return leaf


def architecture(cfg: ModelConfig) -> str:
    """The transformers class the model exports as, or ConfigError naming why there is none."""
    kinds, why = set(cfg.layer_kinds), ""
    if kinds == {"M"}:
        return "Mamba2ForCausalLM"
    if "M" in kinds:
        why = "a hybrid of Mamba-2 and attention blocks has no Hugging Face equivalent here"
    elif cfg.mlp_type != "swiglu":
        why = "GeLU MLPs have no LLaMA-family equivalent"
    elif cfg.mla:
        dense_first = cfg.layer_kinds == "A" * cfg.layer_kinds.count("A") + "E" * cfg.moe_layers
        if dense_first and "E" in kinds and cfg.router == "sigmoid" and cfg.router_bias and not cfg.capacity_factor:
            return "DeepseekV3ForCausalLM"
        why = "latent attention exports as DeepSeek-V3: dense layers first, then MoE with the biased sigmoid router"
    elif "E" in kinds:
        plain = cfg.router == "softmax" and not (cfg.shared_experts or cfg.router_bias or cfg.capacity_factor
                                                  or cfg.n_group > 1 or cfg.routed_scaling_factor != 1)
        if plain and cfg.qk_norm:
            return "Qwen3MoeForCausalLM"
        if plain and kinds == {"E"} and cfg.router_norm:
            return "MixtralForCausalLM"
        why = ("its experts export as Mixtral (every layer MoE, renormalised) or Qwen3-MoE (q/k norms): a softmax "
               "router, dropless, no shared experts, bias, groups or scaling")
    elif not cfg.qk_norm:
        return "LlamaForCausalLM"
    else:
        why = "a dense model with q/k norms (Qwen3) is not written yet"
    raise ConfigError(f"model {cfg.name} (pattern {cfg.pattern!r}): {why}")


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json: the fields jaxpar/serving/hf.py reads back, as transformers 5 writes them."""
    arch = architecture(cfg)
    common = dict(architectures=[arch], hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
                  vocab_size=cfg.vocab, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", dtype=dtype)
    if arch == "Mamba2ForCausalLM":
        return common | hf_mamba.export_fields(cfg)
    llama = dict(model_type="llama", num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                 head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_seq,
                 rms_norm_eps=cfg.norm_eps, attention_bias=False, mlp_bias=False, rope_parameters=rope_parameters(cfg))
    extra = {"MixtralForCausalLM": lambda: hf_moe.export_fields(cfg, "mixtral"),
             "Qwen3MoeForCausalLM": lambda: hf_moe.export_fields(cfg, "qwen3_moe"),
             "DeepseekV3ForCausalLM": lambda: hf_deepseek.export_fields(cfg)}.get(arch, dict)()
    return common | llama | extra


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
    arch = architecture(cfg)
    mamba = arch == "Mamba2ForCausalLM"
    top = "backbone" if mamba else "model"
    yield f"{top}.{'embeddings' if mamba else 'embed_tokens'}.weight", leaf("['embedding']")
    for r, run in enumerate(cfg.runs):
        for j, kind in enumerate(run.unit):
            block = f"['runs'][{r}]['blocks'][{j}]"
            for u, layer in enumerate(cfg.layers_of(r, j)):
                one = layer_slice(leaf, block, u)
                yield from (hf_mamba.export_layer(cfg, one, layer) if mamba
                            else decoder_layer(cfg, arch, one, layer, kind))
    yield f"{top}.{'norm_f' if mamba else 'norm'}.weight", leaf("['final_norm']['scale']")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", leaf("['head']").T


def layer_slice(leaf: Leaf, block: str, unit: int) -> Leaf:
    """A block member's path -> its slice of the stacked array for one unit (one checkpoint layer)."""
    return lambda member: leaf(block + member, unit)


def decoder_layer(cfg: ModelConfig, arch: str, one: Leaf, i: int, kind: str) -> Iterator[tuple[str, np.ndarray]]:
    """One LLaMA-family decoder layer (an A or E block): PyTorch's [out, in] weights from jaxpar's."""
    p = f"model.layers.{i}"
    yield f"{p}.input_layernorm.weight", one("['attn_norm']['scale']")
    yield from hf_deepseek.export_attention(cfg, one, p) if cfg.mla else gqa_attention(cfg, one, p)
    yield f"{p}.post_attention_layernorm.weight", one("['mlp_norm']['scale']")
    if kind == "A":
        for name in ("gate", "up", "down"):
            yield f"{p}.mlp.{name}_proj.weight", one(f"['mlp']['w_{name}']").T
        return
    yield from hf_moe.export_experts(cfg, "mixtral" if arch == "MixtralForCausalLM" else "qwen3_moe", one, p)
    if arch == "DeepseekV3ForCausalLM":
        yield from hf_deepseek.export_moe_extra(cfg, one, p)


def gqa_attention(cfg: ModelConfig, one: Leaf, p: str) -> Iterator[tuple[str, np.ndarray]]:
    """q, k, v, o (heads merged, [out, in]) and Qwen3's q/k norms."""
    d = cfg.d_model
    for name in ("q", "k", "v"):
        yield f"{p}.self_attn.{name}_proj.weight", one(f"['attn']['w{name}']").reshape(d, -1).T
    yield f"{p}.self_attn.o_proj.weight", one("['attn']['wo']").reshape(-1, d).T
    if cfg.qk_norm:
        yield f"{p}.self_attn.q_norm.weight", one("['attn']['q_norm']['scale']")
        yield f"{p}.self_attn.k_norm.weight", one("['attn']['k_norm']['scale']")


def check(cfg: ModelConfig, out_dir: str) -> None:
    """ConfigError, before anything is read or written, if the model has no hub equivalent (`architecture`)
    or `out_dir` exists and is not an empty directory."""
    architecture(cfg)
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; export writes a new one")


def export(cfg: ModelConfig, leaf: Leaf, out_dir: str, dtype: str = "float32",
           tokenizer: Tokenizer | None = None) -> list[str]:
    """Write the checkpoint into `out_dir` (new or empty), built in a sibling temporary directory and renamed
    into place, with `tokenizer` (the one a `jaxpar data` directory trained) beside it; returns the files."""
    check(cfg, out_dir)
    out = pathlib.Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = _write(cfg, leaf, tmp, dtype) + (_write_tokenizer(tokenizer, cfg, tmp) if tokenizer else [])
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


def _write_tokenizer(tok: Tokenizer, cfg: ModelConfig, tmp: pathlib.Path) -> list[str]:
    """tokenizer.json as trained, and tokenizer_config.json naming the fast tokenizer class that reads it and
    its end-of-text token (transformers' AutoTokenizer loads the pair)."""
    tok.save(tmp / "tokenizer.json")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg.max_seq,
                  eos_token=tok.eot_token, bos_token=tok.eot_token)
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]
