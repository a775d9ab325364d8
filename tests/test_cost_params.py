"""The cost model's weight lists (jaxpar/cost/params.py) are the models' own parameters.

params.py lists each block's weights with shapes and logical names, so that it stays arithmetic; which
mesh axes split them it reads from jaxpar/core/rules.py. Here the lists are checked against the parameters
models/ creates (`nnx.eval_shape`: nothing allocated), shape and logical names of every array, so a
weight added to a model and not to the cost model fails here.
"""
from __future__ import annotations

from collections import Counter

import jax
import pytest
from flax import nnx

from jaxpar.cost import params
from jaxpar.models.config import parse_model
from jaxpar.models.lm import LM

MODELS = ["llama-tiny", "llama-tiny:mlp_type=gelu,tie_embeddings=true", "mamba2-tiny", "hybrid-tiny:layers=8",
          "moe-tiny:shared_experts=2", "moe-tiny:pattern=AE,layers=4,qk_norm=true", "jamba-tiny",
          "deepseek-tiny:pattern=E,layers=2", "deepseek-tiny:pattern=A,layers=2,q_lora_rank=0"]


def model_arrays(cfg) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(shape, logical names) of every parameter array models/ creates."""
    state = nnx.state(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(v.shape), tuple(v.get_metadata()["out_sharding"])) for v in leaves]


@pytest.mark.parametrize("name", MODELS)
def test_weight_lists_are_the_models_parameters(name):
    """Each block's weights once per occurrence in the pattern, stacked over units (a leading `layers`
    dim of size `units`), and the embedding's weights once."""
    m = parse_model(name)
    want = Counter()
    for block, kind in (("attention", "A"), ("mamba", "M"), ("moe", "E")):
        for w in params.block_weights(m, block):
            want[(m.units, *w.shape), ("layers", *w.names)] += m.pattern.count(kind)
    for w in params.block_weights(m, "embedding"):
        want[w.shape, w.names] += 1
    assert Counter(model_arrays(m)) == want


def test_expert_weights_are_split_over_the_expert_axis():
    """A device holds E / expert of the routed experts and all of the rest (router, attention half)."""
    m = parse_model("moe-tiny")
    p = params.block_params(m, "moe")
    experts = 3 * m.experts * m.d_model * m.moe_mlp_dim
    assert p.expert_sharded == experts and p.expert_replicated == 0
    assert p.per_device(1, 4) == p.total - experts + experts / 4
    assert p.per_device(2, 4) == p.sharded / 2 + p.replicated + experts / 8


@pytest.mark.parametrize("name", MODELS)
def test_total_params_is_the_models(name):
    m = parse_model(name)
    total = 0
    for shape, _ in model_arrays(m):
        n = 1
        for d in shape:
            n *= d
        total += n
    assert params.total_params(m) == total


def test_zero_shards_the_weights_with_an_embed_dim():
    """ZeRO-3 (params) and ZeRO-1 (optimizer) shard what the rules map to the data axes: every
    attention weight; of Mamba-2's, the norm, the five in_proj weights and out_proj (gathered as 3
    arrays: in_proj is packed), not the conv weights and biases, A_log, dt_bias, D or the gate norm."""
    m = parse_model("mamba2-tiny")
    for zero, purpose, axes in ((3, "params", ("fsdp",)), (1, "optimizer", ("data", "fsdp"))):
        assert params.zero_axes(m, zero, purpose) == axes
        sharded, kept = params.zero_split(m, "mamba", zero, purpose)
        assert (sharded.tensors, sharded.moved, kept.tensors) == (7, 3, 10)
        assert sharded.total + kept.total == params.mamba_block_params(m).total
        assert params.zero_split(m, "attention", zero, purpose)[1].total == 0
    assert params.zero_axes(m, 0) == () and params.zero_axes(m, 1) == ()
    assert params.zero_split(m, "mamba", 0)[0].total == 0
