"""Write the golden Hugging Face MoE checkpoints and their logits (tests/test_hf_moe.py reads them).

Run once by hand, in an environment with `transformers` (5.x), `torch` (the CPU build is enough),
`safetensors` and `numpy` -- never by the tests, and not in jaxpar's environment:

    python -m venv /somewhere/hfenv && /somewhere/hfenv/bin/pip install torch transformers safetensors numpy
    /somewhere/hfenv/bin/python tests/data/hf_moe/make_golden.py

For each of a tiny random MixtralForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM (float32; and one with
YaRN's RoPE) it writes, under
tests/data/hf_moe/<name>/, the checkpoint as `save_pretrained` lays it out (config.json,
model.safetensors) and golden.json: the prompt, the reference implementation's logits for it
(logits.npy, float32 [len(prompt), vocab]) and, for each of PROMPTS, the greedy continuation of
NEW_TOKENS tokens (argmax of the last position's logits of the full forward, repeated).

The weights are drawn at a larger scale than transformers' initialisation (std 0.02 makes every router
score and every logit nearly equal), so that the top-k expert choices and the greedy argmaxes are far
from ties; the script checks the margins it relies on (MARGIN) and fails if a seed lands near a tie, so
that another float32 implementation cannot pick a different expert or token by rounding alone.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

HERE = pathlib.Path(__file__).resolve().parent
PROMPT = [3, 17, 99, 5, 64, 1, 120, 42, 8, 33, 7, 90]
PROMPTS = [[3, 17, 99, 5], [11, 56, 77, 31, 4, 100, 6]]
NEW_TOKENS = 5
MARGIN = 1e-3   # the smallest gap allowed between the k-th and (k+1)-th router probability and the top two logits
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2,
              router_aux_loss_coef=0.02, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
MODELS = {
    # every layer sparse; top-2 of 4 experts, renormalised
    "mixtral": (MixtralForCausalLM, MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4)),
    # q/k norms, top-2 of 8 experts without renormalisation, layer 0 dense (mlp_only_layers)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=64,
                                                      moe_intermediate_size=16, num_experts=8, norm_topk_prob=False,
                                                      mlp_only_layers=[0], decoder_sparse_step=1)),
    # multi-head latent attention (q and kv latents, interleaved RoPE pairs), layer 0 dense, sigmoid scores with
    # a correction bias (drawn at random below), top-2 of 8 experts from 2 of 4 groups, a shared expert, x2.5
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3}, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        rope_interleave=True)),
}
# the same with YaRN's RoPE (the released DeepSeek-V3's 4K -> 160K extension, here 16 -> 64): frequencies on its
# ramp, cos and sin times mscale(1) / mscale(0.5), the softmax scale times mscale(0.5)^2
MODELS["deepseek_v3_yarn"] = (DeepseekV3ForCausalLM, DeepseekV3Config(**{
    **MODELS["deepseek_v3"][1].to_dict(),
    "rope_parameters": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5)}))

SEEDS = {"mixtral": 0, "qwen3_moe": 1, "deepseek_v3": 3, "deepseek_v3_yarn": 3}   # each the first whose margins clear MARGIN


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Matrices normal(0, 0.15); vectors (the RMSNorm scales) 1 + normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else 0.15 * noise)
        for m in model.modules():   # DeepSeek-V3's balancing bias is a buffer, not a parameter
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn(m.e_score_correction_bias.shape, generator=gen))


def forward(model, tokens: list[int]) -> tuple[np.ndarray, float]:
    """(logits [s, V], the smallest top-k router margin over the tokens and layers)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k, margin = model.config.num_experts_per_tok, np.inf
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for i, logits in enumerate(out.router_logits or ()):
        if biases:   # DeepSeek-V3: the choice is on the biased sigmoid scores (group masking aside)
            probs = (torch.sigmoid(logits.float()) + biases[i]).sort(dim=-1, descending=True).values
        else:
            probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
        margin = min(margin, float((probs[:, k - 1] - probs[:, k]).min()))
    return out.logits[0].numpy().astype(np.float32), margin


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """(NEW_TOKENS greedy tokens, the smallest margin of the routing and of the argmaxes on the way)."""
    seq, margin = list(prompt), np.inf
    for _ in range(NEW_TOKENS):
        logits, routing = forward(model, seq)
        top2 = np.sort(logits[-1])[-2:]
        margin = min(margin, routing, float(top2[1] - top2[0]))
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):], margin


def write(name: str, cls, config, seed: int) -> None:
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomise(model, seed)
    logits, margin = forward(model, PROMPT)
    continuations = []
    for prompt in PROMPTS:
        tokens, m = greedy(model, prompt)
        continuations.append(tokens)
        margin = min(margin, m)
    if margin < MARGIN:
        raise SystemExit(f"{name}: seed {seed} gives a margin of {margin:.2e} < {MARGIN}: pick another seed")
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    np.save(out / "logits.npy", logits)
    (out / "golden.json").write_text(json.dumps(dict(prompt=PROMPT, logits="logits.npy", prompts=PROMPTS,
                                                     continuations=continuations, margin=margin), indent=1) + "\n")
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, margin {margin:.2e}, "
          f"continuations {continuations}")


def main() -> None:
    """Every model, or those named on the command line (make_golden.py deepseek_v3)."""
    chosen = set(sys.argv[1:]) or set(MODELS)
    for name, (cls, config) in MODELS.items():
        if name in chosen:
            write(name, cls, config, SEEDS[name])


if __name__ == "__main__":
    main()
