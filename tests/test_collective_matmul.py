"""Collective matmul (jaxpar/ops/collective_matmul.py, the `overlap` option).

The kernels equal the plain matmul, forward and gradients (float32, 1e-6 of the result's scale), for
tensor 2, 4 and 8, with the input in the sequence-parallel residual layout and without it (replicated
over `tensor`: the kernel slices it), on one and on both ring directions. The model under the option
equals one device (loss and every gradient), and its compiled step has no all-gather or
reduce-scatter of activations inside the layer loop: its collective-permutes there are the rings,
each next to the partial matmuls it feeds or is fed by.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core import validate
from jaxpar.analysis import hlo_text, overlap, tally
from jaxpar.errors import ConfigError
from jaxpar.core.mesh import make_mesh
from jaxpar.ops.collective_matmul import column_parallel, row_parallel
from jaxpar.core.sharding import Layout, use_layout
from jaxpar.core.strategy import parse_strategy
from jaxpar.models.config import parse_model
from tests import harness

MODEL = "llama-tiny"
MESH = "data=2,tensor=4"
OPTION = {"sequence_parallel": True, "overlap": "collective_matmul"}
B, S, D, F, H, HD = 4, 16, 8, 16, 8, 2   # small: every shape divides tensor 8 and even halves of S/8


def _layout(spec: str, sp: bool = True) -> Layout:
    strategy = parse_strategy(spec).with_options(sequence_parallel=sp).resolved(8)
    return Layout(make_mesh(strategy, jax.devices()[:8]), strategy)


def _operands():
    k = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(k[0], (B, S, D))
    w_mlp, w_heads = jax.random.normal(k[1], (D, F)), jax.random.normal(k[2], (D, H, HD))
    v_mlp, v_heads = jax.random.normal(k[3], (F, D)), jax.random.normal(k[4], (H, HD, D))
    # cotangents of the outputs, so the gradients are exactly the kernels' VJPs
    cots = (jax.random.normal(k[5], (B, S, F)), jax.random.normal(k[6], (B, S, H, HD)),
            jax.random.normal(k[7], (B, S, D)), jax.random.normal(k[0], (B, S, D)))
    return x, (w_mlp, w_heads, v_mlp, v_heads), cots


def _apply(x, ws, cm):
    """Both kernels on an MLP-shaped and an attention-shaped pair of projections (cm: None = plain)."""
    w_mlp, w_heads, v_mlp, v_heads = ws
    if cm is None:
        y_mlp, y_heads = x @ w_mlp, jnp.einsum("bsd,dhk->bshk", x, w_heads)
        return y_mlp, y_heads, jnp.tanh(y_mlp) @ v_mlp, jnp.einsum("bshk,hkd->bsd", jnp.tanh(y_heads), v_heads)
    y_mlp, y_heads = column_parallel(x, (w_mlp, w_heads), **cm)
    return (y_mlp, y_heads, row_parallel(jnp.tanh(y_mlp), v_mlp, **cm),
            row_parallel(jnp.tanh(y_heads), v_heads, **cm))


def _outputs_and_grads(x, ws, cots, cm):
    outs, vjp = jax.vjp(lambda x, ws: _apply(x, ws, cm), x, ws)
    return outs, vjp(cots)


VARIANTS = {  # name: (input in the SP residual layout, else replicated over `tensor`; kernel arguments)
    "sp-uni": (True, {}), "sp-bidir": (True, {"bidirectional": True}),
    "replicated-uni": (False, {}), "replicated-bidir": (False, {"bidirectional": True}),
}


@functools.cache
def _results(tensor: int, names: tuple[str, ...]):
    """{variant: (outputs, (dx, dws))}, every variant in one jit on a data x tensor mesh."""
    layout = _layout(f"data={8 // tensor},tensor={tensor}")
    x, ws, cots = _operands()

    def run(x_sp, x_rep, ws, cots):
        with use_layout(layout):
            return {name: _outputs_and_grads(x_sp if VARIANTS[name][0] else x_rep, ws, cots, VARIANTS[name][1])
                    for name in names}

    x_sp = jax.device_put(x, NamedSharding(layout.mesh, P("data", "tensor")))
    x_rep = jax.device_put(x, NamedSharding(layout.mesh, P("data")))
    return jax.tree.map(np.asarray, jax.jit(run)(x_sp, x_rep, ws, cots))


@functools.cache
def _exact():
    """The plain matmuls and their VJPs on one device, no layout."""
    x, ws, cots = _operands()
    return jax.tree.map(np.asarray, jax.jit(_outputs_and_grads, static_argnums=3)(x, ws, cots, None))


def _check(tensor: int, names: tuple[str, ...]):
    got, exact = _results(tensor, names), _exact()
    assert set(got) == set(names)
    for name in names:
        for g, r in zip(jax.tree.leaves(got[name]), jax.tree.leaves(exact), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * np.max(np.abs(r)), err_msg=name)


def test_kernels_equal_plain_matmul_tensor4():
    """The default run: each input layout once and each ring direction once (one compile)."""
    _check(4, ("sp-uni", "replicated-bidir"))


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_kernels_equal_plain_matmul(tensor):
    _check(tensor, tuple(VARIANTS))


def test_kernels_are_plain_matmuls_without_a_ring():
    """No layout, or a layout without sequence parallelism: plain matmuls (nothing to decompose)."""
    x, ws, cots = _operands()
    with use_layout(None):
        jaxpr = str(jax.make_jaxpr(lambda x, ws: _apply(x, ws, {}))(x, ws))
    assert "ppermute" not in jaxpr and "shard_map" not in jaxpr
    with use_layout(_layout("data=2,tensor=4", sp=False)):
        jaxpr = str(jax.make_jaxpr(lambda x, ws: _apply(x, ws, {}))(x, ws))
    assert "ppermute" not in jaxpr and "shard_map" not in jaxpr


# ---- the model under the option --------------------------------------------------------------

def test_model_matches_one_device():
    harness.assert_matches_one_device(MODEL, MESH, 8, **OPTION)


@pytest.mark.slow
def test_training_trajectory_matches_one_device():
    """10 steps equal one device's (slow: the 1-device trajectory is another compile, unless
    tests/test_strategies.py already made it)."""
    ref, _ = harness.trajectory(MODEL, "data=1", devices=1)
    got, _ = harness.trajectory(MODEL, MESH, 8, **OPTION)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, devices, options", [
    (MODEL, "tensor=4", 4, OPTION),
    (MODEL, MESH, 8, {"sequence_parallel": True, "overlap": "collective_matmul_bidir"}),
    (MODEL, "tensor=8", 8, {**OPTION, "remat": "full"}),
    (MODEL, "fsdp=2,tensor=4", 8, OPTION),
    (MODEL, "context=2,tensor=4", 8, {**OPTION, "attention": "ring"}),
    ("moe-tiny", "expert=2,tensor=4", 8, OPTION),
])
def test_model_matches_one_device_more_layouts(model, mesh, devices, options):
    harness.assert_matches_one_device(model, mesh, devices, **options)


def test_compiled_step_decomposes_the_collectives():
    """Inside the layer loop (forward and backward bodies): no all-gather, reduce-scatter or activation
    all-reduce; (tensor-1) collective-permutes per ring, 4 rings per layer (q/k/v, o, up/gate, down)
    each way; every permute sends a chunk that a dot then reads (all-gather ring) or a partial sum
    that a dot just produced (reduce-scatter ring), within a few element-wise or copy ops: the
    `decomposed` part of `jaxpar comm`'s overlap report (jaxpar/analysis/overlap.py), which also says
    that XLA:CPU made no collective asynchronous."""
    mesh, tensor, d = MESH, 4, parse_model(MODEL).d_model
    module = hlo_text.parse_module(harness.compiled_text(MODEL, mesh, 8, **OPTION))
    layout_mesh = harness.trainer(MODEL, mesh, 8, **OPTION).mesh
    positions = np.arange(layout_mesh.size).reshape(tuple(layout_mesh.shape.values()))
    over_tensor = {op.name: op for op in tally.collective_ops(module, layout_mesh.axis_names, positions)
                   if "tensor" in op.axes}
    report = overlap.overlap_report(module, layout_mesh.axis_names, positions)
    assert not report["asynchronous"]
    bodies = {d_["computation"]: d_ for d_ in report["decomposed"]}
    assert len(bodies) == 2, bodies   # the layer scan's forward and backward loop bodies
    layers = parse_model(MODEL).layers
    for name, body in bodies.items():
        assert name != module.entry and body["runs"] == layers and body["axes"] == ["tensor"]
        tensor_ops = [over_tensor[i.name] for i in module.computations[name] if i.name in over_tensor]
        assert not [op for op in tensor_ops if op.kind in ("all-gather", "reduce-scatter")], name
        # the one all-reduce over tensor left in a body sums the norm scales' gradients ([d] floats each)
        assert all(op.kind == "collective-permute" or (op.kind == "all-reduce" and op.bytes <= 4 * 2 * d)
                   for op in tensor_ops), (name, tensor_ops)
        assert body["permutes"] == 4 * (tensor - 1), body
        assert body["permutes_at_matmul"] == body["permutes"] and body["matmuls"] > body["permutes"], body


# ---- constraints -------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, options, model, seq, message", [
    ("data=8", {"overlap": "collective_matmul"}, MODEL, 32, "tensor=1"),
    ("tensor=8", {"overlap": "collective_matmul"}, MODEL, 32, "needs sequence_parallel=true (tensor=8)"),
    ("tensor=8", {"overlap": "collective_matmul_bidir", "sequence_parallel": True}, MODEL, 8,
     "seq=8 / (context x tensor = 8) = 1 tokens"),
    ("tensor=2,data=4", {"overlap": "collective_matmul", "sequence_parallel": True}, "mamba2-tiny", 32,
     "no attention blocks"),
    ("pipeline=2,tensor=4", {"overlap": "collective_matmul", "sequence_parallel": True}, "llama-tiny:layers=4", 32,
     "pipeline=2 is not supported"),
])
def test_constraints(mesh, options, model, seq, message):
    strategy = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate.check(parse_model(model), strategy, batch=8, seq=seq)
