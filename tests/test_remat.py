"""The recompute policies the stacks use: remat = "selective" (the attention core recomputed, Korthikanti et
al. 2022; models/transformer.py) and remat = "offload" (each unit's input kept in host memory, everything
else recomputed; jaxpar/ops/layer_scan.py OFFLOADED). Each trains to the one-device numbers (remat none); selective
keeps no score matrix for the backward pass (XLA's memory analysis against none's); offload's program puts
exactly the named activations in host memory (its jaxpr, and the module lowered for a GPU: the CPU lowering
drops memory kinds, its device memory being host memory already).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxpar.core import validate
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.training.trainer import TrainConfig, Trainer
from tests import harness
from tests.harness import assert_matches_one_device

MODEL = "llama-tiny"


def test_offload_matches_one_device():
    assert_matches_one_device(MODEL, "fsdp8", remat="offload")


@pytest.mark.parametrize("mesh", ["tp4-sp", pytest.param("cp4-tp2-ring", marks=pytest.mark.slow)])
def test_selective_matches_one_device(mesh):
    assert_matches_one_device(MODEL, mesh, remat="selective")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_selective_in_a_pipeline_matches_one_device(schedule):
    assert_matches_one_device(MODEL, "data=4,pipeline=2", remat="selective", microbatches=2, pp_schedule=schedule)


def traced_grads(tr: Trainer):
    """The trainer's (loss, gradients) function traced from shapes: its jaxpr and a lowering of it."""
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          tr.abstract_params, tr.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((tr.tc.batch, tr.tc.seq), jnp.int32, sharding=tr.batch_sharding)
             for k in ("inputs", "labels", "positions")}
    return tr.stored_loss_and_grads.trace(params, batch)


def host_placements(remat: str) -> tuple[set[str], list[str]]:
    """(the jaxpr's array types in host memory, the shapes the module lowered for a GPU annotates
    `pinned_host`) of the fsdp8 step under `remat`."""
    traced = traced_grads(harness.trainer(MODEL, "fsdp8", remat=remat))
    host_types = set(re.findall(r"f32<host>\[[\d,]*\]", str(traced.jaxpr)))
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    placed = re.findall(r'annotate_device_placement.*_xla_buffer_placement = "pinned_host".*-> tensor<([\dx]+)xf32>', gpu)
    return host_types, placed


def test_offload_puts_each_units_input_in_host_memory():
    """Under offload the layer scan's saved residual is the units' inputs [units, b, s, d] in host memory,
    each [b, s, d] annotated pinned_host in the GPU module (forward: to host; the backward reads them back);
    under full the same inputs stay in device memory: no host array, no annotation."""
    cfg, tc = parse_model(MODEL), harness.TC
    host_types, placed = host_placements("offload")
    unit_input = f"{tc.batch},{tc.seq},{cfg.d_model}"
    assert f"f32<host>[{cfg.units},{unit_input}]" in host_types, host_types
    assert host_types <= {f"f32<host>[{cfg.units},{unit_input}]", f"f32<host>[{unit_input}]"}, host_types
    assert placed and set(placed) == {unit_input.replace(",", "x")}, placed
    assert host_placements("full") == (set(), [])


def temp_bytes(remat: str, seq: int = 256) -> int:
    tr = Trainer(parse_model(f"{MODEL}:max_seq={seq}"), parse_strategy("data=1").with_options(remat=remat),
                 TrainConfig(batch=1, seq=seq, steps=1), devices=jax.devices()[:1])
    return tr.lower_step().compile().memory_analysis().temp_size_in_bytes


def test_selective_keeps_no_scores():
    """llama-tiny at 256 tokens with the dense kernel: the [heads, s, s] scores and probabilities of both
    layers are most of remat none's temporaries; selective recomputes them, so its temporaries are
    at most 3/4 of none's (measured: 21.8 MB against 35.0 MB)."""
    assert temp_bytes("selective") < 0.75 * temp_bytes("none")


@pytest.mark.parametrize("model, mesh, options, message", [
    (MODEL, "data=4,pipeline=2", dict(remat="offload", microbatches=2),
     "remat=offload keeps the layer scan's unit inputs in host memory, but pipeline=2"),
    ("mamba2-tiny", "data=8", dict(remat="selective"),
     "remat=selective recomputes the attention core, but mamba2-tiny .pattern='M'. has no attention block"),
])
def test_policies_a_run_cannot_honour_are_refused(model, mesh, options, message):
    st = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError, match=message):
        validate.check(parse_model(model), st, batch=16, seq=32)
