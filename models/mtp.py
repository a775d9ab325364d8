"""Multi-token prediction (MTP; DeepSeek-V3 section 2.2, figure 3).

After the layer stack, module k = 1 .. mtp_depth predicts the token k further ahead than the main head
does, from the previous depth's representation h^{k-1} (h^0: the main model's output after its final norm,
as Megatron-Core's and vLLM's DeepSeek MTP read it) and the embedding of the token k ahead:

    h'_i = [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] W_eh       W_eh [2d, d]: the checkpoints' eh_proj,
                                                                   embedding first, as they store it
    h^k  = Block_k(h')                                             one block of the last layer's kind
    loss_k = CE(Head(RMSNorm(h^k_i)), t_{i+k+1})                   over the positions whose target exists

The embedding and the head are the main model's (shared); the model's loss adds mtp_weight / depth x the
sum of the loss_k. The tokens ahead are the labels (labels_i = t_{i+1}) moved along the sequence in its
logical order (`RunConfig.seq_order`: zigzag under context parallelism), so the modules need nothing the
head lacks and run where it runs (a pipeline's last stage). A MoE block's balancing-bias probe and z-loss
add to the loss; its batch-wise balance loss does not (a product of batch means, which a pipeline's
per-micro-batch head cannot form; DeepSeek-V3 balances by the bias). Generation ignores the modules.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.sharding import constrain
from jaxpar.models.config import ModelConfig
from jaxpar.models.layers import RMSNorm, dtype_of, param
from jaxpar.models.moe import MoEBlock
from jaxpar.models.run import RunConfig
from jaxpar.models.transformer import RESIDUAL, AttentionBlock


class MTPModule(nnx.Module):
    """One depth: the two input norms, W_eh, a block of the last layer's kind, and its own final norm."""

    def __init__(self, cfg: ModelConfig, run: RunConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.run = run
        self.embed_norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.w_eh = param(rngs, (2, d, d), (None, "embed", None), std=(2 * d) ** -0.5)
        self.block = (MoEBlock if cfg.mtp_kind == "E" else AttentionBlock)(cfg, run, rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)

    def __call__(self, hidden: jax.Array, ahead: jax.Array, positions: jax.Array
                 ) -> tuple[jax.Array, jax.Array | None]:
        """(h^k [b, s, d], the MoE block's router statistics or None) from h^{k-1} and Emb(t_{i+k})."""
        w = self.w_eh[...].astype(dtype_of(self.run))
        x = constrain(self.embed_norm(ahead) @ w[0] + self.hidden_norm(hidden) @ w[1], RESIDUAL)
        out = self.block(x, positions)
        return out if isinstance(out, tuple) else (out, None)


def ahead(labels: jax.Array, k: int, order: np.ndarray) -> tuple[jax.Array, np.ndarray]:
    """(labels moved k positions ahead in logical order [b, s], where they exist [s] as 0 / 1): entry j holds
    the label of logical position order[j] + k (0 past the end)."""
    seq = len(order)
    stored_at = np.argsort(order)                     # logical position -> stored index
    target = order + k
    valid = target < seq
    index = np.where(valid, stored_at[np.minimum(target, seq - 1)], 0)
    moved = jnp.where(jnp.asarray(valid), jnp.take(labels, jnp.asarray(index), axis=1), 0)
    return constrain(moved, ("batch", "seq")), valid.astype(np.float32)
