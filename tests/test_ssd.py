"""SSD: the chunked algorithm equals the token-by-token recurrence (float64 numpy), forward, final
state and gradients, for several chunk sizes and a length that is not a multiple of the chunk."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.ops.ssd import causal_conv, initial_state_output, ssd, ssd_reference

B, L, H, P, G, N = 2, 100, 4, 8, 2, 8


def random_inputs(seed: int = 0, dt_scale: float = 1.0):
    """Host-generated float32 inputs (no JAX kernels to compile): x, dt, A, B, C, h0."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    x = rng.normal(size=(B, L, H, P))
    dt = dt_scale * np.log1p(np.exp(rng.normal(size=(B, L, H)) - 1.0))   # softplus
    A = -np.exp(rng.uniform(-1.0, 1.5, size=H))
    Bm, Cm = rng.normal(size=(B, L, G, N)), rng.normal(size=(B, L, G, N))
    h0 = rng.normal(size=(B, H, P, N))
    return tuple(f32(t) for t in (x, dt, A, Bm, Cm, h0))


def numpy_recurrence(x, dt, A, Bm, Cm, h0):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, in float64."""
    x, dt, A, Bm, Cm, h = (np.asarray(t, np.float64) for t in (x, dt, A, Bm, Cm, h0))
    rep = H // G
    Bh, Ch = np.repeat(Bm, rep, axis=2), np.repeat(Cm, rep, axis=2)
    ys = []
    for t in range(x.shape[1]):
        h = np.exp(dt[:, t] * A)[..., None, None] * h + np.einsum("bhp,bhn->bhpn", dt[:, t, :, None] * x[:, t], Bh[:, t])
        ys.append(np.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    return np.stack(ys, axis=1), h


@functools.cache
def chunked(chunk: int):
    return jax.jit(lambda x, dt, A, Bm, Cm, h0: ssd(x, dt, A, Bm, Cm, chunk, h0))


def assert_close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert np.all(np.isfinite(actual))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)))


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_equals_recurrence(chunk):
    args = random_inputs()
    y_ref, h_ref = numpy_recurrence(*args)
    y, h = chunked(chunk)(*args)
    assert L % chunk  # 100 is a multiple of none of them: the padded tail is exercised
    assert y.shape == (B, L, H, P) and h.shape == (B, H, P, N)
    assert_close(y, y_ref)
    assert_close(h, h_ref)


def test_scan_reference_equals_recurrence():
    args = random_inputs(1)
    y_ref, h_ref = numpy_recurrence(*args)
    y, h = jax.jit(ssd_reference)(*args)
    assert_close(y, y_ref)
    assert_close(h, h_ref)


def _loss(fn, w, *args):
    y, h = fn(*args)
    return jnp.sum(jnp.sin(y) * w) + jnp.sum(h ** 2)


chunked_grad = jax.jit(jax.grad(functools.partial(_loss, lambda *a: ssd(*a[:5], 16, a[5])), argnums=range(1, 7)))
reference_grad = jax.jit(jax.grad(functools.partial(_loss, ssd_reference), argnums=range(1, 7)))
COTANGENT = jnp.asarray(np.random.default_rng(9).normal(size=(B, L, H, P)), jnp.float32)


def test_gradients_equal_autodiff_through_recurrence():
    args = random_inputs(2)
    for g, e in zip(chunked_grad(COTANGENT, *args), reference_grad(COTANGENT, *args)):
        assert_close(g, e, rtol=2e-5)


def test_extreme_decay_keeps_gradients_finite():
    """dt*A down to about -1e4: masked segment sums must give exp(-inf)=0, never inf*0 = NaN."""
    args = random_inputs(3, dt_scale=1e3)
    y, h = chunked(16)(*args)
    assert np.all(np.isfinite(np.asarray(y))) and np.all(np.isfinite(np.asarray(h)))
    for g in chunked_grad(COTANGENT, *args):
        assert np.all(np.isfinite(np.asarray(g)))


def test_initial_state_enters_linearly():
    """ssd(..., h0) = ssd(...) + initial_state_output(C, dt, A, h0): what context parallelism uses."""
    x, dt, A, Bm, Cm, h0 = random_inputs(4)
    y0, _ = chunked(16)(x, dt, A, Bm, Cm, jnp.zeros_like(h0))
    y, _ = chunked(16)(x, dt, A, Bm, Cm, h0)
    assert_close(y0 + jax.jit(initial_state_output)(Cm, dt, A, h0), y)


def test_causal_conv_with_halo():
    rng = np.random.default_rng(0)
    u, w, bias = rng.normal(size=(2, 10, 3, 2)), rng.normal(size=(4, 3, 2)), rng.normal(size=(3, 2))
    full = np.concatenate([np.zeros((2, 3, 3, 2)), u], axis=1)
    expect = bias + sum(w[k] * full[:, k:k + 10] for k in range(4))
    out = causal_conv(jnp.asarray(u), jnp.asarray(w), jnp.asarray(bias))
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-5)
    # the second half computed with the first half's tail as halo equals the whole
    half = causal_conv(jnp.asarray(u[:, 5:]), jnp.asarray(w), jnp.asarray(bias), halo=jnp.asarray(u[:, 2:5]))
    np.testing.assert_allclose(np.asarray(half), expect[:, 5:], rtol=1e-5, atol=1e-5)
