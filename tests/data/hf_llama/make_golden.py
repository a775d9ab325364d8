"""Write the golden Hugging Face LLaMA checkpoint and its logits (tests/test_hf_export.py reads them).

Run once by hand, in an environment with `transformers` (5.x), `torch` (the CPU build is enough),
`safetensors` and `numpy` -- never by the tests, and not in jaxpar's environment:

    /somewhere/hfenv/bin/python tests/data/hf_llama/make_golden.py

A tiny random LlamaForCausalLM (float32: GQA 4 query heads over 2 K/V heads, untied head, Llama 3.1's RoPE
scaling) as `save_pretrained` lays it out under tests/data/hf_llama/llama/, and golden.json with the prompt
and transformers' logits for it (logits.npy, float32 [len(prompt), vocab]).
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
PROMPT = [3, 17, 99, 5, 64, 1, 120, 42, 8, 33, 7, 90]
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                                     original_max_position_embeddings=16))


def main() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # matrices normal(0, 0.15); norm scales 1 + normal(0, 0.1)
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else 0.15 * noise)
        logits = model(torch.tensor([PROMPT])).logits[0].numpy().astype(np.float32)
    out = HERE / "llama"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    np.save(out / "logits.npy", logits)
    (out / "golden.json").write_text(json.dumps(dict(prompt=PROMPT, logits="logits.npy"), indent=1) + "\n")
    print(f"llama: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
