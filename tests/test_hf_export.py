"""`jaxpar export CHECKPOINT_DIR --to hf OUT_DIR` (jaxpar/serving/hf_export.py) against the files transformers writes.

The references: checkpoints written by transformers itself (tests/data/hf_llama, tests/data/hf_mamba; their
make_golden.py scripts, run once by hand in a separate environment). Each is imported and exported again, and
every tensor (name, shape, dtype, value) and every config key the importer reads must equal the golden
file's: a transposed or misordered weight cannot pass, since none of them is symmetric. A checkpoint jaxpar
trained under fsdp4 x tp2 exports and loads back equal, bitwise in float32 and as the cast in bfloat16.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from jaxpar.cli import main as cli
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models import decode
from jaxpar.models.config import parse_model
from jaxpar.models.lm import LM
from jaxpar.models.run import RunConfig
from jaxpar.serving import hf_export
from jaxpar.serving.hf import load_params, read_config
from jaxpar.training import tokenizer as tokenizers
from jaxpar.training.checkpoint import Checkpointer, restore_params
from jaxpar.training.trainer import TrainConfig, Trainer

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN = {"llama": DATA / "hf_llama" / "llama", "mamba2": DATA / "hf_mamba" / "mamba2",
          **{name: DATA / "hf_moe" / name for name in ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn")}}
LLAMA = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
         "rope_parameters", "hidden_act", "attention_bias", "mlp_bias")
EXPERTS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise", "sliding_window")
DEEPSEEK = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "norm_topk_prob",
            "routed_scaling_factor", "n_group", "topk_group", "router_aux_loss_coef", "rope_interleave")
READ = {"llama": LLAMA, "mixtral": LLAMA + EXPERTS,
        "qwen3_moe": LLAMA + EXPERTS + ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                        "mlp_only_layers", "use_sliding_window"),
        "deepseek_v3": LLAMA + DEEPSEEK, "deepseek_v3_yarn": LLAMA + DEEPSEEK,
        "mamba2": ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "head_dim", "expand",
                   "n_groups", "state_size", "conv_kernel", "layer_norm_epsilon", "tie_word_embeddings", "use_bias",
                   "use_conv_bias", "hidden_act", "chunk_size")}


def loaded(directory: pathlib.Path):
    """(config, jaxpar's float32 parameters) of a Hugging Face checkpoint directory."""
    cfg = read_config(str(directory))
    abstract = nnx.state(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))), nnx.Param)
    return cfg, load_params(str(directory), cfg, abstract)


def raw_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory as stored (its own dtype)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as reader:
            out.update((name, reader.get_tensor(name)) for name in reader.keys())
    return out


@pytest.mark.parametrize("name", GOLDEN)
def test_a_golden_checkpoint_exports_as_transformers_wrote_it(name, tmp_path):
    """Imported, exported: the golden tensors and config keys (where the golden file sets them), and the
    same ModelConfig read back."""
    cfg, params = loaded(GOLDEN[name])
    hf_export.export(cfg, hf_export.params_leaf(params), str(tmp_path / "out"))
    got, want = raw_tensors(tmp_path / "out"), raw_tensors(GOLDEN[name])
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert (got[key].shape, got[key].dtype) == (value.shape, value.dtype), key
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    config, golden = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", GOLDEN[name]))
    keys = [k for k in READ[name] if golden.get(k) is not None]    # (null: the importer's default, e.g. head_dim)
    assert {k: config.get(k) for k in keys} == {k: golden[k] for k in keys}
    assert dataclasses.replace(read_config(str(tmp_path / "out")), name="") == dataclasses.replace(cfg, name="")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want) and index["metadata"]["total_size"] == sum(
        v.nbytes for v in want.values())


def test_the_golden_llama_loads_with_transformers_logits():
    cfg, params = loaded(GOLDEN["llama"])
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
    golden = json.loads((GOLDEN["llama"] / "golden.json").read_text())
    got = np.asarray(decode.full_logits(nnx.merge(graphdef, params), jax.numpy.asarray([golden["prompt"]])))[0]
    np.testing.assert_allclose(got, np.load(GOLDEN["llama"] / golden["logits"]), rtol=1e-4, atol=1e-4)


def initial_checkpoint(model: str, ckpt: pathlib.Path, data: pathlib.Path) -> None:
    """A checkpoint of `model`'s initial state sharded over fsdp4 x tp2 (no training step compiled), its metadata
    naming `data` as the run's `jaxpar data` directory, which holds a tokenizer."""
    tokenizers.train(["the cat sat on the mat", "a dog ate the hat"] * 20, 300).save(data / "tokenizer.json")
    trainer = Trainer(parse_model(model), parse_strategy("fsdp=4,tensor=2"), TrainConfig(batch=8, seq=16))
    saver = Checkpointer(str(ckpt), every=1, data=str(data))
    saver.maybe_save(1, trainer.init_state(), trainer, force=True)
    saver.close()


@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.slow)   # 8 s in all for llama-tiny alone
                                        for m in ("llama-tiny", "mamba2-tiny", "moe-tiny", "deepseek-tiny")])
def initial(request, tmp_path_factory) -> tuple[str, pathlib.Path, pathlib.Path]:
    """(model, its `initial_checkpoint`, the data directory)."""
    ckpt, data = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("data")
    initial_checkpoint(request.param, ckpt, data)
    return request.param, ckpt, data


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sharded_checkpoint_exports_and_loads_back(initial, dtype, tmp_path, capsys):
    """Restored on fsdp=8, gathered tensor by tensor: every parameter back, bitwise (bf16: the cast's);
    deepseek-tiny's MTP module is left out, and said so; the run's tokenizer beside the weights."""
    model, ckpt, data = initial
    assert cli.main(["export", str(ckpt), "--to", "hf", str(tmp_path / "out"), "--dtype", dtype]) == 0
    out = capsys.readouterr()
    assert "written to" in out.out and ("multi-token prediction" in out.err) == (model == "deepseek-tiny")
    cfg, params = loaded(tmp_path / "out")
    want = parse_model(model)
    fields = ("layers", "d_model", "vocab", "tie_embeddings", "pattern", "experts", "kv_lora_rank")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(want, f) for f in fields}
    ref, _ = restore_params(Trainer(want, parse_strategy("data=8"), TrainConfig(batch=8, seq=16)), str(ckpt))
    ref = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(ref))[0])
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        expect = np.asarray(ref[path])
        if dtype == "bfloat16":
            expect = expect.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(value, expect, err_msg=jax.tree_util.keystr(path))
    assert {v.dtype for v in raw_tensors(tmp_path / "out").values()} == {np.dtype(hf_export.DTYPES[dtype])}
    tok, trained = (tokenizers.load(str(d)) for d in (tmp_path / "out", data))
    assert tok.tok.encode("the cat ate").ids == trained.tok.encode("the cat ate").ids
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["tokenizer_class"], config["eos_token"]) == ("PreTrainedTokenizerFast", trained.eot_token)


@pytest.mark.slow
def test_an_exported_checkpoint_generates_under_another_mesh(tmp_path):
    """The export of a checkpoint written under fsdp4 x tp2, loaded as --model hf:DIR under data=2 x tensor=4,
    generates the tokens the checkpoint itself generates on data=8."""
    model, ckpt = "llama-tiny", tmp_path / "ckpt"
    (tmp_path / "data").mkdir()
    initial_checkpoint(model, ckpt, tmp_path / "data")
    assert cli.main(["export", str(ckpt), "--to", "hf", str(tmp_path / "out")]) == 0
    prompts = sum((["--prompt", p] for p in ["1,2,3", "4,5,6,7", "8,9", "10,11,12"] * 2), [])
    runs = {"hf": ["--model", f"hf:{tmp_path / 'out'}", "--hf-checkpoint", str(tmp_path / "out"),
                   "--mesh", "data=2,tensor=4"],
            "ckpt": ["--model", model, "--checkpoint", str(ckpt), "--mesh", "data=8"]}
    tokens = {}
    for name, flags in runs.items():
        assert cli.main(["generate", *flags, *prompts, "--max-new-tokens", "4", "--json", str(tmp_path / f"{name}.json")]) == 0
        tokens[name] = json.loads((tmp_path / f"{name}.json").read_text())["tokens"]
    assert tokens["hf"] == tokens["ckpt"]


def test_bad_exports_are_refused_in_one_line_with_nothing_written(initial, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(initial[1]), "--to", "hf", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists and is not an empty directory" in err and "\n" not in err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    out = tmp_path / "exported"
    assert cli.main(["export", str(initial[1]), "--to", "hf", str(out)]) == 0
    next(out.glob("model-*.safetensors")).rename(out / "elsewhere")
    (out / "spare.safetensors").write_bytes((out / "elsewhere").read_bytes())   # a shard the index does not list
    capsys.readouterr()
    assert cli.main(["generate", "--model", f"hf:{out}", "--hf-checkpoint", str(out), "--mesh", "data=8",
                     *["--prompt", "1,2"] * 8]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.safetensors.index.json lists model-00001-of-00001.safetensors, which the directory lacks" in err
    assert "\n" not in err
    for model, words in (("hybrid-tiny", "has no Hugging Face equivalent"),
                         ("moe-tiny:shared_experts=1", "no shared experts"), ("llama-tiny:mlp_type=gelu", "GeLU")):
        with pytest.raises(ConfigError, match=words):
            hf_export.export(parse_model(model), lambda key, unit=None: None, str(tmp_path / model))
        assert not (tmp_path / model).exists() and list(tmp_path.glob(f".{model}*")) == []
