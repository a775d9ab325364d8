"""Each parameter and Adam moment lands where the rules say, and FSDP really divides memory.

Expected PartitionSpecs are written out by hand per strategy (not computed by jaxpar.core.rules).
Parameter shapes of llama-tiny: layer-stacked leaves carry a leading `layers` dim (unsharded here).
"""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests import harness

MODEL = "llama-tiny"

# leaf (path suffix) -> expected spec, per strategy
EXPECTED = {
    "fsdp8": {  # embed dims on fsdp
        "embedding": P(None, "fsdp"), "head": P("fsdp"),
        "attn']['wq": P(None, "fsdp"), "attn']['wo": P(None, None, None, "fsdp"),
        "mlp']['w_up": P(None, "fsdp"), "mlp']['w_down": P(None, None, "fsdp"),
        "attn_norm']['scale": P(None, "fsdp"), "final_norm']['scale": P("fsdp"),
    },
    "tp8": {  # q/k/v and MLP-in column-sharded, o and MLP-out row-sharded, vocab sharded
        "embedding": P("tensor"), "head": P(None, "tensor"),
        "attn']['wq": P(None, None, "tensor"), "attn']['wk": P(None, None, "tensor"),
        "attn']['wv": P(None, None, "tensor"), "attn']['wo": P(None, "tensor"),
        "mlp']['w_gate": P(None, None, "tensor"), "mlp']['w_up": P(None, None, "tensor"),
        "mlp']['w_down": P(None, "tensor"),
        "attn_norm']['scale": P(), "final_norm']['scale": P(),
    },
    "dp2-fsdp2-tp2": {
        "embedding": P("tensor", "fsdp"), "head": P("fsdp", "tensor"),
        "attn']['wq": P(None, "fsdp", "tensor"), "attn']['wo": P(None, "tensor", None, "fsdp"),
        "mlp']['w_down": P(None, "tensor", "fsdp"),
    },
    "zero1-dp8": {name: P() for name in ("embedding", "head", "attn']['wq", "mlp']['w_down")},
    "dp8": {name: P() for name in ("embedding", "head", "attn']['wq", "mlp']['w_down")},
}
# ZeRO-1 moments: sharded on the embed dim over `data`; other strategies' moments follow the params.
ZERO1_MOMENTS = {"embedding": P(None, "data"), "head": P("data"), "attn']['wq": P(None, "data"),
                 "mlp']['w_down": P(None, None, "data")}


def spec_of(tree, suffix):
    hits = [x.sharding.spec for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if jax.tree_util.keystr(path).endswith(f"['{suffix}'].value")]
    assert hits, f"no leaf ending in {suffix}"
    return hits


def strip(spec):
    dims = list(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


@pytest.mark.parametrize("mesh", list(EXPECTED))
def test_parameter_and_moment_specs(mesh):
    _, state = harness.trajectory(MODEL, mesh)
    mu = state.opt_state[1][0].mu
    for suffix, want in EXPECTED[mesh].items():
        for spec in spec_of(state.params, suffix):
            assert strip(spec) == want, (mesh, suffix, spec)
        moment_want = ZERO1_MOMENTS[suffix] if mesh == "zero1-dp8" else want
        for spec in spec_of(mu, suffix):
            assert strip(spec) == moment_want, (mesh, "moment", suffix, spec)


def test_fsdp_each_device_holds_an_eighth_of_the_parameters():
    _, state = harness.trajectory(MODEL, "fsdp8")
    leaves = jax.tree.leaves(state.params)
    total = sum(x.nbytes for x in leaves)
    for d in range(8):
        held = sum(x.addressable_shards[d].data.nbytes for x in leaves)
        replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
        assert replicated == 0  # llama-tiny: every leaf has an embed dim
        assert held * 8 == total


def test_parameters_are_born_sharded_and_equal_the_one_device_init():
    tr = harness.trainer(MODEL, "fsdp8")
    state = tr.init_state()
    ref = dict(harness.leaves_with_paths(harness.reference_params(MODEL)))
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        assert not x.sharding.is_fully_replicated, path
        shard = x.addressable_shards[0]
        assert shard.data.size * 8 == x.size
        np.testing.assert_array_equal(np.asarray(x), ref[jax.tree_util.keystr(path)])
