"""Rotary embeddings: Llama 3.1's long-context frequency scaling, and the llama3.1-* presets that use it."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.models.layers import rope, rope_frequencies


def scaled_by_branches(d: int, theta: float, factor: float, low: float, high: float, original: int) -> list[float]:
    """The rule written as its three cases, one frequency at a time (float64): long wavelengths divided
    by the factor, short ones kept, the band between interpolated in original/wavelength."""
    out = []
    for i in range(0, d, 2):
        f = theta ** (-i / d)
        wavelength = 2 * math.pi / f
        if wavelength > original / low:
            out.append(f / factor)
        elif wavelength < original / high:
            out.append(f)
        else:
            t = (original / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return out


def test_llama31_frequencies_follow_the_three_cases():
    m = parse_model("llama3.1-8b")
    got = rope_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    want = scaled_by_branches(m.head_dim, m.rope_theta, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    plain = rope_frequencies(m.head_dim, m.rope_theta)
    assert got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / 8)      # fastest kept, slowest / 8
    assert 0 < np.sum((got < plain) & (got > plain / 8))                           # a band in between


def test_rope_without_scaling_is_unchanged_and_preserves_norms():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 8)), jnp.float32)
    pos = jnp.arange(5, dtype=jnp.int32)[None]
    y = rope(x, pos, 10_000.0)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(y), axis=-1), np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rope(x, pos * 0, 10_000.0)), np.asarray(x), rtol=0, atol=0)


def test_long_context_presets():
    for size, layers in (("8b", 32), ("70b", 80), ("405b", 126)):
        m = parse_model(f"llama3.1-{size}")
        base = parse_model(f"llama3-{size}")
        assert (m.max_seq, m.layers, m.rope_scaling) == (131072, layers, (8.0, 1.0, 4.0, 8192))
        assert (m.d_model, m.heads, m.kv_heads, m.mlp_dim, m.vocab) == (base.d_model, base.heads, base.kv_heads,
                                                                         base.mlp_dim, base.vocab)
    with pytest.raises(ConfigError, match="rope_low_freq_factor < rope_high_freq_factor"):
        parse_model("llama-tiny:rope_scaling_factor=8,rope_low_freq_factor=4,rope_high_freq_factor=1").validate()
