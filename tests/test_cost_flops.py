"""FLOP counts of tiny configs, counted by hand."""
import pytest

from jaxpar.cost import flops, params
from jaxpar.models.config import ModelConfig, from_preset

# d=64, 4 query heads and 2 kv heads of 16, SwiGLU 128, vocab 256, untied
TINY = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
B, S = 2, 32
T = B * S


def test_tiny_params_by_hand():
    attn = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128   # q, k, v, o, gate/up/down
    assert params.attention_block_params(TINY).sharded == attn == 36864
    assert params.attention_block_params(TINY).replicated == 2 * 64
    assert params.total_params(TINY) == 2 * (attn + 128) + 2 * 256 * 64 + 64


def test_tiny_forward_by_hand():
    proj = 2 * T * 64 * (64 + 2 * 32) + 2 * T * 64 * 64              # q,k,v then o
    core = 2 * (2 * B * S * S * 64)                                   # QK^T and PV over all 4*16 query dims
    mlp = 3 * 2 * T * 64 * 128
    assert flops.attention_block_flops(TINY, B, S).matmul == proj + core + mlp
    assert flops.attention_core_flops(TINY, B, S, causal=True).matmul == core / 2
    assert flops.head_flops(TINY, T).matmul == 2 * T * 64 * 256
    assert flops.embedding_flops(TINY, T).matmul == 0


def test_step_flops_is_6NT_plus_attention():
    """Model FLOPs = 6 * (matmul params) * tokens + 3 * 4*b*s^2*hq / 2 per layer (Kaplan et al. 2020, the
    causal half: MODEL_FLOPS_CONVENTION) whatever the kernel; a dense kernel's hardware FLOPs count the
    full scores, a causal kernel's the half."""
    n_matmul = 2 * 36864 + 256 * 64                                   # layers + LM head (embedding is a gather)
    expected = 6 * n_matmul * T + 2 * 3 * 4 * B * S * S * 64
    f = flops.step_flops(TINY, "none", B, S)
    assert f.hardware == expected == 37_748_736
    assert f.model == expected - 2 * 3 * 2 * B * S * S * 64
    causal = flops.step_flops(TINY, "none", B, S, flops.Kernels(causal=True))
    assert causal.model == causal.hardware == f.model
    layer_fwd = flops.attention_block_flops(TINY, B, S).matmul
    assert flops.step_flops(TINY, "full", B, S).hardware == expected + 2 * layer_fwd
    assert flops.step_flops(TINY, "dots", B, S).hardware == expected
    assert flops.step_flops(TINY, "dots_no_batch", B, S).hardware == expected + 2 * 2 * (2 * B * S * S * 64)
    # XLA drops the rerun of the MLP down projection (its output is dead in the backward)
    down = 2 * T * 128 * 64
    assert flops.step_flops(TINY, "full", B, S, flops.Kernels(rerun_outputs=False)).hardware == expected + 2 * (layer_fwd - down)
    # ring attention reruns QK^T (not PV) of every block in the backward
    qk = 2 * B * S * S * 64
    assert flops.step_flops(TINY, "none", B, S, flops.Kernels(rerun_qk=True)).hardware == expected + 2 * qk
    assert flops.step_flops(TINY, "full", B, S, flops.Kernels(rerun_qk=True)).hardware == expected + 2 * layer_fwd + 2 * qk


def test_gelu_mlp_has_two_matmuls():
    gelu = ModelConfig(d_model=64, mlp_dim=256, mlp_type="gelu")
    assert flops.mlp_flops(gelu, 10).matmul == 2 * 2 * 10 * 64 * 256


def test_mamba2_by_hand():
    m = from_preset("mamba2-tiny")          # d=64, d_inner=128, headdim 16 -> 8 heads, N=16, G=2, Q=16
    d_in_proj, conv_dim, nheads = params.mamba_dims(m)
    assert (d_in_proj, conv_dim, nheads) == (2 * 128 + 2 * 2 * 16 + 8, 128 + 2 * 2 * 16, 8)
    b, s, q, c = 1, 32, 16, 2
    ssd = (2 * b * s * q * 16 * 2          # C B^T within chunks, per group
           + 2 * b * s * q * 128           # applied to x, per head
           + 2 * b * s * 16 * 128          # chunk states
           + 2 * b * (c + 1) ** 2 * 128 * 16  # inter-chunk: c chunk states and the initial one
           + 2 * b * s * 16 * 128)         # state to output
    assert flops.ssd_flops(m, b, s).matmul == ssd
    block = flops.mamba_block_flops(m, b, s).matmul
    assert block == 2 * b * s * 64 * d_in_proj + 2 * b * s * 128 * 64 + ssd
    f = flops.step_flops(m, "dots_no_batch", b, s)
    assert f.recompute == 2 * ssd
    assert f.model == 3 * (2 * block + 2 * b * s * 64 * 256)


def test_hybrid_pattern_counts_each_kind():
    m = from_preset("hybrid-tiny")          # MMMA x 1
    f = flops.step_flops(m, "none", 2, 16)
    by = {name: mm for name, mm, _ in f.by_block}
    attention = by["attention qkvo"] + by["attention scores"] + by["mlp"]
    assert attention == pytest.approx(3 * flops.attention_block_flops(m, 2, 16, causal=True).matmul)
    assert by["mamba mixer"] == pytest.approx(3 * 3 * flops.mamba_block_flops(m, 2, 16).matmul)


def test_flops_by_part_sum_to_the_step_and_match_a_hand_count():
    """The estimate's FLOPs split (attention projections, scores, MLP, Mamba mixer, norms, embedding and
    head) adds up to the step's model FLOPs, and each part equals its hand count for llama-tiny."""
    from jaxpar.cost.flops import step_flops
    from jaxpar.models.config import parse_model
    for name in ("llama3-70b", "hybrid-tiny", "mamba2-tiny"):
        m = parse_model(name)
        f = step_flops(m, "none", 8, 128, flops.Kernels(causal=True))
        assert sum(mm for _, mm, _ in f.by_block) == pytest.approx(f.model, rel=1e-12)
    m = parse_model("llama-tiny")  # d=64, 16 heads x 8, 8 kv heads, f=128, V=256, 2 layers
    b, s = 4, 32
    t = b * s
    parts = {name: (mm, other) for name, mm, other in step_flops(m, "none", b, s, flops.Kernels(causal=False)).by_block}
    assert sum(mm for mm, _ in parts.values()) == step_flops(m, "none", b, s).model
    assert parts["attention qkvo"][0] == 3 * 2 * (2 * t * 64 * (128 + 2 * 64) + 2 * t * 128 * 64)
    assert parts["attention scores"][0] == 3 * 2 * (4 * b * s * s * 128) / 2     # the causal half, any kernel
    assert parts["mlp"][0] == 3 * 2 * (6 * t * 64 * 128)
    assert parts["embedding+head"][0] == 3 * 2 * t * 64 * 256
    assert parts["norms"] == (0.0, 3 * 4 * t * 64 * (2 * 2 + 1))  # 2 per layer + the final one
    assert "mamba mixer" not in parts
