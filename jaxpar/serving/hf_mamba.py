"""Hugging Face Mamba-2 checkpoints (Mamba2ForCausalLM, model_type mamba2) onto jaxpar's Mamba-2 blocks.

transformers' Mamba2Mixer packs what models/mamba.py keeps as separate weights (the same maths):

    backbone.layers.i.mixer.in_proj.weight   [2I + 2Gn + H, d]  -> rows z | x | B | C | dt: w_z, w_x [d, H, P],
                                                                   w_B, w_C [d, G, n], w_dt [d, H] (= W^T)
    backbone.layers.i.mixer.conv1d.weight    [I + 2Gn, 1, K]    -> channels x | B | C: conv_x [K, H, P], conv_B,
    backbone.layers.i.mixer.conv1d.bias      [I + 2Gn]             conv_C [K, G, n] and their biases (PyTorch's
                                                                   Conv1d with K - 1 zeros in front is
                                                                   jaxpar's causal_conv, tap for tap)
    ...mixer.dt_bias, A_log, D               [H]                -> dt_bias, A_log, D
    ...mixer.norm.weight                     [I]                -> gate_norm [H, P] (RMSNorm(y * silu(z)) per
                                                                   group of I / G channels, as jaxpar's)
    ...mixer.out_proj.weight                 [d, I]             -> w_out [H, P, d]
    backbone.layers.i.norm.weight            [d]                -> the block's pre-norm
    backbone.embeddings.weight, norm_f       [V, d], [d]        -> embedding, final_norm (lm_head: tied or W^T)

with I = H x P (num_heads x head_dim = expand x hidden_size), G = n_groups, n = state_size, heads of a group
contiguous as in jaxpar. Refused in one line: in/out projection biases (use_bias), another activation, a
time_step_limit other than (0, inf) (jaxpar does not clamp dt). residual_in_fp32 is jaxpar's float32 run.
mamba_ssm's own config (d_model, n_layer, ssm_cfg) is refused, naming transformers' conversion.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig

ARCHITECTURE = "Mamba2ForCausalLM"
KIND = "mamba2"
WHOLE = {"['embedding']": "backbone.embeddings.weight", "['final_norm']['scale']": "backbone.norm_f.weight"}


def is_mamba_ssm(c: dict[str, Any]) -> bool:
    """Whether config.json is mamba_ssm's own (MambaConfig: d_model, n_layer, ssm_cfg), not transformers'."""
    return "d_model" in c and "n_layer" in c and "model_type" not in c


def mamba_fields(c: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig of a Mamba2ForCausalLM config.json (pattern "M"), its unsupported options refused."""
    limit = [_number(v) for v in c.get("time_step_limit", (0.0, math.inf))]
    for bad, why in ((c.get("use_bias"), "use_bias=true: in_proj and out_proj with biases"),
                     (c.get("hidden_act", "silu") != "silu", f"hidden_act={c.get('hidden_act')!r}: jaxpar's is silu"),
                     (limit != [0.0, math.inf], f"time_step_limit={limit}: jaxpar does not clamp dt")):
        if bad:
            raise ConfigError(f"{where}: {why}")
    d, expand, heads, head_dim = int(c["hidden_size"]), int(c.get("expand", 2)), int(c["num_heads"]), int(c["head_dim"])
    if d * expand != heads * head_dim:
        raise ConfigError(f"{where}: hidden_size x expand = {d * expand} != num_heads x head_dim = {heads * head_dim}")
    return dict(pattern="M", layers=int(c["num_hidden_layers"]), d_model=d, vocab=int(c["vocab_size"]),
                max_seq=int(c.get("max_position_embeddings") or 131072),
                norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), expand=expand, ssm_head_dim=head_dim,
                ngroups=int(c.get("n_groups", 1)), d_state=int(c["state_size"]), d_conv=int(c.get("conv_kernel", 4)),
                chunk=int(c.get("chunk_size") or 256))


def _number(v) -> float:
    """A float of config.json, transformers 5's {"__float__": "Infinity"} included."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def block_tensor(get: Callable[[str], np.ndarray], cfg: ModelConfig, c: dict[str, Any], layer: int,
                 member: tuple[str, ...]) -> np.ndarray:
    """jaxpar's Mamba-2 block parameter `member` of checkpoint layer `layer` (`c`: its config.json)."""
    prefix = f"backbone.layers.{layer}"
    if member == ("norm", "scale"):
        return get(f"{prefix}.norm.weight")
    name = member[0]
    h, p, g, n, k = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ngroups, cfg.d_state, cfg.d_conv
    inner, gn = h * p, g * n
    if name in ("dt_bias", "A_log", "D"):
        return get(f"{prefix}.mixer.{name}")
    if name == "gate_norm":
        return get(f"{prefix}.mixer.norm.weight").reshape(h, p)
    if name == "w_out":
        return get(f"{prefix}.mixer.out_proj.weight").T.reshape(h, p, cfg.d_model)
    if name.startswith("w_"):   # in_proj rows z | x | B | C | dt
        rows = dict(w_z=(0, inner, (h, p)), w_x=(inner, inner, (h, p)), w_B=(2 * inner, gn, (g, n)),
                    w_C=(2 * inner + gn, gn, (g, n)), w_dt=(2 * inner + 2 * gn, h, (h,)))[name]
        start, size, shape = rows
        w = _packed(get, f"{prefix}.mixer.in_proj.weight", 2 * inner + 2 * gn + h)
        return w[start:start + size].T.reshape(cfg.d_model, *shape)
    channels = dict(x=(0, inner, (h, p)), B=(inner, gn, (g, n)), C=(inner + gn, gn, (g, n)))[name.split("_")[1]]
    start, size, shape = channels
    if name.endswith("_bias"):
        bias = get(f"{prefix}.mixer.conv1d.bias") if c.get("use_conv_bias", True) else np.zeros(inner + 2 * gn)
        return bias[start:start + size].reshape(shape)
    return _packed(get, f"{prefix}.mixer.conv1d.weight", inner + 2 * gn)[start:start + size, 0].T.reshape(k, *shape)


def _packed(get, name: str, rows: int) -> np.ndarray:
    """A packed tensor whose row count config.json's sizes fix (a mismatch would slice it silently wrong)."""
    w = get(name)
    if w.shape[0] != rows:
        raise ConfigError(f"{name} has {w.shape[0]} rows; config.json's num_heads, head_dim, n_groups and "
                          f"state_size give {rows}")
    return w


# ---- the way back (jaxpar/serving/hf_export.py) ---------------------------------------------------------

def export_fields(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's fields that mamba_fields reads back (transformers 5's names; time_step_limit left at its
    default, (0, inf): jaxpar does not clamp dt)."""
    return dict(model_type=KIND, num_heads=cfg.ssm_heads, head_dim=cfg.ssm_head_dim, expand=cfg.expand,
                n_groups=cfg.ngroups, state_size=cfg.d_state, conv_kernel=cfg.d_conv, layer_norm_epsilon=cfg.norm_eps,
                chunk_size=cfg.chunk, use_bias=False, use_conv_bias=True, residual_in_fp32=True)


def export_layer(cfg: ModelConfig, one, i: int):
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
