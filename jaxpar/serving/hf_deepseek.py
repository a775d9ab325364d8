"""Hugging Face DeepSeek-V3 checkpoints (DeepseekV3ForCausalLM, model_type deepseek_v3) onto jaxpar's model.

The LLaMA layout (jaxpar/serving/hf.py) with latent attention (models/mla.py) in every layer, dense SwiGLUs in
the first `first_k_dense_replace` layers and the Qwen3-MoE expert names (hf_moe.py) in the others, plus:

    self_attn.q_a_proj / q_a_layernorm / q_b_proj   [ql, d], [ql], [h*qk, ql] -> wq_a, q_norm, wq_b [ql, h, qk]
      (or self_attn.q_proj [h*qk, d] -> wq when q_lora_rank is null)
    self_attn.kv_a_proj_with_mqa                    [c + r, d]   -> wkv_a [d, c] and wk_rope [d, r]
    self_attn.kv_a_layernorm                        [c]          -> kv_norm
    self_attn.kv_b_proj                             [h*(nope+v), c] -> wk_b [c, h, nope], wv_b [c, h, v]
    self_attn.o_proj                                [d, h*v]     -> wo [h, v, d]
    mlp.gate.e_score_correction_bias                [E]          -> moe.router_bias (the choice only)
    mlp.shared_experts.gate_proj / up_proj / down_proj            -> moe.shared's w_gate, w_up, w_down

RoPE: with rope_interleave (the default) the checkpoint's RoPE dims are pairs (x0, x1), (x2, x3), ..., each
rotated by one frequency (transformers' apply_rotary_pos_emb_interleave); jaxpar rotates halves, so the
query's and the key's RoPE columns are loaded de-interleaved, evens then odds (`DEINTERLEAVE`): every q . k
is unchanged. Routing: sigmoid scores, the choice on them plus the bias within the topk_group best of
n_group groups, the chosen scores renormalised (norm_topk_prob) and times routed_scaling_factor (models/moe.py
`route`, as transformers' DeepseekV3TopkRouter). YaRN's RoPE scaling is read as for any LLaMA-layout model
(hf.yarn_fields; its mscale on the softmax scale is latent attention's). Refused in one line: a
quantization_config (block-FP8 weights: dequantize them to bf16 or fp32 first). Multi-token prediction
layers (model.layers.{num_hidden_layers}.*, in the released checkpoints) are not loaded, and
`unloaded_note` says so.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.errors import ConfigError

ARCHITECTURE = "DeepseekV3ForCausalLM"
KIND = "deepseek_v3"


def deepseek_fields(c: dict[str, Any], layers: int, where: str) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V3 config.json beyond the LLaMA ones (hf.py read_config)."""
    if c.get("quantization_config"):
        q = c["quantization_config"]
        raise ConfigError(f"{where}: quantization_config {q.get('quant_method', q)} (weight_block_size "
                          f"{q.get('weight_block_size')}): jaxpar reads bf16 or fp32 weights; dequantize the checkpoint first")
    if c.get("scoring_func", "sigmoid") != "sigmoid" or c.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"{where}: scoring_func={c.get('scoring_func')!r}, topk_method={c.get('topk_method')!r}: "
                          "jaxpar routes DeepSeek-V3's way (sigmoid scores, noaux_tc group-limited top-k)")
    nope, rope = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
    dense = min(int(c.get("first_k_dense_replace") or 0), layers)
    groups = int(c.get("n_group") or 1)
    return dict(kv_heads=int(c["num_attention_heads"]), head_dim=nope + rope, qk_rope_head_dim=rope,
                v_head_dim=int(c["v_head_dim"]), q_lora_rank=int(c.get("q_lora_rank") or 0),
                kv_lora_rank=int(c["kv_lora_rank"]), mlp_dim=int(c["intermediate_size"]),
                pattern=_pattern(dense, layers), experts=int(c["n_routed_experts"]),
                top_k=int(c["num_experts_per_tok"]), shared_experts=int(c.get("n_shared_experts") or 0),
                expert_mlp_dim=int(c["moe_intermediate_size"]), router="sigmoid",
                router_norm=bool(c.get("norm_topk_prob", True)),
                routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)), n_group=groups,
                topk_group=int(c.get("topk_group") or 1) if groups > 1 else 1, router_bias=True,
                aux_loss_coef=float(c.get("aux_loss_alpha", c.get("router_aux_loss_coef", 0.0)) or 0.0),
                z_loss_coef=0.0)


def _pattern(dense: int, layers: int) -> str:
    """'A' for the first `dense` layers, 'E' for the rest, as a block sequence ("3*A+58*E")."""
    runs = [(dense, "A"), (layers - dense, "E")]
    return "+".join(f"{n}*{u}" if n > 1 else u for n, u in runs if n)


def deinterleave(rope: int) -> np.ndarray:
    """The RoPE columns' order for rotate-half: the even entries of each interleaved pair, then the odd ones."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def attention_tensor(get, cfg, c: dict[str, Any], layer: int, name: str) -> np.ndarray:
    """One latent attention weight of layer `layer` in jaxpar's layout (models/mla.py); `get(name)` reads a
    tensor of the checkpoint."""
    h, hd, nope, r, kv = cfg.heads, cfg.head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    at = f"model.layers.{layer}.self_attn"
    order = deinterleave(r) if c.get("rope_interleave", True) else np.arange(r)
    head_order = np.concatenate([np.arange(nope), nope + order])          # one q head's columns
    if name in ("wq", "wq_b"):
        w = get(f"{at}.{'q_proj' if name == 'wq' else 'q_b_proj'}.weight").T
        return w.reshape(w.shape[0], h, hd)[..., head_order]
    if name in ("wkv_a", "wk_rope"):
        w = get(f"{at}.kv_a_proj_with_mqa.weight").T
        return w[:, :kv] if name == "wkv_a" else w[:, kv:][:, order]
    if name in ("wk_b", "wv_b"):
        w = get(f"{at}.kv_b_proj.weight").T.reshape(kv, h, nope + cfg.v_head_dim)
        return w[..., :nope] if name == "wk_b" else w[..., nope:]
    return {"wq_a": lambda: get(f"{at}.q_a_proj.weight").T,
            "q_norm": lambda: get(f"{at}.q_a_layernorm.weight"),
            "kv_norm": lambda: get(f"{at}.kv_a_layernorm.weight"),
            "wo": lambda: get(f"{at}.o_proj.weight").T.reshape(h, cfg.v_head_dim, cfg.d_model)}[name]()


def moe_tensor(get, layer: int, member: tuple[str, ...]) -> np.ndarray:
    """The router's bias or a shared expert's weight of layer `layer` (the routed ones: hf_moe.expert_tensor)."""
    prefix = f"model.layers.{layer}.mlp"
    if member == ("router_bias",):
        return get(f"{prefix}.gate.e_score_correction_bias")
    name = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[member[1]]
    return get(f"{prefix}.shared_experts.{name}.weight").T


def unloaded_note(tensors: dict, layers: int) -> str:
    """A line naming the checkpoint's layers past num_hidden_layers (DeepSeek-V3's multi-token prediction
    modules), which jaxpar does not load (generation does not use them); "" when there are none."""
    extra = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= layers})
    if not extra:
        return ""
    return (f"note: the checkpoint's layers {', '.join(map(str, extra))} (multi-token prediction modules, "
            f"{sum(1 for n in tensors if n.startswith(tuple(f'model.layers.{i}.' for i in extra)))} tensors) are "
            "not loaded: generation does not use them, and jaxpar reads no checkpoint into its own MTP modules "
            "(mtp_depth), as transformers' DeepseekV3ForCausalLM reads none")


# ---- the way back (jaxpar/serving/hf_export.py) ---------------------------------------------------------

def export_fields(cfg) -> dict[str, Any]:
    """config.json's DeepSeek-V3 fields that deepseek_fields reads back (transformers 5's names)."""
    dense = cfg.layer_kinds.count("A")
    return dict(model_type=KIND, num_key_value_heads=cfg.heads, head_dim=cfg.qk_rope_head_dim,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                intermediate_size=cfg.mlp_dim, first_k_dense_replace=dense, n_routed_experts=cfg.experts,
                num_experts_per_tok=cfg.top_k, n_shared_experts=cfg.shared_experts or None,
                moe_intermediate_size=cfg.moe_mlp_dim, norm_topk_prob=cfg.router_norm,
                routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group,
                router_aux_loss_coef=cfg.aux_loss_coef, rope_interleave=True, num_nextn_predict_layers=0)


def export_attention(cfg, one, prefix: str):
    """One layer's latent attention tensors from jaxpar's (models/mla.py): attention_tensor read backwards, the
    RoPE columns interleaved again."""
    h, nope, r, v = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    back = np.argsort(deinterleave(r))
    head_back = np.concatenate([np.arange(nope), nope + back])
    at = f"{prefix}.self_attn"
    if cfg.q_lora_rank:
        yield f"{at}.q_a_proj.weight", one("['attn']['wq_a']").T
        yield f"{at}.q_a_layernorm.weight", one("['attn']['q_norm']['scale']")
        wq_b = one("['attn']['wq_b']")
        yield f"{at}.q_b_proj.weight", wq_b[..., head_back].reshape(wq_b.shape[0], -1).T
    else:
        wq = one("['attn']['wq']")
        yield f"{at}.q_proj.weight", wq[..., head_back].reshape(wq.shape[0], -1).T
    wkv = np.concatenate([one("['attn']['wkv_a']"), one("['attn']['wk_rope']")[:, back]], axis=1)
    yield f"{at}.kv_a_proj_with_mqa.weight", wkv.T
    yield f"{at}.kv_a_layernorm.weight", one("['attn']['kv_norm']['scale']")
    kv_b = np.concatenate([one("['attn']['wk_b']"), one("['attn']['wv_b']")], axis=-1)
    yield f"{at}.kv_b_proj.weight", kv_b.reshape(cfg.kv_lora_rank, h * (nope + v)).T
    yield f"{at}.o_proj.weight", one("['attn']['wo']").reshape(h * v, cfg.d_model).T


def export_moe_extra(cfg, one, prefix: str):
    """The balancing bias and the shared experts of one MoE layer (moe_tensor read backwards)."""
    yield f"{prefix}.mlp.gate.e_score_correction_bias", one("['moe']['router_bias']")
    if cfg.shared_experts:
        for name, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            yield f"{prefix}.mlp.shared_experts.{name}.weight", one(f"['moe']['shared']['{ours}']").T
