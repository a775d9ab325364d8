"""Generation (jaxpar/serving/generate.py, models/decode.py) against the unsharded training forward.

The reference is independent of the decode path: the training model's full forward (no cache, one
device) over each prompt followed by the tokens the generator produced. Its logits at each prompt's
last token and at every generated token must equal the generator's prefill and decode logits
(float32, 1e-5): prefill + N decode steps = one forward over prompt + N tokens. And every greedy
token must be the argmax of the reference logits before it: by induction over the steps, the
generated sequence is the unsharded model's greedy sequence.

Each (model, mesh) is compiled once per module (`generated`); the default run covers one unsharded
and three sharded layouts (data x tensor; tensor > kv_heads in a hybrid stack), the wider sweep is
`slow`.
"""
from __future__ import annotations

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main as cli
from jaxpar.errors import ConfigError
from jaxpar.serving.generate import Generator, Sampling, pad_prompts, sample
from jaxpar.core.strategy import parse_strategy
from jaxpar.models import decode
from jaxpar.models.config import parse_model
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [4], [10, 11, 12, 13]]  # lengths 5, 3, 1, 4: left-padded to 5
NEW = 4


@functools.cache
def host_params(model: str):
    """The model's parameters as training initialises them (seed 0), on the host."""
    return jax.tree.map(np.asarray, nnx.state(LM(parse_model(model), RunConfig(), rngs=nnx.Rngs(0))))


@functools.cache
def full_forward(model: str):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: LM(parse_model(model), RunConfig(), rngs=nnx.Rngs(0))))
    return jax.jit(lambda params, tokens: decode.full_logits(nnx.merge(graphdef, params), tokens))


def reference_logits(model: str, generated: np.ndarray) -> np.ndarray:
    """[b, NEW, vocab]: the one-device full forward's logits where each generated token was predicted."""
    lengths = [len(p) for p in PROMPTS]
    seq = np.zeros((len(PROMPTS), max(lengths) + NEW), np.int32)  # right-padded; causal: the tail is unread
    for i, (prompt, new) in enumerate(zip(PROMPTS, generated)):
        seq[i, :len(prompt) + NEW] = [*prompt, *new]
    logits = np.asarray(full_forward(model)(host_params(model), jnp.asarray(seq)))
    return np.stack([logits[i, n - 1:n - 1 + NEW] for i, n in enumerate(lengths)])


def generated(model: str, mesh: str, devices: int = 8):
    """(generator, its parameters, its greedy Result with logits) for PROMPTS, once per module."""
    return _generated(model, mesh, devices)


@functools.cache
def _generated(model: str, mesh: str, devices: int):
    gen = Generator(parse_model(model), parse_strategy(mesh), PROMPTS, NEW, devices=jax.devices()[:devices])
    params = gen.place_params(host_params(model))
    return gen, params, gen.generate(params, PROMPTS, keep_logits=True)


def assert_matches_unsharded(model: str, mesh: str, devices: int = 8) -> None:
    _, _, result = generated(model, mesh, devices)
    ref = reference_logits(model, result.tokens)
    np.testing.assert_allclose(result.logits, ref, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(result.tokens, ref.argmax(-1))


@pytest.mark.parametrize("model, mesh, devices", [
    ("llama-tiny", "data=1", 1),
    ("llama-tiny", "data=2,tensor=4", 8),
    ("mamba2-tiny", "data=4,tensor=2", 8),
    ("hybrid-tiny:ngroups=8", "tensor=8", 8),   # tensor 8 > kv_heads 4: K/V heads replicated x2
])
def test_greedy_generation_matches_the_unsharded_forward(model, mesh, devices):
    assert_matches_unsharded(model, mesh, devices)


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh", [
    *[("llama-tiny", f"tensor={t}") for t in (1, 2, 4, 8)],
    *[("llama-tiny:kv_heads=2", f"tensor={t}") for t in (2, 4, 8)],   # tensor > kv_heads at 4 and 8
    ("llama-tiny", "fsdp=2,tensor=4"), ("llama-tiny", "data=4,tensor=2"), ("llama-tiny", "data=2,fsdp=2,tensor=2"),
    *[("mamba2-tiny", f"tensor={t}") for t in (1, 2)],
    *[("mamba2-tiny:ngroups=8", f"tensor={t}") for t in (4, 8)],
    *[("hybrid-tiny", f"tensor={t}") for t in (1, 2)], ("hybrid-tiny", "data=4,tensor=2"),
    ("hybrid-tiny:ngroups=8", "data=2,tensor=4"),
])
def test_greedy_generation_sweep(model, mesh):
    assert_matches_unsharded(model, mesh, parse_strategy(mesh).num_devices)


def test_cache_is_sharded_like_a_parameter():
    """K/V heads over tensor (one replicated head per rank when tensor > kv_heads), sequences over the
    data axes; a Mamba layer's state is the same size for any cache length."""
    gen, _, _ = generated("llama-tiny", "data=2,tensor=4")
    k = gen.cache_layout["runs"][0][0]["k"]                        # [units, b, S, kv_heads, head_dim]
    assert gen.cache_shardings["runs"][0][0]["k"].shard_shape(k.shape) == (2, 2, k.shape[2], 8 // 4, 8)
    gen, _, _ = generated("hybrid-tiny:ngroups=8", "tensor=8")
    assert gen.kv_copies == 2
    k = gen.cache_layout["runs"][0][3]["k"]                        # the A of MMMA
    assert k.shape[3] == 8 and gen.cache_shardings["runs"][0][3]["k"].shard_shape(k.shape)[3] == 1
    ssm = gen.cache_layout["runs"][0][0]["ssm"]
    assert gen.cache_shardings["runs"][0][0]["ssm"].shard_shape(ssm.shape)[2] == 1   # 8 ssm heads / tensor 8
    cfg = parse_model("mamba2-tiny")
    short, long = (decode.cache_layout(cfg, RunConfig(), 4, n) for n in (16, 16384))
    assert short == long and short["pos"].shape == (4, 0)   # no slot positions without attention


@pytest.mark.parametrize("model, mesh", [("llama-tiny", "data=2,tensor=4"), ("hybrid-tiny:ngroups=8", "tensor=8")])
def test_steps_donate_the_cache_and_never_move_it(model, mesh):
    """Both steps alias the cache's buffers to the updated cache, and their only collectives are the
    row-parallel all-reduces and the all-gather of each tensor rank's best (value, id) for sampling."""
    gen, _, _ = generated(model, mesh)
    for compiled in gen._compiled:  # noqa: SLF001 (prefill, decode)
        text = compiled.as_text()
        assert "input_output_alias" in text
        kinds = re.findall(r"= \w+\[([\d,]*)\]\S* (all-gather|all-to-all|collective-permute|reduce-scatter)\(", text)
        assert kinds and "all-reduce(" in text  # (vocab-sharded argmax; row-parallel projections)
        for shape, kind in kinds:
            assert kind == "all-gather" and math.prod(map(int, shape.split(","))) <= len(PROMPTS) * 8, (kind, shape)


def test_left_padding():
    tokens, positions = pad_prompts([[7, 8, 9], [4]], 4)
    np.testing.assert_array_equal(tokens, [[0, 7, 8, 9], [0, 0, 0, 4]])
    pad = decode.PAD_POSITION
    np.testing.assert_array_equal(positions, [[pad, 0, 1, 2], [pad, pad, pad, 0]])


# ---- sampling --------------------------------------------------------------------------------------

def test_sampling_rules():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.key(0), 256)
    draw = jax.jit(jax.vmap(lambda k, s: sample(logits, k, s), in_axes=(0, None)), static_argnums=1)
    best = np.argmax(logits, -1)
    np.testing.assert_array_equal(sample(logits, keys[0], Sampling()), best)                # greedy
    np.testing.assert_array_equal(draw(keys, Sampling(temperature=2.0, top_k=1))[0], best)  # top-1
    np.testing.assert_array_equal(draw(keys, Sampling(temperature=2.0, top_p=1e-6))[0], best)
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    drawn = np.asarray(draw(keys, Sampling(temperature=5.0, top_k=3)))                      # [keys, b]
    for row in range(3):
        assert set(drawn[:, row]) == set(top3[row])          # all three, and nothing else, are drawn
    probs = np.asarray(jax.nn.softmax(logits, -1))
    order = np.argsort(-probs, -1)
    drawn = np.asarray(draw(keys, Sampling(temperature=1.0, top_p=0.6)))
    for row in range(3):  # the smallest set of most likely tokens whose mass reaches 0.6
        n = int(np.searchsorted(np.cumsum(probs[row, order[row]]), 0.6)) + 1
        assert set(drawn[:, row]) <= set(order[row, :n])
    again = np.asarray(draw(keys, Sampling(temperature=1.0, top_p=0.6)))
    np.testing.assert_array_equal(drawn, again)                                             # seeded


def test_seeded_sampling_through_the_generator():
    gen = Generator(parse_model("llama-tiny"), parse_strategy("data=2,tensor=4"), PROMPTS, NEW,
                    Sampling(temperature=1.0, top_k=5))
    _, params, _ = generated("llama-tiny", "data=2,tensor=4")
    a, b, c = (gen.generate(params, PROMPTS, seed=s, keep_logits=True) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    top5 = np.argsort(-a.logits, -1)[..., :5]
    assert (a.tokens[..., None] == top5).any(-1).all()


# ---- the command line and checkpoints --------------------------------------------------------------

def test_cli_generate_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    argv = ["generate", "--model", "llama-tiny", "--mesh", "data=2,tensor=4", "--max-new-tokens", str(NEW),
            "--json", str(out)]
    for prompt in PROMPTS:
        argv += ["--prompt", ",".join(map(str, prompt))]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    _, _, result = generated("llama-tiny", "data=2,tensor=4")
    assert report["tokens"] == result.tokens.tolist()  # fresh initialisation (seed 0) = training's
    assert report["mesh"]["tensor"] == 4 and report["prompt_lengths"] == [5, 3, 1, 4]
    assert report["time_to_first_token_s"] > 0 and report["per_token_latency_s"] > 0
    assert len(report["decode_step_s"]) == NEW - 1 and report["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "time to first token" in printed and "prompt 3 (4 tokens) ->" in printed


def saved_training_state(directory):
    """A llama-tiny training state (seed 3) saved as the checkpoint of step 7 in `directory`; returned."""
    from jaxpar.training.checkpoint import Checkpointer  # noqa: PLC0415
    from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: PLC0415

    trainer = Trainer(parse_model("llama-tiny"), parse_strategy("data=1"), TrainConfig(batch=1, seq=8, seed=3),
                      devices=jax.devices()[:1])
    state = trainer.init_state()
    ckpt = Checkpointer(str(directory), every=1)
    ckpt.maybe_save(7, state, trainer, force=True)
    ckpt.close()
    return state


def test_restore_trained_parameters(tmp_path):
    """A training checkpoint's parameters restore onto the inference mesh; another model's is refused."""
    state = saved_training_state(tmp_path)
    gen, _, _ = generated("llama-tiny", "data=2,tensor=4")
    params, message = gen.restore_params(str(tmp_path))
    assert "step 7" in message
    saved, restored = jax.tree.leaves(state.params), jax.tree.leaves(params)
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    gen, _, _ = generated("hybrid-tiny:ngroups=8", "tensor=8")
    with pytest.raises(ConfigError, match="written for a different model"):
        gen.restore_params(str(tmp_path))


def test_generate_reads_the_model_from_the_checkpoint(tmp_path, capsys):
    """Without --model, generate takes the model the --checkpoint was written for; with neither, one line."""
    saved_training_state(tmp_path / "ck")
    assert cli.main(["generate", "--mesh", "data=2,tensor=4", "--checkpoint", str(tmp_path / "ck"), "--prompt", "1,2,3",
                     "--prompt", "4", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "model llama-tiny: 2 layers" in out and "restored" in out and "of step 7" in out
    assert cli.main(["generate", "--mesh", "data=2,tensor=4", "--prompt", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: generate needs --model M, or --checkpoint DIR "
                                               "(a `train --ckpt-dir`, whose model it reads)")


# ---- bad input -------------------------------------------------------------------------------------

BASE = ["generate", "--model", "llama-tiny", "--mesh", "data=2,tensor=4", "--prompt", "1,2,3", "--prompt", "4"]


@pytest.mark.parametrize("change, words", [
    (["--max-new-tokens", "254"], ["longest prompt (3 tokens) + max_new_tokens=254 = 257", "max_seq=256"]),
    (["--prompt", "5"], ["batch=3 prompts is not divisible by the data-parallel size data=2"]),
    (["--prompt", ""], ["argument --prompt", "empty prompt"]),
    (["--prompt", "1,x"], ["argument --prompt", "not a comma-separated list"]),
    (["--prompt", "1,256"], ["prompt 2 has token id 256", "[0, 256)"]),
    ({"--model": "moe-tiny:capacity_factor=1.25"}, ["capacity_factor=1.25", "dropless"]),
    ({"--mesh": "data=2,pipeline=2,tensor=2"}, ["pipeline=2", "not implemented yet"]),
    ({"--mesh": "data=2,context=2,tensor=2"}, ["context=2", "context-parallel prefill"]),
    (["--sequence-parallel"], ["--sequence-parallel is not an option of generate", "train"]),
    ({"--model": "llama-tiny:heads=24,kv_heads=3", "--mesh": "tensor=8"},
     ["tensor=8 > kv_heads=3", "multiple of kv_heads"]),
    (["--top-k", "5"], ["--top-k 5", "--temperature 0 is greedy"]),
    (["--temperature", "1", "--top-k", "300"], ["--top-k 300 exceeds the model's vocab=256"]),
    (["--checkpoint-step", "3"], ["--checkpoint-step 3 needs --checkpoint"]),
    (["--checkpoint", "/nonexistent/ck"], ["--checkpoint", "no such directory"]),
    ({"--mesh": "tensor=4"}, ["axis product 4", "device count 8"]),
], ids=["past-max-seq", "batch-vs-data", "empty-prompt", "bad-id", "id-past-vocab", "moe", "pipeline", "context",
        "sequence-parallel", "tensor-vs-kv-heads", "top-k-greedy", "top-k-past-vocab", "step-without-checkpoint",
        "no-checkpoint-dir", "device-count"])
def test_bad_input(change, words, capsys):
    """`change`: flags to set (a dict) or arguments to append (a list) to a valid command line."""
    argv = list(BASE)
    if isinstance(change, dict):
        for flag, value in change.items():
            argv[argv.index(flag) + 1] = value
    else:
        argv += change
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("text, words", [
    ("", ["holds no prompt"]),
    ("1 2 3\n\n4, x\n", ["line 3", "not a comma-separated list"]),
    ("1 2\n-4\n", ["line 2", "must be >= 0"]),
], ids=["empty", "not-an-id", "negative"])
def test_bad_prompt_file(tmp_path, text, words, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    argv = [a for a in BASE if a not in ("--prompt", "1,2,3", "4")] + ["--prompt-file", str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_generator_refuses_before_compiling():
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        Generator(parse_model("llama-tiny"), parse_strategy("data=1"), [[1], []], 2, devices=jax.devices()[:1])


def assert_collectives_as_estimated(compiled, mesh, est, what: str = "") -> dict:
    """A compiled generation step's collectives (the HLO tally, scalars aside) equal an inference estimate's
    per kind and axes: counts exact, bytes within 1%. Returns the compiled {(kind, axes): [count, bytes]}."""
    from jaxpar.analysis import tally
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    got: dict = {}
    for op in tally.collective_ops(compiled.as_text(), mesh.axis_names, ids):
        if op.bytes > op.scalar_bytes:
            acc = got.setdefault((op.kind, op.axes), [0, 0])
            acc[0] += op.times
            acc[1] += op.times * (op.bytes - op.scalar_bytes)
    want = {(c.kind, c.axes): [c.count, c.bytes] for c in est.collectives}
    assert want.keys() == got.keys(), (what, want, got)
    for key, (count, nbytes) in got.items():
        assert want[key][0] == count and want[key][1] == pytest.approx(nbytes, rel=0.01), (what, key, want, got)
    return got


@pytest.mark.parametrize("model, mesh", [("llama-tiny", "data=2,tensor=4"), ("hybrid-tiny:ngroups=8", "tensor=8")])
def test_steps_collectives_and_cache_equal_the_cost_model(model, mesh):
    """jaxpar/cost/inference.py for XLA:CPU against the compiled prefill and decode steps (the HLO tally,
    scalars aside): counts exact, bytes within 1% per kind and axes; and the cache bytes per device it
    predicts are the generator's cache shards (K/V replicated x2 across tensor ranks in the hybrid)."""
    from jaxpar.cost.inference import Request, inference_estimate
    gen, _, _ = generated(model, mesh)
    for phase, compiled in zip(("prefill", "decode"), gen._compiled):  # noqa: SLF001
        est = inference_estimate(gen.model_cfg, gen.strategy, "h100-sxm", Request(phase, gen.batch, gen.prompt_len, NEW), compiler="cpu")
        assert_collectives_as_estimated(compiled, gen.mesh, est, phase)
    shards = sum(math.prod(sh.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
                 for s, sh in zip(jax.tree.leaves(gen.cache_layout, is_leaf=decode.is_slot),
                                  jax.tree.leaves(gen.cache_shardings)))
    assert est.cache_bytes == pytest.approx(shards, rel=1e-9)


def test_cli_comm_tallies_a_decode_step(tmp_path, capsys):
    """`jaxpar comm --phase decode`: the compiled decode step's collectives, hand-counted for llama-tiny
    (2 layers) on data=2 x tensor=4: the vocab-parallel embedding's sum and 2 row-parallel sums per layer
    of [b/2, 1, d] float32, and the sampling's 2 gathers."""
    out = tmp_path / "decode.json"
    assert cli.main(["comm", "--model", "llama-tiny", "--mesh", "data=2,tensor=4", "--phase", "decode",
                     "--batch", "4", "--seq", "5", "--gen-len", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ar = [c for c in report["collectives"] if c["kind"] == "all-reduce"]
    assert sum(c["count"] for c in ar) == 1 + 2 * 2 and sum(c["bytes"] for c in ar) == 5 * 2 * 1 * 64 * 4
    assert {c["kind"] for c in report["collectives"]} == {"all-reduce", "all-gather"}
    assert "decode" in capsys.readouterr().out


def test_mamba_decode_memory_is_flat_in_the_cache_length():
    """The compiled decode step of an attention-free model needs the same memory (XLA's memory analysis:
    arguments, outputs, temporaries) for a 1k and a 16k cache; the cost model says the same state bytes."""
    from jaxpar.cost.inference import cache_bytes
    model = parse_model("mamba2-tiny:max_seq=16400")
    sizes = []
    for new in (1020, 16380):
        gen = Generator(model, parse_strategy("data=2,tensor=2"), [[1, 2, 3, 4]] * 2, new, devices=jax.devices()[:4])
        m = gen.compiled_steps()[1].memory_analysis()
        sizes.append((m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes))
    assert sizes[0] == sizes[1], sizes
    assert cache_bytes(model, gen.strategy, 2, 4 + 1020 - 1) == cache_bytes(model, gen.strategy, 2, 4 + 16380 - 1)
