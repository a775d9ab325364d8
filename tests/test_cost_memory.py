"""Activation memory against Korthikanti et al. 2022 exactly; state memory under ZeRO 0/1/3 by hand."""
import itertools

import pytest

from jaxpar.cost import memory
from jaxpar.core.strategy import parse_inline
from jaxpar.models.config import ModelConfig

TINY = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
LOCAL = 2 * (36864 / 2 + 128) + (2 * 256 * 64) / 2 + 64   # tensor=2: split weights halve, norms stay


def gpt(h, a):
    return ModelConfig(d_model=h, heads=a, kv_heads=a, head_dim=h // a, mlp_dim=4 * h, mlp_type="gelu")


def test_korthikanti_four_expressions():
    """175B-like layer: s=2048, b=1, h=12288, a=96, t=8 (Korthikanti 2022, table 2), fp16 bytes."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert memory.korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h) == 2_868_903_936
    assert memory.korthikanti_layer_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert memory.korthikanti_layer_bytes(s, b, h, a, t, sp=True) == sbh * (34 / t + 5 * a * s / (h * t))
    assert memory.korthikanti_layer_bytes(s, b, h, a, t, sp=True, selective=True) == 34 * sbh / t


@pytest.mark.parametrize("h,a,s,b", [(12288, 96, 2048, 1), (6144, 64, 2048, 4), (1024, 16, 512, 3)])
def test_inventory_reproduces_korthikanti(h, a, s, b):
    """The tensor-by-tensor inventory, GPT shapes + dropout + fp16, equals the closed forms exactly."""
    inv = memory.attention_inventory(gpt(h, a), s, dropout=True)
    for t, sp, sel in itertools.product((1, 2, 8), (False, True), (False, True)):
        policy = "selective" if sel else "none"
        got = memory.inventory_bytes(inv, 2, t, sp, policy) * s * b
        assert got == pytest.approx(memory.korthikanti_layer_bytes(s, b, h, a, t, sp, sel), rel=1e-12)
    assert memory.inventory_bytes(inv, 2, 8, True, "full") * s * b == 2 * s * b * h / 8  # input only


@pytest.mark.parametrize("zero,opt_div,all_div", [(0, 1, 1), (1, 4, 1), (3, 1, 2)])
def test_state_under_zero(zero, opt_div, all_div):
    st = parse_inline("data=2,fsdp=2,tensor=2").with_options(zero=zero)
    p, g, o = memory.state_bytes(TINY, st)
    assert p == pytest.approx(4 * LOCAL / all_div)
    assert g == pytest.approx(4 * LOCAL / all_div)
    assert o == pytest.approx(8 * LOCAL / all_div / opt_div)


def test_pipeline_splits_layers_not_embeddings():
    st = parse_inline("pipeline=2")
    assert memory.local_params(TINY, st) == 36992 + 2 * 256 * 64 + 64


def test_activations_full_remat_by_hand():
    """Remat full, one device, float32: per layer the input x, plus the larger of one layer's full
    inventory while it is recomputed and the float32 logits (the loss's backward frees them first)."""
    st = parse_inline("data=1").with_options(remat="full")
    tokens = 2 * 32
    kept = 2 * 64 * 4 * tokens
    one_layer = (64 + 64 + 64 + 32 + 32 + 4 * 32 + 64 + 64 + 64 + 4 * 128) * 4 * tokens
    logits = tokens * 256 * 4
    batch = 3 * 4 * tokens   # int32 ids, labels, positions
    assert memory.activation_bytes(TINY, st, 2, 32) == kept + max(one_layer, logits) + batch   # never alive together


def test_pipeline_inflight_microbatches():
    st = parse_inline("pipeline=4").with_options(microbatches=8)
    gpipe = memory.activation_bytes(TINY, st, 16, 32)
    one_f = memory.activation_bytes(TINY, st, 16, 32, memory.Traits(pp_1f1b=True))
    logits = 16 * 32 * 256 * 4 + 3 * 4 * 16 * 32   # float32 logits and the int32 batch
    one_logits = 16 / 8 * 32 * 256 * 4 + 3 * 4 * 16 * 32   # 1F1B: one micro-batch's logits
    assert (gpipe - logits) == pytest.approx(2 * (one_f - one_logits))   # 8 vs min(8, 4) micro-batches


def test_a_stack_whose_fsdp_spans_context_shards_its_state_there_even_with_fsdp_1():
    """torchtitan's fully_shard over dp_shard x cp: fsdp=1 x context=8 holds what fsdp=8 holds (ZeRO-3 by
    hand: every embed-dim weight / 8); Megatron's distributed optimizer shards only its ZeRO stage's state,
    so with zero=0 the same mesh keeps the whole state."""
    cp8, fsdp8 = parse_inline("context=8"), parse_inline("fsdp=8")
    for purpose in ("params", "optimizer"):
        assert memory.local_params(TINY, cp8, purpose, True, True) == memory.local_params(TINY, fsdp8, purpose)
        assert memory.local_params(TINY, cp8, purpose, True, False) == memory.local_params(TINY, parse_inline("data=1"))
    assert memory.local_params(TINY, fsdp8) < memory.local_params(TINY, parse_inline("data=1")) / 7


def test_a_fused_swiglu_and_autodiff_remat_keep_less_by_hand():
    """Per token per layer, float32, no remat: a fused SwiGLU keeps no silu(gate) (mlp_dim 128 elements
    fewer); under the dots policy autodiff keeps no last projection (d_model 64 elements fewer)."""
    st = parse_inline("data=1").with_options(remat="none")
    base = memory.activation_bytes(TINY, st, 2, 32)
    fused = memory.activation_bytes(TINY, st, 2, 32, traits=memory.Traits(fused_mlp=True))
    assert base - fused == TINY.layers * 128 * 4 * 2 * 32
    dots = st.with_options(remat="dots")
    saved = memory.activation_bytes(TINY, dots, 2, 32) - memory.activation_bytes(TINY, dots, 2, 32, traits=memory.Traits(autodiff_remat=True))
    assert saved == TINY.layers * 64 * 4 * 2 * 32
