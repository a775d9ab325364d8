"""The scan over the model's stacked layer units, as the strategy runs it: rematerialised per unit under the
remat policy (jax.checkpoint with JAX's saveable-value policies), or with FSDP prefetch.

A policy names what each unit keeps for its backward pass: "none" and "selective" every activation (the
scan is not checkpointed; "selective" recomputes only the attention core, inside the block:
jaxpar.ops.attention.AttentionCore), "full" only the unit's input, "dots" / "dots_no_batch" the outputs of
JAX's matmuls (all, or those without batch dims) and the kernels' named residuals (the blockwise kernel's
output and logsumexp, ring attention's moved blocks: their forward rules would otherwise be rerun from saved
block products), "offload" each unit's input in host memory (`OFFLOADED`). `LayerScan` is the choice,
made once (jaxpar/training/trainer.py run_config); the pipelines apply the same policies to their units
(jaxpar/pipeline/stages.py, gpipe.py).
"""
from __future__ import annotations

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.ops.attention import RING_NAMES
from jaxpar.ops.blockwise_attention import RESIDUAL_NAMES
from jaxpar.ops.fsdp_prefetch import prefetched_scan

UNIT_INPUT = "unit_input"    # checkpoint_name of each unit's input: the residual stream [b, s, d] entering it

OFFLOADED = (UNIT_INPUT,)
"""What remat = "offload" keeps, and where: each unit's input (the residual stream [batch, seq, d_model] in the
compute dtype and the residual layout), one per unit, copied to host memory (`pinned_host`) in the forward
pass and back in the backward pass; everything inside the unit is recomputed from it, so the device holds
what "full" holds minus the units' inputs and the compute is "full"'s. MaxText's remat_policy=custom with
decoder_layer_input=offload makes the same choice. The CPU lowering drops memory kinds (a CPU device's memory
is host memory), so there the inputs stay where "full" keeps them."""

_KERNEL_RESIDUALS = jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES, *RING_NAMES)   # the kernels'
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _KERNEL_RESIDUALS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KERNEL_RESIDUALS),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=OFFLOADED,
        offload_src="device", offload_dst="pinned_host"),
}
KEEP_UNITS = ("none", "selective")   # policies under which the layer scan is not checkpointed


def remat(fn, policy: str):
    """Wrap a scan body in jax.checkpoint under the named policy ("none" and "selective" leave it alone)."""
    if policy in KEEP_UNITS:
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """How the scan over the stacked units runs: under the remat `policy`, or with FSDP prefetch (`prefetch`:
    jaxpar/ops/fsdp_prefetch.py, which recomputes each unit itself, remat "full")."""
    policy: str = "none"
    prefetch: bool = False

    def step(self, body):
        """The scan body, body(h, unit) -> (h, aux), rematerialised per `policy`, its input named `UNIT_INPUT`."""
        return remat(lambda h, unit: body(checkpoint_name(h, UNIT_INPUT), unit), self.policy)

    def __call__(self, body, x, stacked):
        """(x after every unit, the units' per-iteration outputs stacked)."""
        if self.prefetch:
            return prefetched_scan(body, x, stacked)
        return jax.lax.scan(self.step(body), x, stacked)
