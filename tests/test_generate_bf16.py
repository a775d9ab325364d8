"""bf16 serving weights and the prefill's attention kernel (jaxpar/serving/generate.py).

Under `dtype = bfloat16` the generator holds the parameters in bfloat16, converted once as they load
(host arrays, a jaxpar checkpoint, a Hugging Face checkpoint, a fresh initialisation), each keeping
its sharding. Checked against independent references:

- the compiled decode step's parameters, read off its per-device HLO (whose entry parameters add up to
  XLA's memory analysis `argument_size_in_bytes`), are half the float32 step's, and the float32 step's
  are 4 bytes x the parameter count;
- greedy tokens equal the float32 run's (tests/test_inference.py's, itself checked against the unsharded
  training forward), logits within bf16 tolerance (BF16_LOGITS below says why);
- `jaxpar generate --dtype bfloat16` on data=2 x tensor=4 gives the one-device bf16 run's tokens;
- a prefill with attention_kernel=blockwise gives the dense prefill's tokens and logits (float32, 1e-5).

llama-tiny runs in the default suite (four generator compiles); the Mamba-2 and hybrid models are `slow`.
"""
from __future__ import annotations

import functools
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.analysis.hlo_text import parse_module, shape_bytes
from jaxpar.cli import main as cli
from jaxpar.core.strategy import parse_strategy
from jaxpar.cost.inference import Request, inference_estimate
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.serving.generate import Generator
from jaxpar.serving.hf import load_params, read_config
from tests.test_hf import write_checkpoint
from tests.test_inference import NEW, PROMPTS, generated, host_params, saved_training_state

# bfloat16 keeps 8 significant bits: one rounding errs by up to 2^-8 of the value. The bf16 run rounds the
# weights once and the activations at every matmul input and the cache in each layer; these errors add up
# along the tiny models' 2 to 4 layers and the d_model-long float32-accumulated dot products (about 0.6-0.8%
# of the largest logit, measured). Four roundings' worth of the largest logit bounds them with room to spare,
# and is still far below the gap between the top two logits at most steps.
BF16_LOGITS = 4 * 2.0**-8
TP = "data=2,tensor=4"   # the sharded layout, on the 8 simulated devices


@functools.cache
def bf16_run(model: str):
    """(generator, parameters, greedy Result with logits) on one device under bfloat16 for PROMPTS, from
    the float32 run's parameters (tests/test_inference.py), once per module."""
    gen = Generator(parse_model(model), parse_strategy("data=1").with_options(dtype="bfloat16"), PROMPTS, NEW,
                    devices=jax.devices()[:1])
    params = gen.place_params(host_params(model))
    return gen, params, gen.generate(params, PROMPTS, keep_logits=True)


def parameter_bytes(gen: Generator) -> int:
    """Bytes of the compiled decode step's parameter arguments on one device, from its HLO: the entry
    computation's parameters in argument order (the weights' leaves come first; every weight is read, so
    none is pruned), checked to add up, with the cache and token arguments, to XLA's memory analysis."""
    compiled = gen.compiled_steps()[1]
    module = parse_module(compiled.as_text())
    entry = [i for i in module.computations[module.entry] if i.opcode == "parameter"]
    number = lambda i: int(re.search(r"parameter\((\d+)\)", i.text)[1])  # noqa: E731
    sizes = [shape_bytes(i.shape) for i in sorted(entry, key=number)]
    assert sum(sizes) == compiled.memory_analysis().argument_size_in_bytes
    return sum(sizes[:len(jax.tree.leaves(gen.abstract_params))])


def assert_close_in_bf16(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=BF16_LOGITS * np.abs(want).max())


def test_bf16_decode_step_reads_half_the_parameter_bytes():
    f32, _, _ = generated("llama-tiny", "data=1", 1)
    bf16, params, _ = bf16_run("llama-tiny")
    count = sum(a.size for a in jax.tree.leaves(host_params("llama-tiny")))
    assert parameter_bytes(f32) == 4 * count
    assert parameter_bytes(bf16) / parameter_bytes(f32) == pytest.approx(0.5, abs=1e-3)
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    assert bf16.bytes_per_device()["weights"] == 2 * count and f32.bytes_per_device()["weights"] == 4 * count
    assert bf16.cache_layout["runs"][0][0]["k"].dtype == "bfloat16"
    for gen in (f32, bf16):   # the serving cost model reads the weights in the generator's dtype
        est = inference_estimate(gen.model_cfg, gen.strategy, "h100-sxm", Request("decode", gen.batch, gen.prompt_len, NEW), compiler="cpu")
        assert est.weights_bytes == parameter_bytes(gen)


def assert_bf16_matches_float32(model: str) -> None:
    _, _, want = generated(model, "data=1", 1)
    _, _, got = bf16_run(model)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert_close_in_bf16(got.logits, want.logits)
    assert np.abs(got.logits - want.logits).max() > 0   # the run did compute in bfloat16


def test_bf16_greedy_tokens_equal_float32():
    assert_bf16_matches_float32("llama-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mamba2-tiny", "hybrid-tiny"])
def test_bf16_greedy_tokens_equal_float32_ssm(model):
    assert_bf16_matches_float32(model)


def test_bf16_tensor_parallel_equals_one_device(tmp_path):
    """`jaxpar generate --dtype bfloat16` on data=2 x tensor=4 (a fresh initialisation: training's seed-0
    one; weights over heads and mlp_dim, the K/V cache over heads, all in bf16) gives the one-device bf16
    run's greedy tokens."""
    out = tmp_path / "g.json"
    argv = ["generate", "--model", "llama-tiny", "--mesh", TP, "--dtype", "bfloat16", "--max-new-tokens", str(NEW),
            "--json", str(out), *sum((["--prompt", ",".join(map(str, p))] for p in PROMPTS), [])]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    _, _, one = bf16_run("llama-tiny")
    assert report["weights_dtype"] == "bfloat16" and report["mesh"]["tensor"] == 4
    assert report["tokens"] == one.tokens.tolist()


def assert_bf16_of(gen: Generator, params, masters) -> None:
    """`params` are bfloat16 in the generator's shardings and equal `masters` rounded to bfloat16."""
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(masters), jax.tree.leaves(gen.param_shardings), strict=True)
    for got, want, sharding in leaves:
        assert got.dtype == np.dtype("bfloat16") and got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype("bfloat16"))


def test_every_source_converts_once_keeping_shardings(tmp_path):
    """Host float32 arrays (converted on the host), float32 arrays already on the devices (a jitted
    conversion whose outputs keep the inputs' shardings, as a restored checkpoint takes), a fresh
    initialisation and a Hugging Face checkpoint all give bfloat16 parameters in the generator's shardings."""
    gen = Generator(parse_model("llama-tiny"), parse_strategy(TP).with_options(dtype="bfloat16"), PROMPTS, NEW)
    masters = host_params("llama-tiny")
    placed = gen.place_params(masters)
    assert_bf16_of(gen, placed, masters)
    wq = placed["runs"][0]["blocks"][0]["attn"]["wq"].get_value()
    assert wq.sharding.shard_shape(wq.shape)[2] == wq.shape[2] // 4   # heads over tensor
    assert_bf16_of(gen, gen.place_params(jax.device_put(masters, gen.param_shardings)), masters)
    assert_bf16_of(gen, gen.init_params(0), masters)    # the same seed as training's initialisation

    write_checkpoint(tmp_path)
    cfg = read_config(str(tmp_path))
    hf = Generator(cfg, parse_strategy("data=2,tensor=2").with_options(dtype="bfloat16"), [[1, 2]] * 2, 2,
                   devices=jax.devices()[:4])
    float32 = load_params(str(tmp_path), cfg, nnx.state(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0)))))
    assert_bf16_of(hf, hf.place_params(load_params(str(tmp_path), cfg, hf.abstract_params)), float32)


@pytest.mark.slow
def test_checkpoint_restores_float32_masters_then_converts(tmp_path):
    """A jaxpar checkpoint (float32 masters, checksummed) restores into the bf16 generator's shardings."""
    gen = Generator(parse_model("llama-tiny"), parse_strategy(TP).with_options(dtype="bfloat16"), PROMPTS, NEW)
    state = saved_training_state(tmp_path)
    restored, message = gen.restore_params(str(tmp_path))
    assert "step 7" in message
    assert_bf16_of(gen, restored, state.params)


def test_blockwise_prefill_equals_dense():
    """The prefill runs the strategy's attention_kernel (the decode step reads the cache densely): the
    blockwise kernel on left-padded prompts gives the dense run's tokens and logits (float32)."""
    _, _, dense = generated("llama-tiny", "data=1", 1)
    gen = Generator(parse_model("llama-tiny"), parse_strategy("data=1").with_options(attention_kernel="blockwise"),
                    PROMPTS, NEW, devices=jax.devices()[:1])
    assert gen.prefill_run.core.kernel == "blockwise"
    got = gen.generate(gen.place_params(host_params("llama-tiny")), PROMPTS, keep_logits=True)
    np.testing.assert_array_equal(got.tokens, dense.tokens)
    np.testing.assert_allclose(got.logits, dense.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompts, words", [
    (PROMPTS, "masks by index, but prompts of lengths [1, 3, 4, 5] are left-padded to 5 tokens"),
    ([[1, 2, 3]] * 2, "attention_kernel=cudnn needs an NVIDIA GPU, but the devices are cpu"),
])
def test_cudnn_prefill_is_refused_before_compiling(prompts, words):
    """cuDNN's kernel masks by index, which left padding defeats; and it runs on NVIDIA GPUs only."""
    strategy = parse_strategy("data=1").with_options(dtype="bfloat16", attention_kernel="cudnn")
    with pytest.raises(ConfigError, match=re.escape(words)):
        Generator(parse_model("llama-tiny"), strategy, prompts, NEW, devices=jax.devices()[:1])
