"""The grouped MoE kernel (jaxpar/ops/moe_grouped.py, strategy option moe_kernel = grouped).

(a) The kernel, local and expert-parallel (bucketed all-to-all on CPU), equals a float64 loop over token
    copies written here in numpy (forward and the hand-derived gradients of sum(y * cot)), dropless and
    with a capacity; its kept copies are the queue's (tests/test_moe.py `reference_kept`), so both
    kernels drop the same copies. The padded kernel under expert parallelism equals it too.
(b) moe-tiny under the catalogue's ep* layouts equals one device with the grouped kernel (the default,
    shared with tests/test_strategies.py's compiles), and under the padded kernel on one layout.
(c) On CPU the compiled step moves the copies by all-to-all (bucketed), no ragged-all-to-all; on a
    backend with a ragged all-to-all the same kernel lowers to it (lowered here, not compiled: XLA:CPU
    has none).
(d) The cost model's collectives equal the compiled step's for both kernels under expert parallelism
    (tests/test_cost_vs_hlo.py's comparison: counts exact, bytes within 1%).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxpar.core.mesh import make_mesh
from jaxpar.core.sharding import Layout, spec_for, use_layout
from jaxpar.core.strategy import Options, catalogue, parse_strategy
from jaxpar.ops import moe_grouped
from jaxpar.ops.capacity import group_capacity
from jaxpar.ops.moe import ExpertKernel, moe_experts
from tests import harness
from tests.test_cost_vs_hlo import assert_prediction_matches
from tests.test_moe import DIFF, MODES, E, K, S, inputs, loss_and_grads, reference_kept

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


# ---- (a) the kernel against a float64 loop --------------------------------------------------------

def reference(a: dict, kept: np.ndarray) -> tuple[np.ndarray, dict]:
    """y and the gradients of sum(y * cot) for DIFF, float64, one kept token copy at a time:
    a = x Wg, b = x Wu, h = silu(a) b, o = h Wd, y_t += w o; silu'(a) = sig(a) (1 + a (1 - sig(a)))."""
    p = {k: np.asarray(v, np.float64) for k, v in a.items() if k != "ids"}
    y = np.zeros_like(p["x"])
    grads = {k: np.zeros_like(p[k]) for k in DIFF}
    for g, t, j in zip(*np.nonzero(kept)):
        e, x, w, cot = a["ids"][g, t, j], p["x"][g, t], p["weights"][g, t, j], p["cot"][g, t]
        wg, wu, wd = p["w_gate"][e], p["w_up"][e], p["w_down"][e]
        pre_g, pre_u = x @ wg, x @ wu
        sig = 1 / (1 + np.exp(-pre_g))
        h = pre_g * sig * pre_u
        o = h @ wd
        y[g, t] += w * o
        grads["weights"][g, t, j] = o @ cot
        grads["w_down"][e] += np.outer(h, w * cot)
        dh = wd @ (w * cot)
        d_g, d_u = dh * pre_u * sig * (1 + pre_g * (1 - sig)), dh * pre_g * sig
        grads["w_gate"][e] += np.outer(x, d_g)
        grads["w_up"][e] += np.outer(x, d_u)
        grads["x"][g, t] += wg @ d_g + wu @ d_u
    return y, grads


def assert_close(got, want, what: str, rtol: float = 1e-5) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)), err_msg=what)


@functools.cache
def run(mesh: str | None, mode: str, kernel: str):
    """(y, kept, gradients) of moe_experts on `mesh` (None: no layout, the local kernel)."""
    a = inputs(mode == "capacity")
    order = (*DIFF, "ids", "cot")
    fn = functools.partial(moe_experts, capacity_factor=MODES[mode], kernel=ExpertKernel(kernel))
    if mesh is None:
        step = jax.jit(lambda *args: loss_and_grads(fn, dict(zip(order, args))))
        return jax.tree.map(np.asarray, step(*(a[k] for k in order)))
    strategy = parse_strategy(mesh)
    layout = Layout(make_mesh(strategy, jax.devices()[:strategy.num_devices]), strategy)
    names = {"w_gate": ("experts", "embed", "mlp"), "w_up": ("experts", "embed", "mlp"),
             "w_down": ("experts", "mlp", "embed")}
    shardings = [NamedSharding(layout.mesh, spec_for(names[k], layout.rules("params"), layout.mesh)) if k in names
                 else NamedSharding(layout.mesh, spec_for(("batch", "seq", None), layout.rules("activations"),
                                                          layout.mesh)) for k in order]

    def step(*args):
        with use_layout(layout):
            return loss_and_grads(fn, dict(zip(order, args)))

    return jax.tree.map(np.asarray, jax.jit(step, in_shardings=shardings)(*(a[k] for k in order)))


@functools.cache
def expected(mode: str):
    a = inputs(mode == "capacity")
    kept = reference_kept(a["ids"], group_capacity(S, K, E, MODES[mode]))
    return kept, *reference(a, kept)


# expert=2 holds 4 experts per shard (a token may send both copies to one owner); expert=8 one
CASES = [(None, "grouped"), ("expert=8", "grouped"), ("expert=2", "grouped"),
         pytest.param("expert=4,tensor=2", "grouped", marks=pytest.mark.slow),
         pytest.param("context=2,expert=4", "grouped", marks=pytest.mark.slow),
         pytest.param("fsdp=2,expert=2,data=2", "grouped", marks=pytest.mark.slow),
         pytest.param("expert=4", "padded", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mesh, kernel", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_matches_a_float64_loop(mesh, kernel, mode):
    want_kept, want_y, want_grads = expected(mode)
    if mode == "capacity":
        assert 0.2 < 1 - want_kept.mean() < 0.8   # the skewed router drops many copies: a real test
    y, kept, grads = run(mesh, mode, kernel)
    np.testing.assert_array_equal(kept, want_kept)
    assert_close(y, want_y, "forward")
    for name in DIFF:
        assert_close(grads[name], want_grads[name], f"d{name}")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all as its docstring specifies it, by dense all_to_alls (XLA:CPU has none):
    rows [input_offsets[j], + send_sizes[j]) go to shard j, which writes them at output_offsets[j]."""
    n, rows, out_rows = input_offsets.shape[0], operand.shape[0], output.shape[0]
    r = np.arange(rows)
    picked = operand[jax.numpy.minimum(input_offsets[:, None] + r, rows - 1)]
    send = jax.numpy.where((r < send_sizes[:, None])[..., None], picked, 0)
    received = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)              # [source, rows, d]
    lands = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)       # where source i's rows go
    o = np.arange(out_rows)
    for i in range(n):
        inside = (o >= lands[i]) & (o < lands[i] + recv_sizes[i])
        output = jax.numpy.where(inside[:, None], received[i, jax.numpy.clip(o - lands[i], 0, rows - 1)], output)
    return output


@pytest.mark.parametrize("mesh", ["expert=2", pytest.param("expert=8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["capacity", pytest.param("dropless", marks=pytest.mark.slow)])
def test_ragged_transfer_matches_a_float64_loop(mesh, mode, monkeypatch):
    """The ragged form's offsets and sizes (GPU, TPU), run on CPU through an emulated ragged_all_to_all."""
    monkeypatch.setattr("jaxpar.ops.moe.ragged_all_to_all_runs", lambda platform: True)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    want_kept, want_y, want_grads = expected(mode)
    y, kept, grads = run.__wrapped__(mesh, mode, "grouped")
    np.testing.assert_array_equal(kept, want_kept)
    assert_close(y, want_y, "forward")
    for name in DIFF:
        assert_close(grads[name], want_grads[name], f"d{name}")


def test_masked_dot_is_ragged_dot():
    """The dense form the kernel uses inside nested vmaps on CPU (xla_workarounds.ragged_dot_nests) is
    ragged_dot's definition, rows past the groups included (zeros)."""
    rng = np.random.default_rng(0)
    xs, w = rng.normal(size=(13, 4)).astype(np.float32), rng.normal(size=(3, 4, 5)).astype(np.float32)
    sizes = np.array([4, 0, 6], np.int32)
    want = np.zeros((13, 5))
    for e, (start, size) in enumerate(zip(np.cumsum(sizes) - sizes, sizes)):
        want[start:start + size] = xs[start:start + size].astype(np.float64) @ w[e]
    assert_close(moe_grouped.masked_dot(xs, w, sizes), want, "masked_dot")
    assert_close(jax.lax.ragged_dot(xs, w, sizes), want, "ragged_dot")


def test_bucket_is_the_exact_worst_case():
    """Dropless, every token of a shard may send min(k, E/n) copies to one owner; with a capacity an
    owner keeps at most min(s, C) copies of a sequence per expert."""
    from jaxpar.ops.capacity import bucket_rows
    assert bucket_rows(2, 16, 2, 8, 8, 16) == 2 * 16 * 1      # one expert per owner: one copy per token
    assert bucket_rows(2, 16, 2, 8, 2, 16) == 2 * 16 * 2      # four experts per owner: both copies
    assert bucket_rows(2, 16, 2, 8, 2, 3) == 2 * 4 * 3        # capacity 3 per (sequence, expert)


# ---- (b) whole models against one device ----------------------------------------------------------

EP_LAYOUTS = sorted(s.name for s in harness.distinct(catalogue()) if s.num_devices == 8 and s.size("expert") > 1)


def test_grouped_is_the_default():
    assert Options().moe_kernel == "grouped"
    assert len(EP_LAYOUTS) >= 4, EP_LAYOUTS


@pytest.mark.slow   # grouped is the default kernel: tests/test_strategies.py runs moe-tiny on ep8 and ep4-tp2 in make test
@pytest.mark.parametrize("mesh", EP_LAYOUTS)
def test_model_matches_one_device(mesh):
    """Every ep* catalogue layout with the default (grouped) kernel equals one device."""
    harness.assert_matches_one_device("moe-tiny", mesh)


@pytest.mark.slow   # 25 s: GPipe's vmaps over stages and weight copies (the dense form on CPU: masked_dot)
def test_pipeline_with_data_copies_matches_one_device():
    harness.assert_matches_one_device("moe-tiny:layers=4", "pipeline=2,expert=2,data=2", microbatches=4)


@pytest.mark.slow   # the padded kernel's kernel-level case (a) runs by default in tests/test_moe.py's local one
def test_padded_model_matches_one_device():
    harness.assert_matches_one_device("moe-tiny", "dp2-ep4", moe_kernel="padded")


# ---- (c) what compiles ----------------------------------------------------------------------------

def test_cpu_compiles_the_bucketed_all_to_all():
    text = harness.compiled_text("moe-tiny", "ep8")
    assert " all-to-all(" in text or "all-to-all-start(" in text
    assert "ragged-all-to-all" not in text and "ragged_all_to_all" not in text


def test_ragged_backends_lower_to_ragged_all_to_all(monkeypatch):
    """Where the platform rule says so, forward and backward lower to ragged_all_to_all (not compiled:
    XLA:CPU does not implement it)."""
    monkeypatch.setattr("jaxpar.ops.moe.ragged_all_to_all_runs", lambda platform: True)
    a = inputs(False)
    strategy = parse_strategy("expert=8")
    layout = Layout(make_mesh(strategy, jax.devices()[:8]), strategy)

    def step(*args):
        with use_layout(layout):
            return loss_and_grads(functools.partial(moe_experts, kernel=ExpertKernel("grouped")),
                                  dict(zip((*DIFF, "ids", "cot"), args)))

    text = jax.jit(step).lower(*(a[k] for k in (*DIFF, "ids", "cot"))).as_text()
    assert text.count("ragged_all_to_all") >= 4, "2 forward and their 2 transposes"


# ---- (d) the cost model against the compiled collectives -----------------------------------------

# data=4,expert=2: 4 experts per owner, so the bucket (both copies of a token may go to one owner) is
# half the padded buffer; ep8 is tests/test_strategies.py's compile
COST_CASES = [("moe-tiny", "data=4,expert=2", {}), ("moe-tiny", "ep8", {}),
              pytest.param("moe-tiny", "ep8", {"moe_kernel": "padded"}, marks=pytest.mark.slow),
              pytest.param("moe-tiny:capacity_factor=1.0", "data=4,expert=2", {"remat": "full"},
                           marks=pytest.mark.slow),
              pytest.param("moe-tiny", "data=2,context=2,expert=2", {"attention": "ring"}, marks=pytest.mark.slow)]


@pytest.mark.parametrize("model, mesh, options", COST_CASES)
def test_cost_model_matches_the_compiled_collectives(model, mesh, options):
    assert_prediction_matches(model, mesh, **options)


# ---- the benchmark ----------------------------------------------------------------------------------

@pytest.mark.slow   # two compiles in a subprocess: ~20 s
def test_benchmark_quick_mode():
    """experiments/bench_moe_kernel.py --quick prints both kernels with the CPU caveat; its figures against
    independent counts: the expert FLOPs per token are k (grouped) or E (padded, dropless) SwiGLUs plus the
    k-way combine, and under ep8 (one expert per owner) the bucket equals the padded buffer, so the compiled
    all-to-all bytes agree, with the cost model's CPU figure and above its GPU (ragged) one."""
    import subprocess
    import sys
    from jaxpar.models.config import parse_model
    from tests.experiments_read import EXPERIMENTS, ROOT
    run = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_moe_kernel.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CPU caveat" in run.stdout
    rows = {tuple(line.split()[:2]): [float(v.replace(",", "")) for v in line.split()[2:]]
            for line in run.stdout.splitlines() if line.startswith("ep8 ")}
    grouped, padded = rows[("ep8", "grouped")], rows[("ep8", "padded")]
    m = parse_model("moe-tiny")
    for row, copies in ((grouped, K), (padded, E)):
        want = m.moe_layers * (6 * m.d_model * m.moe_mlp_dim * copies + 2 * K * m.d_model) / 1e6
        assert row[1] == pytest.approx(want, abs=1e-4)
    assert grouped[3] == padded[3] == grouped[4] > grouped[5]
