"""ZeRO-3 over the expert group (jaxpar.core.rules.zero3_axes): on a mesh with expert parallelism and no fsdp axis,
zero=3 shards every weight's model dim over data x expert (a routed expert's over `data`, its experts being on
`expert`), so weights, gradients and optimizer state are 1/(data x expert) per device, as NeMo and MaxText lay
out EP with FSDP on one group. The step equals one device's, and the backward pass gathers each layer's experts
again instead of keeping every layer's gathered copy from the forward pass (jaxpar/ops/moe.py's checkpoint
policy), which XLA's memory analysis shows against the same step compiled with that policy off.
"""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.core.strategy import parse_strategy
from jaxpar.core.validate import check
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.ops import moe as moe_ops
from jaxpar.training.config import TrainConfig
from jaxpar.training.trainer import Trainer
from tests import harness

MESH = "data=2,expert=4"


def is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def test_zero3_over_the_expert_group_matches_one_device():
    harness.assert_matches_one_device("moe-tiny:capacity_factor=1.0", MESH, zero=3)   # test_moe.py's reference


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(microbatches=4), dict(microbatches=4, pp_schedule="1f1b")])
def test_zero3_over_the_expert_group_in_a_pipeline_matches_one_device(options):
    """The stage weights gathered to their compute layout (over data x expert, the experts kept on `expert`)
    once per step, copied per data shard: GPipe and 1F1B (jaxpar/pipeline/stages.py, shards.py)."""
    harness.assert_matches_one_device("moe-tiny:layers=4", "pipeline=2,expert=2,data=2", zero=3, **options)


def test_zero3_over_the_expert_group_shards_every_weight_over_it():
    """Every weight, its AdamW moments included, holds 1/8 of its elements per device."""
    tr = harness.trainer("moe-tiny", MESH, zero=3)
    block = tr.param_shardings["runs"][0]["blocks"][0]
    assert block["moe"]["w_gate"].get_value().spec == P(None, "expert", "data")    # [layers, experts, embed, mlp]
    assert block["moe"]["w_down"].get_value().spec == P(None, "expert", None, "data")
    assert block["attn"]["wq"].get_value().spec == P(None, ("data", "expert"))
    leaves = [(leaf, sharding) for leaf, sharding in zip(jax.tree.leaves(tr.abstract_state()),
                                                         jax.tree.leaves(tr.state_shardings, is_leaf=is_sharding))
              if leaf.ndim and leaf.size >= 64 * 8]           # every weight and moment (not the norm scales)
    assert len(leaves) == 3 * 10        # weights and moments: embedding, head, 4 attention, router, 3 experts
    for leaf, sharding in leaves:
        assert np.prod(sharding.shard_shape(leaf.shape)) * 8 == leaf.size, leaf.shape


def _temp_bytes(model: str, policy) -> tuple[int, str]:
    """(XLA's temp bytes per device, optimized HLO) of the gradient step under ZeRO-3 over the expert group,
    with the expert kernel's checkpoint policy `policy`."""
    tr = Trainer(parse_model(model), parse_strategy(MESH).with_options(zero=3, moe_kernel="padded"),
                 TrainConfig(batch=8, seq=8, steps=1), devices=jax.devices())
    saved = moe_ops._save_all_but_weight_copies
    moe_ops._save_all_but_weight_copies = policy
    try:
        compiled = tr.lower_step().compile()
    finally:
        moe_ops._save_all_but_weight_copies = saved
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


@pytest.mark.slow
def test_backward_gathers_the_experts_again():
    """Peak (temp) memory drops by all but one of the layers' gathered experts (the backward pass holds one
    layer's at a time): (L - 1) layers x 3 weights x (E / expert) experts x d x f float32, counted by hand
    (moe-tiny with wide experts, so that they dominate). Two compiles, 15 s: slow."""
    layers, d, f, experts = 4, 64, 512, 8
    model = f"moe-tiny:layers={layers},expert_mlp_dim={f}"
    held, held_hlo = _temp_bytes(model, jax.checkpoint_policies.everything_saveable)
    after, hlo = _temp_bytes(model, moe_ops._save_all_but_weight_copies)
    per_layer = 3 * (experts // 4) * d * f * 4
    assert held - after >= (layers - 1) * per_layer, (held, after, per_layer)
    # the forward loop exports the gathered [layers, E/4, d, f] weights only when they are saved
    assert f"f32[{layers},2,{d},{f}]" in held_hlo and f"f32[{layers},2,{d},{f}]" not in hlo
    assert hlo.count("all-gather(") > held_hlo.count("all-gather(")


@pytest.mark.parametrize("model, mesh, options, message", [
    ("moe-tiny", MESH, dict(zero=3, fsdp_prefetch=True),
     "fsdp_prefetch with zero=3 over the expert group (data x expert = 8, fsdp=1): the prefetch gathers over fsdp"),
    ("moe-tiny:d_model=36,heads=6,kv_heads=2,head_dim=6", MESH, dict(zero=3),
     "data x expert=8 does not divide d_model=36"),
    ("moe-tiny", "data=8", dict(zero=3), "zero=3 shards parameters over the fsdp axis, but the mesh has fsdp=1"),
])
def test_zero3_over_the_expert_group_refusals(model, mesh, options, message):
    strategy = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError) as e:
        check(parse_model(model), strategy, batch=16, seq=32)
    assert message in str(e.value)
