"""The Mamba-2 block under tensor, sequence and context parallelism equals one device (output and
gradients), and compiles to the collectives it promises; the Mamba LMs build and train."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax starts

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.analysis.tally import tally_compiled
from jaxpar.core.mesh import make_mesh
from jaxpar.ops.attention import token_permutation
from jaxpar.core.sharding import Layout, current_layout, param_shardings, use_layout
from jaxpar.training.trainer import run_config
from jaxpar.core.strategy import parse_inline
from jaxpar.models.config import parse_model
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.models.mamba import MambaBlock
from jaxpar.core.validate import check_mamba

# 8 heads of 8 channels in 2 groups; 4 chunks of 4 tokens per sequence, 8 tokens per context shard
CFG = parse_model("mamba2-tiny:d_model=32,ssm_head_dim=8,d_state=8,chunk=4")
BATCH, SEQ = 2, 32
# Cheaper CPU code generation (LLVM only): tests compile many small programs and run each once.
# The HLO passes, so the collectives, are the same as with the default options.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _graphdef(run: RunConfig):
    return nnx.graphdef(nnx.eval_shape(lambda: MambaBlock(CFG, run, rngs=nnx.Rngs(0))))


def graphdef():
    """The block as the strategy in force runs it: its run config picks the kernels (context-parallel
    SSD and conv under a context axis), as in training."""
    layout = current_layout()
    return _graphdef(RunConfig() if layout is None else run_config(layout.strategy))


@functools.cache
def params():
    """Host-made parameter values (no initialiser to compile). Decays are kept moderate
    (A in [-4, -1], dt about 0.02..0.13) so that state really crosses the context shards."""
    rng = np.random.default_rng(0)

    def value(path, leaf):
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if "A_log" in name:
            return np.log(rng.uniform(1.0, 4.0, shape))
        if "dt_bias" in name:
            return rng.uniform(-4.0, -2.0, shape)
        if "norm" in name or name.endswith("['D'].value"):
            return 1.0 + 0.1 * rng.normal(size=shape)
        return rng.normal(size=shape) / np.sqrt(shape[0] if len(shape) > 1 else 4.0)

    abstract = nnx.state(nnx.eval_shape(lambda: MambaBlock(CFG, RunConfig(), rngs=nnx.Rngs(0))))
    return jax.tree_util.tree_map_with_path(lambda p, a: jnp.asarray(value(p, a), jnp.float32), abstract)


def inputs(seq: int):
    rng = np.random.default_rng(seq)
    x = rng.normal(size=(BATCH, seq, CFG.d_model)).astype(np.float32)
    cot = rng.normal(size=(BATCH, seq, CFG.d_model)).astype(np.float32)   # output cotangent
    return x, cot


def forward_and_grads(state, x, cot):
    """The block's output and the gradients of sum(sin(y) * cot) (nonlinear in y, so XLA cannot
    merge forward collectives with backward ones) w.r.t. parameters and input."""
    def loss(state, x):
        y = nnx.merge(graphdef(), state)(x, None)
        return jnp.sum(jnp.sin(y) * cot), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads


def layout_for(spec: str, **options) -> Layout:
    strategy = parse_inline(spec)
    strategy = strategy.resolved(strategy.num_devices).with_options(**options)
    return Layout(make_mesh(strategy, jax.devices()[:strategy.num_devices]), strategy)


@functools.cache
def single_device():
    x, cot = inputs(SEQ)
    return jax.jit(forward_and_grads).lower(params(), x, cot).compile(FAST_COMPILE)(params(), x, cot)


def sharded(layout: Layout, fn=forward_and_grads, seq: int = SEQ):
    """Compile and run `fn` under `layout`; returns (outputs in natural token order, compiled)."""
    x, cot = inputs(seq)
    order = token_permutation(seq, layout.strategy.size("context"), layout.strategy.options.cp_layout)
    act = layout.activation("batch", "res_seq", "act_embed")
    with use_layout(layout):
        state = jax.device_put(params(), param_shardings(jax.eval_shape(params), layout))
        args = (state, jax.device_put(x[:, order], act), jax.device_put(cot[:, order], act))
        # a fresh function per layout: jit's trace cache does not see the layout (a context
        # variable), so reusing `fn` could reuse sharding constraints traced under another layout
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile(FAST_COMPILE)
    out = compiled(*args)
    undo = np.argsort(order)
    tokens = (BATCH, seq, CFG.d_model)  # activations (output, input gradient) go back to token order
    out = jax.tree.map(lambda a: np.asarray(a)[:, undo] if a.shape == tokens else np.asarray(a), out)
    return out, compiled


def forward_collectives(compiled, layout):
    return sorted((c.kind, c.axes, c.count, c.bytes) for c in tally_compiled(compiled, layout.mesh)
                  if c.phase == "forward")


# ---- numerics --------------------------------------------------------------------------------

STRATEGIES = [  # context, tensor, both, data x context; sequence parallelism and zigzag ride along
    ("context=4", {}),
    ("tensor=2", {"sequence_parallel": True}),
    ("context=4,tensor=2", {}),
    ("data=2,context=4", {"cp_layout": "zigzag"}),   # two segments per shard
]


@functools.cache
def run_strategy(spec: str, options: tuple):
    layout = layout_for(spec, **dict(options))
    return layout, *sharded(layout)


@pytest.mark.parametrize("spec,options", STRATEGIES, ids=[s + "".join(f",{k}" for k in o) for s, o in STRATEGIES])
def test_block_matches_single_device(spec, options):
    _, out, _ = run_strategy(spec, tuple(options.items()))
    expect = single_device()
    leaves, ref = jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(expect)
    assert len(leaves) == len(ref)
    for (path, got), want in zip(leaves, ref):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)),
                                   err_msg=f"{spec} {options}: {jax.tree_util.keystr(path)}")


# ---- compiled communication ------------------------------------------------------------------

def forward(state, x, cot):
    return nnx.merge(graphdef(), state)(x, None)


def test_tensor_parallel_forward_has_one_all_reduce():
    """Column-parallel in_proj, local conv/SSD/group norm, row-parallel out_proj: one all-reduce
    of the [b, s, d_model] output per layer in forward, nothing else. (Compiled forward-only: in a
    forward+backward program XLA may combine it with an independent backward all-reduce.)"""
    layout = layout_for("tensor=2")
    compiled = sharded(layout, forward)[1]
    assert forward_collectives(compiled, layout) == [("all-reduce", ("tensor",), 1, BATCH * SEQ * CFG.d_model * 4)]


def test_sequence_parallel_forward_gathers_and_scatters():
    """With SP: all-gather the sequence before in_proj, reduce it back to sequence shards after
    out_proj (a reduce-scatter; XLA's CPU pipeline emits it as all-reduce + slice)."""
    layout, _, compiled = run_strategy("tensor=2", (("sequence_parallel", True),))
    ops = forward_collectives(compiled, layout)
    full = BATCH * SEQ * CFG.d_model * 4
    assert len(ops) == 2 and ("all-gather", ("tensor",), 1, full) in ops
    assert [op for op in ops if op[0] != "all-gather"] in ([("all-reduce", ("tensor",), 1, full)],
                                                           [("reduce-scatter", ("tensor",), 1, full)])


def test_sequence_parallel_backward_has_one_activation_all_reduce():
    """The five in_proj weights are packed into one matmul, so backward reduces ONE partial input
    gradient over `tensor` (plus the replicated norm scale's few bytes), not one per projection."""
    layout, _, compiled = run_strategy("tensor=2", (("sequence_parallel", True),))
    full = BATCH * SEQ * CFG.d_model * 4
    backward = [c for c in tally_compiled(compiled, layout.mesh) if c.phase == "backward"]
    reduced = sum(c.bytes for c in backward if c.kind in ("all-reduce", "reduce-scatter"))
    assert full <= reduced <= full + 1024, backward
    assert {c.kind for c in backward} <= {"all-gather", "all-reduce", "reduce-scatter"}


def test_context_parallel_traffic_is_states_and_halo_only():
    """Forward under context=4: one all-gather of the shards' final states (with their decays) and
    one permute of the conv halo; their size does not grow with the sequence length."""
    layout = layout_for("context=4")
    tallies = [forward_collectives(sharded(layout, forward, seq)[1], layout) for seq in (SEQ, 2 * SEQ)]
    assert tallies[0] == tallies[1]
    h, p, n, k = CFG.ssm_heads, CFG.ssm_head_dim, CFG.d_state, CFG.d_conv
    halo = BATCH * (k - 1) * (h * p + 2 * CFG.ngroups * n) * 4               # x, B, C tails, packed
    states = 4 * BATCH * h * (p * n + 1) * 4                                  # 4 shards' states + decays
    kinds = {(kind, axes): (count, size) for kind, axes, count, size in tallies[0]}
    assert kinds[("collective-permute", ("context",))] == (1, halo)
    assert kinds[("all-gather", ("context",))] == (1, states)
    assert set(kinds) == {("collective-permute", ("context",)), ("all-gather", ("context",))}


# ---- configuration checks --------------------------------------------------------------------

@pytest.mark.parametrize("tensor,context,seq,layout,message", [
    (4, 1, 64, "contiguous", "tensor=4 does not divide ngroups=2"),
    (16, 1, 64, "contiguous", "tensor=16 does not divide ssm heads=8"),
    (1, 3, 64, "contiguous", "context=3 does not divide seq=64"),
    (1, 4, 36, "zigzag", r"2 x context=8 \(zigzag\) does not divide seq=36"),
    (1, 32, 64, "contiguous", "fewer than the conv halo d_conv-1 = 3"),
])
def test_check_mamba_names_the_constraint(tensor, context, seq, layout, message):
    with pytest.raises(ConfigError, match=message):
        check_mamba(parse_model("mamba2-tiny"), tensor=tensor, context=context, seq=seq, cp_layout=layout)
    check_mamba(parse_model("mamba2-tiny"), tensor=2, context=4, seq=32, cp_layout="zigzag")  # fine


# ---- whole models ----------------------------------------------------------------------------

def lm_step(name: str):
    cfg = parse_model(name)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, size=(2, 17))
    positions = np.broadcast_to(np.arange(16), (2, 16))
    step = jax.jit(jax.value_and_grad(lambda s: nnx.merge(graphdef, s)(tokens[:, :-1], positions, tokens[:, 1:])))
    return cfg, abstract, step


@pytest.mark.parametrize("name", ["mamba2-tiny", "hybrid-tiny"])
def test_mamba_models_trace(name):
    """Both presets build (abstractly) and trace forward + gradient: shapes and structure."""
    cfg, abstract, step = lm_step(name)
    loss, grads = jax.eval_shape(step, abstract)
    assert loss.shape == () and jax.tree.structure(grads) == jax.tree.structure(abstract)


@pytest.mark.slow  # ~10 s of compilation each; the traces above are the quick check
@pytest.mark.parametrize("name", ["mamba2-tiny", "hybrid-tiny"])
def test_mamba_models_train(name):
    """Both presets run forward + gradient on one device with finite, non-zero gradients."""
    cfg, abstract, step = lm_step(name)
    rng = np.random.default_rng(1)  # host-made values: no initialiser to compile
    state = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.normal(size=a.shape), a.dtype), abstract)
    loss, grads = step.lower(state).compile(FAST_COMPILE)(state)
    assert np.isfinite(float(loss)) and abs(float(loss) - np.log(cfg.vocab)) < 2.0
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads["runs"]))
