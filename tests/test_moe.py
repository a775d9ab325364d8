"""Mixture of experts (models/moe.py, jaxpar/ops/moe.py): the dispatch kernel against a per-expert loop,
expert parallelism against the local kernel, whole models against one device, and the checks around them.

(a) `local_moe` equals an independent reference (a Python loop over groups, choices and tokens in
    float64 for the queue and the forward; a per-expert masked sum for the gradients), dropless and
    with a capacity, the dropped copies being exactly the reference's.
(b) The shard_map kernel (expert = 2, 4, 8, beside data, fsdp, tensor and context) equals the local
    kernel on one device: outputs, kept copies and every gradient, rtol 1e-5.
(c) Whole models: loss and every gradient of moe-tiny (and variants) on mesh strategies equal one
    device (tests/harness.py; the catalogue's ep* strategies run in tests/test_strategies.py).
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxpar.cli import main as cli
from jaxpar.errors import ConfigError
from jaxpar.core.mesh import make_mesh
from jaxpar.ops.moe import group_capacity, local_moe, moe_experts
from jaxpar.core.sharding import Layout, spec_for, use_layout
from jaxpar.core.strategy import parse_strategy
from jaxpar.models.config import parse_model
from tests import harness

G, S, D, E, K, F = 8, 16, 16, 8, 2, 16     # groups, tokens per group, model dim, experts, top-k, expert width
MODES = {"dropless": 0.0, "capacity": 1.0}


@functools.cache
def inputs(skewed: bool):
    """Tokens, distinct top-k ids (skewed: most copies want experts 0-2, so a capacity drops many),
    weights and experts, float32."""
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(G, S, E)) + (np.array([3.0, 2.5, 2.0] + [0.0] * (E - 3)) if skewed else 0.0)
    ids = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
    f32 = lambda *shape, scale=1.0: (scale * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
    return dict(x=f32(G, S, D), ids=ids, weights=rng.uniform(0.1, 1.0, (G, S, K)).astype(np.float32),
                w_gate=f32(E, D, F, scale=D ** -0.5), w_up=f32(E, D, F, scale=D ** -0.5),
                w_down=f32(E, F, D, scale=F ** -0.5), cot=f32(G, S, D))


def reference_kept(ids: np.ndarray, capacity: int) -> np.ndarray:
    """The queue, spelled out: per group, every token's choice 1 in token order, then choice 2, ...;
    an expert keeps its first `capacity` copies."""
    kept = np.zeros(ids.shape, bool)
    for g in range(ids.shape[0]):
        taken = np.zeros(E, int)
        for j in range(ids.shape[2]):
            for t in range(ids.shape[1]):
                e = ids[g, t, j]
                kept[g, t, j] = taken[e] < capacity
                taken[e] += 1
    return kept


def reference_forward(a: dict, kept: np.ndarray) -> np.ndarray:
    """float64, one token copy at a time."""
    p = {k: np.asarray(v, np.float64) for k, v in a.items()}
    y = np.zeros((G, S, D))
    for g, t, j in zip(*np.nonzero(kept)):
        e, xt = a["ids"][g, t, j], p["x"][g, t]
        gate, up = xt @ p["w_gate"][e], xt @ p["w_up"][e]
        y[g, t] += p["weights"][g, t, j] * ((gate / (1 + np.exp(-gate))) * up) @ p["w_down"][e]
    return y


def reference_jax(x, weights, w_gate, w_up, w_down, *, ids, kept):
    """A per-expert masked sum: every token through each expert, weighted by its kept copies there."""
    y = jnp.zeros_like(x)
    for e in range(E):
        mask = jnp.sum(jnp.where((ids == e) & kept, weights, 0.0), axis=-1)          # [g, s]
        h = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
        y = y + mask[..., None] * (h @ w_down[e])
    return y


DIFF = ("x", "weights", "w_gate", "w_up", "w_down")


def loss_and_grads(fn, a: dict):
    """(y, kept, gradients of sum(y * cot) for DIFF) of fn(x, ids, weights, w_gate, w_up, w_down)."""
    def f(x, weights, w_gate, w_up, w_down, ids, cot):
        y, kept = fn(x, ids, weights, w_gate, w_up, w_down)
        return jnp.sum(y * cot), (y, kept)
    (_, (y, kept)), grads = jax.value_and_grad(f, argnums=range(5), has_aux=True)(
        *(a[k] for k in DIFF), a["ids"], a["cot"])
    return y, kept, dict(zip(DIFF, grads))


def assert_close(got, want, what: str, rtol: float = 1e-5) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)), err_msg=what)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@functools.cache
def local(mode: str, skewed: bool):
    a = inputs(skewed)
    cap = group_capacity(S, K, E, MODES[mode])
    def kernel(x, ids, weights, w_gate, w_up, w_down):
        return local_moe(x, ids, weights, (w_gate, w_up, w_down), capacity=cap)
    fn = jax.jit(lambda *args: loss_and_grads(kernel, dict(zip(
        (*DIFF, "ids", "cot"), args))))
    return jax.tree.map(np.asarray, fn(*(a[k] for k in (*DIFF, "ids", "cot"))))


# ---- (a) the local kernel against the reference -----------------------------------------------------

@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("mode", MODES)
def test_local_kernel_matches_the_reference(mode, skewed):
    a = inputs(skewed)
    cap = group_capacity(S, K, E, MODES[mode])
    want_kept = reference_kept(a["ids"], cap)
    y, kept, grads = local(mode, skewed)
    np.testing.assert_array_equal(kept, want_kept)
    if mode == "dropless":
        assert want_kept.all()
    elif skewed:
        assert 0.2 < 1 - want_kept.mean() < 0.8, 1 - want_kept.mean()   # a real test of the drops
    assert_close(y, reference_forward(a, want_kept), "forward (float64 reference)")
    ref = functools.partial(reference_jax, ids=jnp.asarray(a["ids"]), kept=jnp.asarray(want_kept))
    want = jax.grad(lambda *p: jnp.sum(ref(*p) * a["cot"]), argnums=range(5))(*(a[k] for k in DIFF))
    for name, g in zip(DIFF, want):
        assert_close(grads[name], g, f"d{name}")


def test_capacity_formula():
    assert group_capacity(32, 2, 8, 0.0) == 32                 # dropless: every token once per expert
    assert group_capacity(32, 2, 8, 1.25) == 10                # ceil(1.25 * 32 * 2 / 8)
    assert group_capacity(32, 2, 8, 100.0) == 32               # never more than the group's tokens
    assert group_capacity(4, 1, 64, 0.5) == 1                  # never 0


# ---- (b) expert parallelism against the local kernel ------------------------------------------------

EP_MESHES = ["expert=2", "expert=4", "expert=8", "data=2,expert=4", "expert=4,tensor=2", "fsdp=2,expert=4",
             "context=2,expert=4"]


@functools.cache
def sharded(mesh: str, mode: str, skewed: bool):
    strategy = parse_strategy(mesh)
    strategy = strategy.resolved(strategy.num_devices)
    layout = Layout(make_mesh(strategy, jax.devices()[:strategy.num_devices]), strategy)
    names = {"x": ("batch", "seq", None), "ids": ("batch", "seq", None), "weights": ("batch", "seq", None),
             "cot": ("batch", "seq", None), "w_gate": ("experts", "embed", "mlp"),
             "w_up": ("experts", "embed", "mlp"), "w_down": ("experts", "mlp", "embed")}
    order = (*DIFF, "ids", "cot")
    shardings = [NamedSharding(layout.mesh, spec_for(names[k], layout.rules(
        "activations" if names[k][0] == "batch" else "params"), layout.mesh)) for k in order]

    def run(*args):
        with use_layout(layout):
            return loss_and_grads(functools.partial(moe_experts, capacity_factor=MODES[mode]),
                                  dict(zip(order, args)))

    a = inputs(skewed)
    return jax.tree.map(np.asarray, jax.jit(run, in_shardings=shardings)(*(a[k] for k in order)))


@pytest.mark.parametrize("mesh", EP_MESHES)
@pytest.mark.parametrize("mode", MODES)
def test_expert_parallel_matches_the_local_kernel(mesh, mode):
    skewed = mode == "capacity"
    y, kept, grads = sharded(mesh, mode, skewed)
    want_y, want_kept, want_grads = local(mode, skewed)
    np.testing.assert_array_equal(kept, want_kept)
    assert_close(y, want_y, "forward")
    for name in DIFF:
        assert_close(grads[name], want_grads[name], f"d{name}")


# ---- (c) whole models against one device ------------------------------------------------------------

@pytest.mark.parametrize("model, mesh, devices, options", [
    ("moe-tiny:capacity_factor=1.0", "data=2,expert=4", 8, {}),
    ("moe-tiny:capacity_factor=1.0", "context=2,expert=4", 8, {"attention": "ring"}),
    pytest.param("moe-tiny", "data=2,context=2,tensor=2", 8, {"attention": "allgather"},   # local kernel, split sequence
                 marks=pytest.mark.slow),   # 20 s; context x expert runs above
    ("moe-tiny", "data=4,tensor=2", 8, {"sequence_parallel": True}),            # local kernel, XLA-partitioned
    ("moe-tiny:shared_experts=2,router=sigmoid,router_norm=false", "fsdp=2,expert=2,tensor=2", 8,
     {"sequence_parallel": True}),
    pytest.param("jamba-tiny", "data=2,expert=2", 4, {}, marks=pytest.mark.slow),   # 3 Mamba blocks: 12 s
])
def test_model_matches_one_device(model, mesh, devices, options):
    harness.assert_matches_one_device(model, mesh, devices, **options)


@pytest.mark.slow   # 30 s of compiles; the dense layers' equality runs in every other case
def test_dense_patterns_mix_with_moe():
    """'AE' alternates dense and MoE layers: one of each per unit, and the auxiliary losses count the
    MoE layers only."""
    cfg = parse_model("moe-tiny:pattern=AE,layers=4")
    assert (cfg.units, cfg.attention_layers, cfg.moe_layers) == (2, 2, 2)
    harness.assert_matches_one_device("moe-tiny:pattern=AE,layers=4", "expert=4", 4)


def test_training_writes_router_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code = cli.main(["train", "--model", "moe-tiny:capacity_factor=1.0", "--mesh", "ep8", "--steps", "2",
                     "--batch", "8", "--seq", "16", "--metrics", str(metrics), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert {"loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min"} <= r.keys()
        assert 0.0 < r["moe_aux_loss"] < 8.0 and r["moe_z_loss"] > 0.0     # E * sum_e f_e p_e; balanced: 1
        assert 0.0 < r["moe_dropped_fraction"] < 0.5      # capacity 4 copies per expert and sequence of 16
        assert r["moe_load_min"] <= 1.0 <= r["moe_load_max"] <= 8.0


# ---- configuration and constraints ----------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("moe-tiny:experts=0", "experts must be >= 1 with 'E' in the pattern, got 0"),
    ("moe-tiny:top_k=9", "top_k=9 must be <= experts=8"),
    ("moe-tiny:capacity_factor=-1", "capacity_factor must be a finite number >= 0, got -1.0"),
    ("moe-tiny:capacity_factor=inf", "capacity_factor must be a finite number >= 0, got inf"),
    ("moe-tiny:router=relu", "router must be softmax or sigmoid, got 'relu'"),
    ("moe-tiny:pattern=AX", "pattern must be a non-empty unit of 'A' (attention), 'M' (Mamba) and 'E'"),
])
def test_model_errors(spec, message):
    with pytest.raises(ConfigError) as e:
        parse_model(spec)
    assert message in str(e.value)


def test_presets_have_the_published_shapes():
    mixtral, ds, qwen = (parse_model(n) for n in ("mixtral-8x7b", "deepseek-v3-moe", "qwen3-30b-a3b"))
    assert (mixtral.layers, mixtral.experts, mixtral.top_k, mixtral.moe_mlp_dim) == (32, 8, 2, 14336)
    assert (ds.layers, ds.experts, ds.top_k, ds.shared_experts, ds.moe_mlp_dim, ds.router) == (
        61, 256, 8, 1, 2048, "sigmoid")
    assert (qwen.layers, qwen.experts, qwen.top_k, qwen.moe_mlp_dim, qwen.kv_heads) == (48, 128, 8, 768, 4)
    assert parse_model("jamba-tiny").pattern == "MMME"


@pytest.mark.parametrize("name, total, active, rel", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),   # Jiang et al. 2024 ("Mixtral of Experts"); Mistral AI's release
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),    # Qwen Team 2025 (Qwen3 technical report): "3.3B" to two digits
    ("deepseek-v3", 671e9, 37e9, 0.02),        # DeepSeek-AI 2024 (V3 report, abstract), without the MTP module
])
def test_the_cost_model_counts_all_experts_and_the_active_ones(name, total, active, rel):
    """Memory counts every expert; FLOPs follow the active parameters (k routed experts per token):
    the published totals and active counts, to the precision they are published with."""
    from jaxpar.cost import flops, params
    m = parse_model(name)
    assert params.total_params(m) == pytest.approx(total, rel=0.005)
    tokens = 1000.0
    expert_fwd = flops.expert_flops(m, tokens).matmul - 2 * tokens * m.top_k * m.d_model  # without the combine
    per_expert = 3 * m.d_model * m.moe_mlp_dim
    assert expert_fwd == pytest.approx(2 * tokens * m.top_k * per_expert)
    dense = params.total_params(m) - m.moe_layers * m.experts * per_expert
    assert dense + m.moe_layers * m.top_k * per_expert == pytest.approx(active, rel=rel)


def test_estimate_and_plan_take_moe_models(capsys, tmp_path):
    """`estimate` reports the all-to-alls and the experts' FLOPs; `plan` searches the expert axis."""
    out = tmp_path / "e.json"
    assert cli.main(["estimate", "--model", "mixtral-8x7b", "--mesh", "h100x64-mixtral-ep8-tp8", "--hardware",
                     "h100-sxm", "--global-batch", "512", "--seq", "4096", "--json", str(out)]) == 0
    est = json.loads(out.read_text())
    a2a = [c for c in est["collectives"] if c["kind"] == "all-to-all" and c["axes"] == ["expert"]]
    m = parse_model("mixtral-8x7b")
    # per layer: 2 forward, their 2 transposes and, under the layout's remat=full, the forward pair again
    assert sum(c["count"] for c in a2a) == 6 * m.moe_layers
    assert est["time_breakdown_s"]["expert comm"] > 0
    assert est["flops_by_block"]["moe experts"] > est["flops_by_block"]["attention qkvo"]
    capsys.readouterr()
    assert cli.main(["plan", "--model", "moe-tiny", "--hardware", "h100-sxm", "--devices", "8", "--seq", "256",
                     "--global-batch", "64", "--top", "40"]) == 0
    assert "expert" in capsys.readouterr().out


@pytest.mark.parametrize("model, mesh, options, message", [
    ("moe-tiny:experts=6", "expert=4,data=2", {}, "expert=4 does not divide experts=6"),
    ("moe-tiny", "expert=4,data=2", {"zero": 3, "fsdp_prefetch": True},
     "fsdp_prefetch with zero=3 over the expert group (data x expert = 8, fsdp=1)"),
    ("moe-tiny:capacity_factor=1.0", "context=2,expert=4", dict(attention="ring", cp_layout="zigzag"),
     "capacity_factor=1.0 with cp_layout=zigzag"),
])
def test_strategy_errors(model, mesh, options, message):
    from jaxpar.core.strategy import parse_strategy
    from jaxpar.core.validate import check
    strategy = parse_strategy(mesh).with_options(**options).resolved(8)
    with pytest.raises(ConfigError) as e:
        check(parse_model(model), strategy, batch=16, seq=32)
    assert message in str(e.value)


def test_comm_reports_the_all_to_alls_per_moe_layer():
    """The compiled ep8 step (shared with tests/test_strategies.py) holds 2 all-to-alls forward and 2
    backward per MoE layer execution, and `jaxpar comm`'s note says so."""
    from jaxpar.analysis.comm import _moe_notes
    from jaxpar.analysis.tally import tally_compiled
    tr = harness.trainer("moe-tiny", "ep8")
    tally = tally_compiled(harness.compiled_step("moe-tiny", "ep8"), tr.mesh)
    layers = parse_model("moe-tiny").moe_layers
    a2a = {c.phase: c.count for c in tally if c.kind == "all-to-all"}
    assert a2a == {"forward": 2 * layers, "backward": 2 * layers}
    assert _moe_notes(tally, tr) == [f"expert all-to-alls per MoE layer execution ({layers} per step): "
                                     "2 forward (128.00 KiB each), 2 backward (128.00 KiB each)"]
