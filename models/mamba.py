"""The Mamba-2 block (Dao & Gu 2024): pre-norm, in_proj, causal conv, SSD, gated norm, out_proj.

    h = RMSNorm(x)
    z, xs, B, C, dt = in_proj(h)                   column-parallel: heads / groups on `tensor`
    xs, B, C = silu(causal_conv(xs, B, C))         depthwise, d_conv taps
    y = SSD(xs, softplus(dt + dt_bias), -exp(A_log), B, C) + D * xs
    y = RMSNorm_per_group(y * silu(z))             Mamba-2's RMSNormGated with ngroups groups
    x + out_proj(y)                                row-parallel: one all-reduce under tensor

Mamba-2 packs z, x, B, C, dt into one in_proj matrix; here they are separate parameters (the same
maths) so that each carries its own logical names, and they are packed per group at run time into
one matmul. Heads of a group are contiguous, so with heads and groups both sharded over `tensor`
(ngroups % tensor == 0) every device holds whole groups with their heads: the conv, SSD and group
norm are local, and the tensor-parallel collectives per layer are the out_proj's all-reduce forward
and the in_proj input-gradient's all-reduce backward (with sequence parallelism: an all-gather
before in_proj and a reduce-scatter after out_proj, and their transposes backward). Under context
parallelism the conv and SSD go through `jaxpar.ops.mamba_cp` (halo ppermute, state all-gather).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.layers import RMSNorm, dtype_of, param
from jaxpar.models.transformer import RESIDUAL

HEADS = ("batch", "seq", "ssm_heads", None)
GROUPS = ("batch", "seq", "ssm_groups", None)


def _param(x: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """A parameter with a given initial value (as jaxpar.models.layers.param, for non-normal inits)."""
    return nnx.Param(x.astype(jnp.float32), out_sharding=names, eager_sharding=False)


class MambaBlock(nnx.Module):
    """x + Mamba2Mixer(RMSNorm(x)). Input and output are the residual stream [b, s, d_model]."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d, h, p, g, n, k = cfg.d_model, cfg.ssm_heads, cfg.ssm_head_dim, cfg.ngroups, cfg.d_state, cfg.d_conv
        self.cfg, self.run = cfg, run
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        # in_proj (column-parallel)
        self.w_z = param(rngs, (d, h, p), ("embed", "ssm_heads", "head_dim"), std=d ** -0.5)
        self.w_x = param(rngs, (d, h, p), ("embed", "ssm_heads", "head_dim"), std=d ** -0.5)
        self.w_B = param(rngs, (d, g, n), ("embed", "ssm_groups", "ssm_state"), std=d ** -0.5)
        self.w_C = param(rngs, (d, g, n), ("embed", "ssm_groups", "ssm_state"), std=d ** -0.5)
        self.w_dt = param(rngs, (d, h), ("embed", "ssm_heads"), std=d ** -0.5)
        # depthwise causal conv over x, B, C (PyTorch's Conv1d init scale: fan_in = d_conv)
        self.conv_x = param(rngs, (k, h, p), ("conv", "ssm_heads", "head_dim"), std=k ** -0.5)
        self.conv_x_bias = param(rngs, (h, p), ("ssm_heads", "head_dim"), std=k ** -0.5)
        self.conv_B = param(rngs, (k, g, n), ("conv", "ssm_groups", "ssm_state"), std=k ** -0.5)
        self.conv_B_bias = param(rngs, (g, n), ("ssm_groups", "ssm_state"), std=k ** -0.5)
        self.conv_C = param(rngs, (k, g, n), ("conv", "ssm_groups", "ssm_state"), std=k ** -0.5)
        self.conv_C_bias = param(rngs, (g, n), ("ssm_groups", "ssm_state"), std=k ** -0.5)
        # per-head SSM parameters, Mamba-2's inits: A in [-16, -1], dt in [1e-3, 1e-1] log-uniform
        self.A_log = _param(jnp.log(jax.random.uniform(rngs.params(), (h,), minval=1.0, maxval=16.0)),
                            ("ssm_heads",))
        dt0 = jnp.exp(jax.random.uniform(rngs.params(), (h,), minval=math.log(1e-3), maxval=math.log(1e-1)))
        dt0 = jnp.maximum(dt0, 1e-4)
        self.dt_bias = _param(dt0 + jnp.log(-jnp.expm1(-dt0)), ("ssm_heads",))   # softplus^-1(dt0)
        self.D = param(rngs, (h,), ("ssm_heads",), value=1.0)
        self.gate_norm = param(rngs, (h, p), ("ssm_heads", "head_dim"), value=1.0)
        # out_proj (row-parallel)
        self.w_out = param(rngs, (h, p, d), ("ssm_heads", "head_dim", "embed"),
                           std=cfg.d_inner ** -0.5 / math.sqrt(2 * cfg.layers))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        del positions  # the recurrence follows the token layout (see jaxpar.ops.mamba_cp)
        cfg, dt_ = self.cfg, dtype_of(self.run)
        h = constrain(self.norm(x), ("batch", "seq", "act_embed"))
        z, xs, B, C, dt = self.in_proj(h)

        convs = [(xs, self.conv_x[...], self.conv_x_bias[...], HEADS),
                 (B, self.conv_B[...], self.conv_B_bias[...], GROUPS),
                 (C, self.conv_C[...], self.conv_C_bias[...], GROUPS)]
        xs, B, C = self.run.ssm.conv(convs)
        xs, B, C = (constrain(jax.nn.silu(t), names) for t, names in ((xs, HEADS), (B, GROUPS), (C, GROUPS)))

        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])
        A = -jnp.exp(self.A_log[...])
        y = self.run.ssm.ssd(xs, dt, A, B, C, cfg.chunk)
        y = y + xs * self.D[...].astype(dt_)[:, None]
        y = constrain(gated_rms_norm(y, z, self.gate_norm[...], cfg.ngroups, cfg.norm_eps), HEADS)
        out = jnp.einsum("bshp,hpd->bsd", y, self.w_out[...].astype(dt_))
        return constrain(x + out, RESIDUAL)

    def in_proj(self, h: jax.Array) -> tuple[jax.Array, ...]:
        """z, x [b, s, heads, p], B, C [b, s, groups, n], dt [b, s, heads] as ONE matmul.

        The five weights are packed per group, [d, g, (z | x | B | C | dt) of that group], a
        concatenation along an unsharded dim (no communication), so the backward pass yields a
        single partial input-gradient: one all-reduce over `tensor`, not one per projection.
        """
        cfg, dt_ = self.cfg, dtype_of(self.run)
        d, g, p, n = cfg.d_model, cfg.ngroups, cfg.ssm_head_dim, cfg.d_state
        r = cfg.ssm_heads // g
        w = jnp.concatenate([self.w_z[...].reshape(d, g, r * p), self.w_x[...].reshape(d, g, r * p),
                             self.w_B[...], self.w_C[...], self.w_dt[...].reshape(d, g, r)], axis=-1)
        out = constrain(jnp.einsum("bsd,dgk->bsgk", h, w.astype(dt_)), GROUPS)
        b, s = out.shape[:2]
        z, xs, B, C, dt = jnp.split(out, np.cumsum([r * p, r * p, n, n])[:4], axis=-1)
        return (constrain(z.reshape(b, s, g * r, p), HEADS), constrain(xs.reshape(b, s, g * r, p), HEADS),
                constrain(B, GROUPS), constrain(C, GROUPS), constrain(dt.reshape(b, s, g * r), HEADS[:3]))


def gated_rms_norm(y: jax.Array, z: jax.Array, scale: jax.Array, groups: int, eps: float) -> jax.Array:
    """Mamba-2's RMSNormGated (norm_before_gate=False): RMSNorm(y * silu(z)) over each group's
    channels (the heads of one B/C group), so it stays local when groups are sharded."""
    b, s, h, p = y.shape
    u = (y * jax.nn.silu(z)).astype(jnp.float32).reshape(b, s, groups, (h // groups) * p)
    u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps)
    return (u.reshape(b, s, h, p) * scale).astype(y.dtype)
