"""DeepSeek's model: multi-head latent attention (models/mla.py), its group-limited router (models/moe.py),
and the DeepSeek-shaped model they run in.

The references are independent of the model code: a float64 numpy forward written here from DeepSeek-V2's
equations (section 2.1), the one-device training run (every strategy), the unsharded training forward
(generation, as tests/test_inference.py checks it), and a hand count of the cache (kv_lora_rank +
qk_rope_head_dim values per token and layer) against XLA's memory analysis of the cache arrays.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.core.strategy import parse_strategy
from jaxpar.cost import params
from jaxpar.cost.inference import Request, inference_estimate
from jaxpar.errors import ConfigError
from jaxpar.models import decode
from jaxpar.models.config import parse_model
from jaxpar.models.lm import LM
from jaxpar.models.mla import LatentAttention
from jaxpar.models.moe import aux_loss as model_aux_loss, balance_probe, route
from jaxpar.models.run import RunConfig
from jaxpar.ops.attention import token_permutation
from jaxpar.ops.latent_attention import absorbed_read, expanded_read
from tests import harness
from tests.test_inference import assert_matches_unsharded

MODEL = "deepseek-tiny"


# ---- the forward against the paper's equations --------------------------------------------------------

def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, positions, theta):
    """RoPE, rotate-half form, of x [b, s, h, d] in float64."""
    d = x.shape[-1]
    angles = positions[..., None].astype(np.float64) * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def mla_numpy(w: dict, x: np.ndarray, positions: np.ndarray, cfg) -> np.ndarray:
    """DeepSeek-V2 eqs. 37-47 (section 2.1.3) in float64: the query and K/V latents, the decoupled RoPE key
    shared by the heads, softmax over the causal prefix scaled by (qk_nope + qk_rope)^-1/2, then W_o."""
    eps, theta, nope = cfg.norm_eps, cfg.rope_theta, cfg.qk_nope_head_dim
    c_q = rms(x @ w["wq_a"], w["q_norm"], eps)
    q = np.einsum("bsr,rhk->bshk", c_q, w["wq_b"])
    q_c, q_r = q[..., :nope], rotate(q[..., nope:], positions, theta)
    c_kv = rms(x @ w["wkv_a"], w["kv_norm"], eps)
    k_c = np.einsum("bsc,chk->bshk", c_kv, w["wk_b"])
    k_r = rotate((x @ w["wk_rope"])[:, :, None], positions, theta)
    v = np.einsum("bsc,chk->bshk", c_kv, w["wv_b"])
    scores = (np.einsum("bqhk,bthk->bhqt", q_c, k_c) + np.einsum("bqhk,btk->bhqt", q_r, k_r[:, :, 0]))
    scores = scores / np.sqrt(nope + cfg.qk_rope_head_dim)
    s = x.shape[1]
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    out = np.einsum("bhqt,bthk->bqhk", p, v)
    return np.einsum("bqhk,hkd->bqd", out, w["wo"])


def test_latent_attention_equals_a_float64_numpy_forward():
    cfg = parse_model(MODEL)
    attn = LatentAttention(cfg, RunConfig(), rngs=nnx.Rngs(3))
    x = np.random.default_rng(0).standard_normal((2, 10, cfg.d_model)).astype(np.float32)
    positions = np.broadcast_to(np.arange(3, 13), (2, 10))
    got = attn(jnp.asarray(x), jnp.asarray(positions))
    w = {name: np.asarray(getattr(attn, name)[...], np.float64)
         for name in ("wq_a", "wq_b", "wkv_a", "wk_rope", "wk_b", "wv_b", "wo")}
    w["q_norm"], w["kv_norm"] = (np.asarray(n.scale[...], np.float64) for n in (attn.q_norm, attn.kv_norm))
    want = mla_numpy(w, x.astype(np.float64), positions, cfg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_deepseek_v2_lite_has_its_published_size():
    """DeepSeek-AI 2024 ("DeepSeek-V2", section 4.1 and its Lite model card): 15.7B parameters, 2.4B of them
    active per token besides the input embedding (a lookup, no matmul)."""
    m = parse_model("deepseek-v2-lite")
    per_expert = 3 * m.d_model * m.moe_mlp_dim
    total = params.total_params(m)
    active = total - m.moe_layers * (m.experts - m.top_k) * per_expert - m.vocab * m.d_model
    assert total == pytest.approx(15.7e9, rel=0.005)
    assert active == pytest.approx(2.4e9, rel=0.03)


# ---- the router ----------------------------------------------------------------------------------------

def route_numpy(logits: np.ndarray, bias: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's routing per token, step by step (section 2.1.2 and transformers' DeepseekV3TopkRouter):
    sigmoid scores; the choice on them plus the bias: each group scored by the sum of its two best, the
    topk_group best groups kept (the others' experts masked out), the top_k experts of what is left; their
    unbiased scores normalised, times the scaling factor."""
    ids, weights = [], []
    for row in logits.reshape(-1, logits.shape[-1]).astype(np.float64):
        s = 1.0 / (1.0 + np.exp(-row))
        groups = (s + bias).reshape(cfg.n_group, -1)
        group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        keep = np.argsort(-group_score, kind="stable")[:cfg.topk_group]
        masked = np.where(np.isin(np.arange(cfg.n_group), keep)[:, None], groups, -np.inf).reshape(-1)
        top = np.argsort(-masked, kind="stable")[:cfg.top_k]
        ids.append(top)
        weights.append(s[top] / s[top].sum() * cfg.routed_scaling_factor)
    return np.array(ids), np.array(weights)


def test_group_limited_routing_equals_the_step_by_step_reference():
    """On random logits with a random bias, and on one token built so that plain top-k would pick from 3
    groups: its experts come from its 2 best groups only, and a bias moves the choice, not the weights."""
    cfg = parse_model(f"{MODEL}:experts=16,top_k=4,n_group=4,topk_group=2")
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 7, 16)).astype(np.float32)
    handmade = np.full(16, -4.0, np.float32)
    handmade[[0, 1, 4, 5, 8]] = [3.0, 2.9, 2.8, 2.7, 3.1]   # groups 0, 1 hold two good experts, group 2 one
    logits[0, 0] = handmade
    zero = np.zeros(16, np.float32)
    for bias in (zero, (0.1 * rng.standard_normal(16)).astype(np.float32)):
        ids, weights, _ = route(jnp.asarray(logits), cfg, jnp.asarray(bias))
        want_ids, want_w = route_numpy(logits, bias, cfg)
        np.testing.assert_array_equal(np.asarray(ids).reshape(-1, 4), want_ids)
        np.testing.assert_allclose(np.asarray(weights).reshape(-1, 4), want_w, rtol=1e-5)
    assert sorted(route_numpy(logits, zero, cfg)[0][0]) == [0, 1, 4, 5]      # expert 8 (group 2) left out
    assert np.allclose(want_w.sum(-1), cfg.routed_scaling_factor)
    assert (route_numpy(logits, bias, cfg)[0] != route_numpy(logits, zero, cfg)[0]).any()   # the bias mattered


def test_the_balancing_probe_is_zero_with_the_overload_as_its_gradient():
    """Hand count: 3 tokens, top-2 of 4 experts, ids (0, 1), (0, 2), (0, 1): copies 3, 2, 1, 0 of 6, so the
    bias's gradient is 4 x copies - 6 = 6, 2, -2, -6."""
    ids = jnp.array([[[0, 1], [0, 2], [0, 1]]])
    copies = jax.nn.one_hot(ids, 4).sum(axis=(0, 1, 2))
    value, grad = jax.value_and_grad(balance_probe)(jnp.array([0.3, -0.1, 0.0, 0.2]), copies)
    assert float(value) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), [6.0, 2.0, -2.0, -6.0])


@pytest.mark.slow   # 10 s: the one-device step's compile; the bias's gradient is compared in every layout below
def test_one_step_moves_the_balancing_bias_against_the_overload():
    """One optimizer step on one device: each bias entry moves by exactly -gamma, 0 or +gamma (the sign of its
    expert's overload, not Adam's scaled step, no weight decay), the most loaded experts down and the least
    up (the step's reported moe_load_max > 1 > moe_load_min), and the loss's gradient norm leaves it out."""
    tr = harness.trainer(MODEL, "data=1", devices=1)
    state = tr.state_from_params(harness.reference_params(MODEL))
    new, metrics = tr.step(state, tr.batch(harness.source(MODEL), 0))
    gamma = parse_model(MODEL).router_bias_update
    before = {p: x for p, x in harness.leaves_with_paths(harness.reference_params(MODEL)) if "router_bias" in p}
    after = {p: x for p, x in harness.leaves_with_paths(new.params) if "router_bias" in p}
    assert after.keys() == before.keys() and after
    for path, bias in after.items():
        steps = np.round((bias - before[path]) / gamma)
        np.testing.assert_allclose(bias - before[path], steps * gamma, atol=1e-9, err_msg=path)
        assert set(np.unique(steps)) <= {-1.0, 0.0, 1.0} and (steps == -1).any() and (steps == 1).any(), steps
    assert float(metrics["moe_load_max"]) > 1 > float(metrics["moe_load_min"])


# ---- multi-token prediction ------------------------------------------------------------------------------

@pytest.mark.parametrize("depth, zigzag", [pytest.param(1, False, marks=pytest.mark.slow), (2, True)])
def test_multi_token_prediction_predicts_the_tokens_ahead(depth, zigzag):
    """The loss with mtp_depth D is the main loss + mtp_weight / D x the sum over depths k of module k's mean
    cross-entropy, computed here in logical order on the sequence cut to its first s - k positions (where
    the targets t_{i+k+1} exist): module k reads h^{k-1} and Emb(t_{i+k}) = Emb(labels_{i+k-1}), then the
    shared head and labels_{i+k}. With zigzag, the model gets the sequence stored in context parallelism's
    order (RunConfig.seq_order) and the same loss comes out."""
    cfg = parse_model(f"{MODEL}:mtp_depth={depth}")
    b, s = 2, 16
    order = token_permutation(s, 2, "zigzag") if zigzag else np.arange(s)
    model = LM(cfg, RunConfig(seq_order=tuple(int(i) for i in order) if zigzag else None), rngs=nnx.Rngs(0))
    toks = np.asarray(jax.random.randint(jax.random.key(1), (b, s + 1), 0, cfg.vocab))
    inputs, labels, pos = toks[:, :-1], toks[:, 1:], np.broadcast_to(np.arange(s), (b, s))

    @nnx.jit
    def losses(model):
        got = model(inputs[:, order], pos[:, order], labels[:, order])
        x, aux = model.apply_stack_aux(model.embed(inputs), pos)
        h = model.final_norm(x)
        want = model.cross_entropy(h, labels) + model_aux_loss(cfg, aux)
        for k, module in enumerate(model.mtp, start=1):
            n = s - k
            h, _ = module(h[:, :n], model.embed(labels[:, k - 1:k - 1 + n]), pos[:, :n])
            want = want + cfg.mtp_weight / depth * model.cross_entropy(module.norm(h), labels[:, k:k + n])
        return got, want
    got, want = losses(model)
    np.testing.assert_allclose(float(got), float(want), rtol=2e-6)


def test_multi_token_prediction_fields_are_checked():
    for spec, message in (("mtp_depth=-1", "mtp_depth must be >= 0"), ("mtp_weight=-0.1", "mtp_weight must be"),
                          ("pattern=A+3*M", "ends in a Mamba-2 block")):
        with pytest.raises(ConfigError, match=message):
            parse_model(f"{MODEL}:{spec}")


# ---- decoding: the compressed cache ---------------------------------------------------------------------

def greedy(model: LM, prompt: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [b, new], their logits [b, new, vocab]) of a greedy generation on one device."""
    b, p = prompt.shape
    graphdef, params = nnx.split(model)
    @jax.jit(static_argnums=4)
    def step(params, tokens, positions, cache, prefill, index):
        return decode.forward(nnx.merge(graphdef, params), tokens, positions, cache, index, prefill=prefill)
    cache = decode.init_cache(decode.cache_layout(model.cfg, model.run, b, p + new))
    logits, cache = step(params, prompt, np.broadcast_to(np.arange(p), (b, p)), cache, True, 0)
    tokens, all_logits = [], []
    for t in range(new):
        tokens.append(np.asarray(logits.argmax(-1)))
        all_logits.append(np.asarray(logits))
        logits, cache = step(params, tokens[-1][:, None], np.full((b, 1), p + t), cache, False, p + t)
    return np.stack(tokens, 1), np.stack(all_logits, 1)


def test_absorbed_decoding_equals_expanded_decoding():
    """The cache read absorbed (W_k_b folded into the query, W_v_b into the output) gives the logits of the
    K/V expanded back to every head, for a whole greedy generation (float32, 1e-5)."""
    cfg = parse_model(f"{MODEL}:pattern=A+E")   # one dense and one MoE layer: two compiles fewer
    params = nnx.state(LM(cfg, RunConfig(), rngs=nnx.Rngs(0)))
    prompt = np.array([[5, 6, 7, 8, 9], [1, 2, 3, 4, 10]])
    runs = [LM(cfg, RunConfig(mla_decode=read), rngs=nnx.Rngs(0)) for read in (absorbed_read, expanded_read)]
    for m in runs:
        nnx.update(m, params)
    (tok_a, log_a), (tok_e, log_e) = (greedy(m, prompt, 8) for m in runs)
    np.testing.assert_array_equal(tok_a, tok_e)
    np.testing.assert_allclose(log_a, log_e, rtol=0, atol=1e-5)


def test_the_cache_holds_the_latent_and_the_rope_key_per_token():
    """XLA's memory analysis of each cache array, added up: (kv_lora_rank + qk_rope_head_dim) x 4 bytes per
    token and layer (float32), plus each slot's int32 position."""
    cfg = parse_model(MODEL)
    b, slots = 3, 40
    layout = decode.cache_layout(cfg, RunConfig(), b, slots)
    leaves, treedef = jax.tree.flatten(layout, is_leaf=decode.is_slot)
    def held(i):
        array = lambda: jax.tree.leaves(decode.init_cache(jax.tree.unflatten(treedef, leaves)))[i]
        return jax.jit(array).lower().compile().memory_analysis().output_size_in_bytes
    per_token_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert sum(held(i) for i in range(len(leaves))) == b * slots * (cfg.layers * per_token_layer + 4)
    assert {leaf.shape[-1] for leaf in leaves if len(leaf.shape) == 4} == {cfg.kv_lora_rank, cfg.qk_rope_head_dim}


@pytest.mark.parametrize("mesh, devices", [
    pytest.param("data=2,expert=2,tensor=2", 8, marks=pytest.mark.slow),   # 5 s; one device decodes below
    pytest.param("tensor=2", 2, marks=pytest.mark.slow),
    pytest.param("expert=2", 2, marks=pytest.mark.slow),
    pytest.param("data=1", 1, marks=pytest.mark.slow),
])
def test_greedy_generation_matches_the_unsharded_forward(mesh, devices):
    """Prefill over the expanded K/V, decode absorbed from the latent cache (replicated over `tensor`)."""
    assert_matches_unsharded(MODEL, mesh, devices)


# ---- training under every layout against one device -----------------------------------------------------

@pytest.mark.parametrize("mesh, options", [
    pytest.param("expert=8", {}, marks=pytest.mark.slow),   # expert parallelism: also the pipeline case's
    ("pipeline=2,expert=2,data=2", {"microbatches": 2}),
    pytest.param("data=8", {}, marks=pytest.mark.slow),
    pytest.param("fsdp=8", {}, marks=pytest.mark.slow),
    pytest.param("data=2,tensor=4", {"sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param("data=2,expert=4", {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("data=2,context=4", {"attention": "ring"}, marks=pytest.mark.slow),
])
def test_training_matches_one_device(mesh, options):
    harness.assert_matches_one_device(MODEL, mesh, 8, **options)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", [
    # on some machines the losses part from one device's at step 3 (by 3.7e-4 relative) where others pass,
    # under both layouts alike: the biases are
    # equal through step 3, and at step 3 one token copy of the third MoE layer goes to expert 3 instead of
    # 0 (the overloads E x copies - sum read 88 / -88 against 96 / -96): a near-tie of the router's scores
    # that float32 rounding of another reduction order tips; the layout computes what one device computes,
    # up to that discrete choice. Non-strict: a run that does not tip checks the whole trajectory.
    pytest.param("expert=8", {}, marks=pytest.mark.xfail(strict=False, reason="a router near-tie, see above")),
    pytest.param("pipeline=2,expert=2,data=2", {"microbatches": 2},
                 marks=pytest.mark.xfail(strict=False, reason="a router near-tie, see above"))])
def test_a_ten_step_trajectory_and_its_bias_updates_match_one_device(mesh, options):
    """Losses, and each MoE layer's balancing bias after 10 steps (moved by the overload's sign each step)."""
    ref, ref_state = harness.trajectory(MODEL, "data=1", devices=1)
    got, state = harness.trajectory(MODEL, mesh, 8, **options)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    biases = [(p, np.asarray(x)) for p, x in harness.leaves_with_paths(state.params) if "router_bias" in p]
    want = dict((p, np.asarray(x)) for p, x in harness.leaves_with_paths(ref_state.params) if "router_bias" in p)
    assert biases and all(np.abs(b).max() > 0 for _, b in biases)
    for path, b in biases:
        np.testing.assert_allclose(b, want[path], atol=1e-7, err_msg=path)


@pytest.mark.parametrize("override, message", [
    ("kv_heads=2", "kv_heads must equal heads"),
    ("v_head_dim=16", "v_head_dim <= head_dim"),
    ("qk_rope_head_dim=3", "even qk_rope_head_dim"),
    ("head_dim=4,v_head_dim=4", "leaves no room"),
    ("n_group=3", "must be >= 1 and divide experts=8"),
    ("n_group=8", "top 2 experts"),
    ("topk_group=5", "must be in \\[1, n_group=4\\]"),
    ("top_k=6,topk_group=2", "do not fit in topk_group=2 groups of 2"),
    ("routed_scaling_factor=0", "routed_scaling_factor must be a positive"),
])
def test_the_fields_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_model(f"{MODEL}:{override}")


# ---- priced ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", ["data=8", "tensor=8", "data=2,tensor=4"])
def test_the_serving_estimate_caches_the_latent_per_token(mesh):
    """DeepSeek-V3 in bfloat16: 61 layers x (512 + 64) x 2 bytes per token, whatever `tensor` (the latent is
    replicated over it), beside each slot's int32 position; GQA of the same heads would cache 2 x 128 x 192
    values per layer, 85x more."""
    m = parse_model("deepseek-v3")
    st = parse_strategy(mesh).with_options(dtype="bfloat16").resolved(8)
    batch, prompt, new = 16, 1000, 25
    est = inference_estimate(m, st, "h100-sxm", Request("decode", batch, prompt, new))
    per_token = 61 * (512 + 64) * 2
    b = batch / st.size("data")
    assert est.cache_bytes == b * (prompt + new - 1) * (per_token + 4)
    assert est.cache_per_token.startswith(f"{per_token:,} B per token (latent 512 + RoPE key 64")
