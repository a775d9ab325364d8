"""FSDP prefetch (jaxpar/ops/fsdp_prefetch.py): the layer scan gathers the next unit's weights while the
current unit computes, forward and backward, with the same numbers as one device.

The structure is read from the compiled step: in each layer-loop body every all-gather over `fsdp`
reaches no matmul of its own iteration (it only feeds the carry: the next iteration's weights), while
without the option every gather feeds this iteration's matmuls.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.core import validate
from jaxpar.analysis import hlo_text, tally
from jaxpar.analysis.overlap import matmul_instructions
from jaxpar.errors import ConfigError
from jaxpar.core.mesh import make_mesh
from jaxpar.ops.fsdp_prefetch import prefetched_scan
from jaxpar.core.sharding import Layout, use_layout
from jaxpar.models.config import parse_model
from jaxpar.models.layers import param
from jaxpar.core.strategy import parse_strategy
from tests import harness

MESH = "data=2,fsdp=4"
PREFETCH = dict(remat="full", fsdp_prefetch=True)


def test_matches_one_device():
    harness.assert_matches_one_device("llama-tiny", MESH, 8, **PREFETCH)


def test_kernel_equals_scan_with_auxiliary_outputs():
    """The kernel alone, against `lax.scan` on one device: a toy unit with weights named like a model's
    (stacked `layers`, `embed` on fsdp) and a per-unit auxiliary output (as MoE blocks return), value and
    gradients (of the output and of the auxiliary sum)."""
    layers, d = 3, 16

    class Toy(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.w = param(rngs, (d, d), ("embed", "mlp"), std=d ** -0.5)

        def __call__(self, h):
            y = jnp.tanh(h @ self.w[...])
            return y, jnp.sum(y ** 2, keepdims=True)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Toy:   # stacked as models/lm.py stacks its units
        return Toy(rngs)

    graphdef, stacked = nnx.split(make(nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, d)), jnp.float32)
    unit = lambda h, s: nnx.merge(graphdef, s)(h)

    def objective(scan, x, stacked):
        h, aux = scan(unit, x, stacked)
        return jnp.sum(h ** 3) + 0.5 * jnp.sum(aux)

    want = jax.value_and_grad(objective, argnums=(1, 2))(jax.lax.scan, x, stacked)
    layout = Layout(make_mesh(parse_strategy("data=2,fsdp=4"), jax.devices()[:8]), parse_strategy("fsdp=4,data=2"))
    with use_layout(layout):
        got = jax.jit(jax.value_and_grad(functools.partial(objective, prefetched_scan), argnums=(0, 1)))(x, stacked)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def _loop_gathers(options: dict) -> list[tuple[int, int]]:
    """Per layer-loop body holding fsdp all-gathers: (gathers, how many reach a matmul in that body)."""
    tr = harness.trainer("llama-tiny", MESH, 8, **options)
    module = hlo_text.parse_module(harness.compiled_text("llama-tiny", MESH, 8, **options))
    positions = np.arange(tr.mesh.size).reshape(tuple(tr.mesh.shape.values()))
    ops = {o.name: o for o in tally.collective_ops(module, tr.mesh.axis_names, positions)}
    matmuls = matmul_instructions(module)
    out = []
    for instrs in module.computations.values():
        gathers = [i.name for i in instrs if i.name in ops and ops[i.name].kind == "all-gather"
                   and ops[i.name].axes == ("fsdp",) and ops[i.name].times > 1]
        if not gathers:
            continue
        users: dict[str, list[str]] = {}
        for i in instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i.name)

        def reaches_matmul(name: str) -> bool:
            seen, todo = set(), [name]
            while todo:
                for u in users.get(todo.pop(), []):
                    if u not in seen:
                        seen.add(u)
                        todo.append(u)
            return bool(seen & matmuls)
        out.append((len(gathers), sum(map(reaches_matmul, gathers))))
    return out


def test_gathers_run_one_layer_ahead():
    plain, ahead = _loop_gathers(dict(remat="full")), _loop_gathers(PREFETCH)
    assert len(plain) == len(ahead) == 2                      # the forward and the backward layer loops
    assert all(feeding > 0 for _, feeding in plain)           # plain FSDP: gather, then this layer's dots
    assert all(n > 0 and feeding == 0 for n, feeding in ahead), ahead


@pytest.mark.parametrize("mesh, options, message", [
    ("data=8", dict(remat="full"), "needs fsdp > 1 (zero=3)"),
    ("fsdp=8", dict(remat="none"), "remat=none cannot be honoured: set remat=full"),
    ("fsdp=4,pipeline=2", dict(remat="full", microbatches=2), "the pipeline gathers its stage weights once per step"),
])
def test_constraints(mesh, options, message):
    strategy = parse_strategy(mesh).with_options(fsdp_prefetch=True, **options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate.check(parse_model("llama-tiny"), strategy, batch=8, seq=32)
