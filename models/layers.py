"""Building blocks shared by the model families: annotated parameters, RMSNorm, RoPE, MLP.

Every parameter is created by `param`, which records its logical axis names as flax metadata
(`out_sharding`). Nothing here knows about meshes: `jaxpar.core.sharding` turns names into shardings.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig, Yarn
from jaxpar.models.run import RunConfig
from jaxpar.xla_workarounds import gathered


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float | None = None,
          value: float | None = None) -> nnx.Param:
    """A float32 parameter, normal(0, std) or constant `value`, annotated with logical `names`."""
    assert len(shape) == len(names), (shape, names)
    if value is not None:
        x = jnp.full(shape, value, jnp.float32)
    else:
        x = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(x, out_sharding=names, eager_sharding=False)


def dtype_of(run: RunConfig):
    return jnp.dtype(run.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, name: str = "act_embed"):
        self.names = ("embed" if name == "act_embed" else name,)
        self.scale = param(rngs, (dim,), self.names, value=1.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x / rms(x) * scale, in float32. The scale is gathered once for the product and its gradient
        (`jaxpar.xla_workarounds.gathered`); without remat the gathered scale, one vector, is kept for
        the backward pass."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * gathered(self.scale[...], self.names, jnp.float32)).astype(x.dtype)


def rope_frequencies(d: int, theta: float, scaling: tuple[float, float, float, int] | Yarn | None = None) -> np.ndarray:
    """The d/2 rotation frequencies theta^(-2i/d), float64 host constants. `scaling` = (factor, low,
    high, original context): Llama 3.1's long-context rule (Dubey et al. 2024, section 3.4; the
    `llama3` rope_scaling of its released config): a frequency whose wavelength 2*pi/f exceeds
    original/low is divided by `factor`, one whose wavelength is under original/high is kept, and
    those between are interpolated linearly in original/wavelength between the two. `Yarn`: YaRN's
    ramp (`yarn_frequencies`)."""
    freqs = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if scaling is None:
        return freqs
    if isinstance(scaling, Yarn):
        return yarn_frequencies(freqs, d, theta, scaling)
    factor, low, high, original = scaling
    ratio = original * freqs / (2 * np.pi)                      # original context / wavelength
    keep = np.clip((ratio - low) / (high - low), 0.0, 1.0)     # 1: high frequency, 0: low frequency
    return keep * freqs + (1.0 - keep) * freqs / factor


def yarn_frequencies(freqs: np.ndarray, d: int, theta: float, y: Yarn) -> np.ndarray:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, section 3.2, eq. 17-18, with DeepSeek's and
    transformers' rounding of the correction range outward): the dimension that turns r times over the
    original context is d ln(original / (2 pi r)) / (2 ln theta); dimensions below that of beta_fast turns
    keep their frequency, those above that of beta_slow are divided by the factor, a linear ramp between."""
    def turning(r: float) -> float:
        return d * math.log(y.original / (r * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(turning(y.beta_fast)), 0), min(math.ceil(turning(y.beta_slow)), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low if high > low else 0.001), 0.0, 1.0)
    return freqs / y.factor * ramp + freqs * (1.0 - ramp)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: tuple[float, float, float, int] | Yarn | None = None) -> jax.Array:
    """Rotary embedding (rotate-half form) of x [b, s, h, d] at integer `positions` [b, s]; under YaRN cos and
    sin times its attention factor."""
    d = x.shape[-1]
    freqs = jnp.asarray(rope_frequencies(d, theta, scaling), jnp.float32)   # [d/2]
    angles = positions.astype(jnp.float32)[..., None] * freqs                # [b, s, d/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if isinstance(scaling, Yarn) and scaling.cos_sin != 1.0:
        cos, sin = cos * scaling.cos_sin, sin * scaling.cos_sin
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU (w_gate, w_up, w_down) or GeLU (w_up, w_down); column- then row-parallel."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs, width: int | None = None,
                 gated: bool | None = None):
        d, f = cfg.d_model, cfg.mlp_dim if width is None else width
        self.run, self.gated = run, cfg.mlp_type == "swiglu" if gated is None else gated
        if self.gated:
            self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std=d ** -0.5)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), std=d ** -0.5)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), std=f ** -0.5 / math.sqrt(2 * cfg.layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [b, s, d] -> [b, s, d], x in the layout the run's projections read (`Matmuls.input_names`)."""
        dt, read = dtype_of(self.run), self.run.matmuls.weight
        weights = (read(self.w_up[...], ("embed", "mlp"), dt),) + (
            (read(self.w_gate[...], ("embed", "mlp"), dt),) if self.gated else ())
        up, *gate = self.run.matmuls.column(x, weights)
        h = jax.nn.silu(gate[0]) * up if self.gated else jax.nn.gelu(up, approximate=True)
        h = constrain(h, ("batch", "seq", "act_mlp"))
        return self.run.matmuls.row(h, read(self.w_down[...], ("mlp", "embed"), dt))
