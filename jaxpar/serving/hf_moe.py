"""Hugging Face mixture-of-experts checkpoints: MixtralForCausalLM and Qwen3MoeForCausalLM onto jaxpar's "E" blocks.

Both are the LLaMA layout (jaxpar/serving/hf.py) with the feed-forward of some layers replaced by a
sparse block, stored per expert as `transformers` saves them (and the released checkpoints are laid out):

    Mixtral    layers.i.block_sparse_moe.gate.weight             [E, d]   -> moe.router [d, E] = W^T
               layers.i.block_sparse_moe.experts.e.w1 / w3 / w2  [f, d], [f, d], [d, f]
    Qwen3-MoE  layers.i.mlp.gate.weight                          [E, d]
               layers.i.mlp.experts.e.gate_proj / up_proj / down_proj
    experts stacked over e: w_gate, w_up [E, d, f] = W^T, w_down [E, f, d] = W^T (models/moe.py)

Routing (transformers' MixtralTopKRouter and Qwen3MoeTopKRouter): softmax over all E router logits in
float32, the top k of those probabilities, renormalised to sum 1 always in Mixtral and under
`norm_topk_prob` in Qwen3-MoE: jaxpar's router="softmax" with router_norm (models/moe.py `route`). Neither
has a router bias, shared experts or a z-loss; `router_aux_loss_coef` becomes aux_loss_coef.

Qwen3-MoE also normalises each query and key head with its own RMSNorm over head_dim (q_norm, k_norm,
before RoPE: ModelConfig.qk_norm), and its layer i is sparse when i is not in `mlp_only_layers` and
(i + 1) % decoder_sparse_step == 0; the other layers are dense SwiGLUs of width intermediate_size (the
LLaMA tensor names). jaxpar writes that sequence of kinds as a pattern of "A" (dense) and "E" (sparse)
blocks (models/config.py pattern_of: its shortest repeating unit, or its runs when none repeats), so every
such checkpoint is representable and compiles one body per run.

What jaxpar cannot run is refused with one ConfigError: sliding-window attention, router jitter noise,
attention biases, an activation other than SiLU.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.models.config import pattern_of

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# model_type -> (the sparse block's prefix in a layer, the expert tensors' names for gate, up, down)
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def layer_kinds(c: dict[str, Any], kind: str, layers: int) -> str:
    """'A' (dense) or 'E' (sparse) for each layer, by transformers' rule for the architecture."""
    if kind == "mixtral":
        return "E" * layers
    step, dense = int(c.get("decoder_sparse_step", 1)), set(c.get("mlp_only_layers") or ())
    experts = _experts(c)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    return "".join("E" if experts > 0 and i not in dense and (i + 1) % step == 0 else "A" for i in range(layers))


def _experts(c: dict[str, Any]) -> int:
    """Routed experts: num_local_experts (Mixtral, and Qwen3-MoE as transformers 5 saves it) or num_experts."""
    return int(c.get("num_local_experts", c.get("num_experts", 0)) or 0)


def moe_fields(c: dict[str, Any], kind: str, layers: int, where: str) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral / Qwen3-MoE config.json beyond the LLaMA ones (hf.py)."""
    if c.get("sliding_window") is not None and (kind == "mixtral" or c.get("use_sliding_window")):
        raise ConfigError(f"{where}: sliding_window={c['sliding_window']}: jaxpar's attention is full causal "
                          "attention (no sliding window)")
    if float(c.get("router_jitter_noise", 0.0) or 0.0):
        raise ConfigError(f"{where}: router_jitter_noise={c['router_jitter_noise']}: jaxpar's router has no "
                          "jitter (set it to 0)")
    pattern = pattern_of(layer_kinds(c, kind, layers))
    fields: dict[str, Any] = dict(pattern=pattern, z_loss_coef=0.0, qk_norm=kind == "qwen3_moe",
                                  mlp_dim=int(c["intermediate_size"]))
    if "E" not in pattern:
        return fields
    fields.update(experts=_experts(c), top_k=int(c["num_experts_per_tok"]), router="softmax",
                  router_norm=kind == "mixtral" or bool(c.get("norm_topk_prob", False)),
                  aux_loss_coef=float(c.get("router_aux_loss_coef", 0.0) or 0.0),
                  expert_mlp_dim=int(c["intermediate_size"] if kind == "mixtral" else c["moe_intermediate_size"]))
    return fields


def expert_tensor(get, kind: str, layer: int, experts: int, which: str) -> np.ndarray:
    """One layer's stacked experts in jaxpar's layout: `which` is router [d, E], w_gate / w_up [E, d, f]
    or w_down [E, f, d]; `get(name)` reads a tensor of the checkpoint (raising for a missing one)."""
    block, (gate, up, down) = EXPERT_NAMES[kind]
    prefix = f"model.layers.{layer}.{block}"
    if which == "router":
        return get(f"{prefix}.gate.weight").T
    name = {"w_gate": gate, "w_up": up, "w_down": down}[which]
    return np.stack([get(f"{prefix}.experts.{e}.{name}.weight").T for e in range(experts)])


# ---- the way back (jaxpar/serving/hf_export.py) ---------------------------------------------------------

def export_fields(cfg, kind: str) -> dict[str, Any]:
    """config.json's Mixtral / Qwen3-MoE fields that moe_fields and layer_kinds read back."""
    fields = dict(model_type=kind, num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
                  router_aux_loss_coef=cfg.aux_loss_coef, router_jitter_noise=0.0, sliding_window=None)
    if kind == "mixtral":
        return fields | dict(intermediate_size=cfg.moe_mlp_dim)
    dense = [i for i, k in enumerate(cfg.layer_kinds) if k == "A"]
    return fields | dict(intermediate_size=cfg.mlp_dim, moe_intermediate_size=cfg.moe_mlp_dim,
                         norm_topk_prob=cfg.router_norm, decoder_sparse_step=1, mlp_only_layers=dense,
                         use_sliding_window=False)


def export_experts(cfg, kind: str, one, prefix: str):
    """One sparse layer's router and per-expert tensors ([out, in] each) from jaxpar's stacked experts
    (expert_tensor read backwards); DeepSeek-V3 names them as Qwen3-MoE does."""
    block, names = EXPERT_NAMES["mixtral" if kind == "mixtral" else "qwen3_moe"]
    yield f"{prefix}.{block}.gate.weight", one("['moe']['router']").T
    stacked = [one(f"['moe']['{ours}']") for ours in ("w_gate", "w_up", "w_down")]
    for e in range(cfg.experts):
        for name, w in zip(names, stacked):
            yield f"{prefix}.{block}.experts.{e}.{name}.weight", w[e].T
