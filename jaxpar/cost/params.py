"""Parameter counts per block, split into what the `tensor` axis shards and what it replicates.

Attention block (LLaMA-style, no biases): q,k,v,o projections d*(hq + 2*hkv) + hq*d with
hq = heads*head_dim, hkv = kv_heads*head_dim; MLP 3*d*f (SwiGLU: gate, up, down) or 2*d*f (GeLU);
two RMSNorm weights 2*d. For GPT shapes (hq = hkv = d, f = 4d, GeLU) this is Megatron's 12*h^2 per
layer (Narayanan et al. 2021, section 5.1, biases dropped).

Mamba-2 block (Dao & Gu 2024, the reference `Mamba2` module): in_proj d*d_in_proj with
d_in_proj = 2*d_inner + 2*ngroups*d_state + nheads (z, x, B, C, dt packed); depthwise conv
(conv_dim*d_conv weights + conv_dim bias) over conv_dim = d_inner + 2*ngroups*d_state channels;
dt_bias, A_log, D (nheads each); gated-RMSNorm weight d_inner; out_proj d_inner*d; pre-norm d.

Rules table (DESIGN.md): heads, mlp, vocab and ssm heads/groups go to `tensor`; norm weights over
`embed` are replicated over `tensor`; every weight has an `embed` dim, so ZeRO-3 shards all of it
over `fsdp`; only the stacked `layers` dim goes to `pipeline`, so embedding and head are replicated
over the pipeline axis.

The functions are pure and memoised on the ModelConfig *object* (`per_model`): a planner asks about
the same model thousands of times, and hashing a 22-field dataclass costs more than the arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from models.config import ModelConfig


def per_model(fn: Callable) -> Callable:
    """Memoise a pure function of (ModelConfig, *hashable args) on the config's identity. The memo keeps
    the config alive, so its id cannot be reused while the entry exists; the memo is bounded."""
    memo: dict = {}

    @functools.wraps(fn)
    def wrapper(m, *args, **kwargs):
        key = (id(m), *args, *sorted(kwargs.items())) if kwargs else (id(m), *args)
        hit = memo.get(key)
        if hit is not None and hit[0] is m:
            return hit[1]
        if len(memo) > 1024:
            memo.clear()
        value = fn(m, *args, **kwargs)
        memo[key] = (m, value)
        return value
    wrapper.cache_clear = memo.clear
    return wrapper


@dataclasses.dataclass(frozen=True, slots=True)
class BlockParams:
    sharded: int      # elements split over the tensor axis
    replicated: int   # elements replicated over the tensor axis
    tensors: int      # parameter arrays (one per weight; stacked over layers under scan)

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_device(self, tensor: int) -> float:
        return self.sharded / tensor + self.replicated


@per_model
def attention_block_params(m: ModelConfig) -> BlockParams:
    d, f = m.d_model, m.mlp_dim
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    n_mlp = 3 if m.mlp_type == "swiglu" else 2
    return BlockParams(sharded=d * (hq + 2 * hkv) + hq * d + n_mlp * d * f,
                       replicated=2 * d, tensors=4 + n_mlp + 2)


@per_model
def mamba_dims(m: ModelConfig) -> tuple[int, int, int]:
    """(d_in_proj, conv_dim, nheads) of a Mamba-2 mixer."""
    gn = m.ngroups * m.d_state
    return 2 * m.d_inner + 2 * gn + m.ssm_heads, m.d_inner + 2 * gn, m.ssm_heads


@per_model
def mamba_block_params(m: ModelConfig) -> BlockParams:
    d, di = m.d_model, m.d_inner
    d_in_proj, conv_dim, nh = mamba_dims(m)
    sharded = d * d_in_proj + conv_dim * (m.d_conv + 1) + 3 * nh + di + di * d
    return BlockParams(sharded=sharded, replicated=d, tensors=9)


@per_model
def embedding_params(m: ModelConfig) -> BlockParams:
    """Input embedding (vocab-sharded) and, unless tied, the LM head; final norm replicated."""
    tables = 1 if m.tie_embeddings else 2
    return BlockParams(sharded=tables * m.vocab * m.d_model, replicated=m.d_model, tensors=tables + 1)


@per_model
def layer_params(m: ModelConfig) -> BlockParams:
    """All `layers` blocks together (the part that the pipeline axis splits)."""
    a, mb = attention_block_params(m), mamba_block_params(m)
    na, nm = m.attention_layers, m.mamba_layers
    return BlockParams(sharded=na * a.sharded + nm * mb.sharded,
                       replicated=na * a.replicated + nm * mb.replicated,
                       tensors=(a.tensors if na else 0) + (mb.tensors if nm else 0))


@per_model
def layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(attention layers, Mamba layers): `pattern` repeated to fill `layers`."""
    return m.attention_layers, m.mamba_layers


def total_params(m: ModelConfig) -> int:
    return layer_params(m).total + embedding_params(m).total
