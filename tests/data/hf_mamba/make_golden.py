"""Write the golden Hugging Face Mamba-2 checkpoints and their logits (tests/test_hf_mamba.py reads them).

Run once by hand, in an environment with `transformers` (5.x), `torch` (the CPU build is enough),
`safetensors` and `numpy` -- never by the tests, and not in jaxpar's environment:

    python -m venv /somewhere/hfenv && /somewhere/hfenv/bin/pip install torch transformers safetensors numpy
    /somewhere/hfenv/bin/python tests/data/hf_mamba/make_golden.py

For a tiny random Mamba2ForCausalLM (float32, 2 groups of 4 heads, tied embeddings; transformers' torch path,
no CUDA kernels) it writes, under tests/data/hf_mamba/mamba2/, the checkpoint as `save_pretrained` lays it out
and golden.json: the prompt, transformers' logits for it (logits.npy, float32 [len(prompt), vocab]) and, for
each of PROMPTS, the greedy continuation of NEW_TOKENS tokens (argmax of the last position's logits of the
full forward, repeated). Weights are drawn at a larger scale than transformers' initialisation so that the
greedy argmaxes are far from ties (MARGIN, checked).
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
PROMPT = [3, 17, 99, 5, 64, 1, 120, 42, 8, 33, 7, 90]
PROMPTS = [[3, 17, 99, 5], [11, 56, 77, 31, 4, 100, 6]]
NEW_TOKENS = 5
MARGIN = 1e-3   # the smallest gap allowed between the top two logits of a greedy step
CONFIG = Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=2,
                      state_size=16, conv_kernel=4, vocab_size=128, layer_norm_epsilon=1e-5, chunk_size=8,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
SEED = 0


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Matrices and conv kernels normal(0, 0.15); vectors 1 + normal(0, 0.1) (norm scales, dt_bias, A_log, D)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else 0.15 * noise)


def forward(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy().astype(np.float32)


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    seq, margin = list(prompt), np.inf
    for _ in range(NEW_TOKENS):
        logits = forward(model, seq)
        top2 = np.sort(logits[-1])[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):], margin


def main() -> None:
    torch.manual_seed(SEED)
    model = Mamba2ForCausalLM(CONFIG).eval()
    randomise(model, SEED)
    logits = forward(model, PROMPT)
    continuations, margin = [], np.inf
    for prompt in PROMPTS:
        tokens, m = greedy(model, prompt)
        continuations.append(tokens)
        margin = min(margin, m)
    if margin < MARGIN:
        raise SystemExit(f"seed {SEED} gives a margin of {margin:.2e} < {MARGIN}: pick another seed")
    out = HERE / "mamba2"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    np.save(out / "logits.npy", logits)
    (out / "golden.json").write_text(json.dumps(dict(prompt=PROMPT, logits="logits.npy", prompts=PROMPTS,
                                                     continuations=continuations, margin=margin), indent=1) + "\n")
    print(f"mamba2: {sum(p.numel() for p in model.parameters())} parameters, margin {margin:.2e}, "
          f"continuations {continuations}")


if __name__ == "__main__":
    main()
