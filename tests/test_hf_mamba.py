"""Hugging Face Mamba-2 checkpoints (jaxpar/serving/hf_mamba.py) against transformers' own computation.

tests/data/hf_mamba/mamba2/ holds a tiny random Mamba2ForCausalLM (2 groups of 4 heads, tied embeddings) as
`save_pretrained` wrote it, with the logits and greedy continuations transformers computed from it
(tests/data/hf_mamba/make_golden.py, run once by hand in a separate environment). jaxpar's model loaded from the
directory must give those logits and `jaxpar generate` those tokens, unsharded and under tensor and context
parallelism; what jaxpar cannot run is refused in one line.
"""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main as cli
from jaxpar.core import validate
from jaxpar.core.strategy import parse_strategy
from jaxpar.errors import ConfigError
from jaxpar.models import decode
from jaxpar.models.lm import LM
from jaxpar.models.run import RunConfig
from jaxpar.serving.hf import load_params, read_config

DATA = pathlib.Path(__file__).parent / "data" / "hf_mamba" / "mamba2"
GOLDEN = json.loads((DATA / "golden.json").read_text())
CONFIG = json.loads((DATA / "config.json").read_text())


def test_the_config_maps_to_jaxpars_mamba2():
    cfg = read_config(str(DATA))
    assert (cfg.pattern, cfg.layers, cfg.d_model, cfg.ssm_heads, cfg.ssm_head_dim, cfg.ngroups, cfg.d_state,
            cfg.d_conv, cfg.vocab, cfg.tie_embeddings) == ("M", 2, 64, 8, 16, 2, 16, 4, 128, True)


def test_logits_equal_transformers():
    cfg = read_config(str(DATA))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, load_params(str(DATA), cfg, nnx.state(abstract, nnx.Param)))
    got = np.asarray(decode.full_logits(model, jax.numpy.asarray([GOLDEN["prompt"]])))[0]
    np.testing.assert_allclose(got, np.load(DATA / GOLDEN["logits"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh", ["data=4,tensor=2", pytest.param("data=8", marks=pytest.mark.slow),
                                  "data=4,context=2"])
def test_greedy_generation_is_transformers(mesh, tmp_path):
    """The recurrent state cache after a prefill, groups and heads split over tensor (or the prompts over
    context; data=8: one device's whole model per sequence): transformers' greedy tokens, 8 sequences."""
    prompts = [",".join(map(str, p)) for p in GOLDEN["prompts"] * 4]
    assert cli.main(["generate", "--model", f"hf:{DATA}", "--hf-checkpoint", str(DATA), "--mesh", mesh,
                     *sum((["--prompt", p] for p in prompts), []), "--max-new-tokens",
                     str(len(GOLDEN["continuations"][0])), "--json", str(tmp_path / "g.json")]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["tokens"] == GOLDEN["continuations"] * 4


def test_one_group_under_tensor_parallelism_is_refused():
    """The released models have n_groups 1: their B/C groups cannot be split over tensor=2 (stated, not replicated)."""
    cfg = read_config(str(DATA))
    one = type(cfg)(**{**cfg.__dict__, "ngroups": 1})
    with pytest.raises(ConfigError, match="tensor=2 does not divide ngroups=1"):
        validate.check(one, parse_strategy("tensor=2").resolved(2), batch=2, seq=16)


@pytest.mark.parametrize("change, words", [
    (dict(use_bias=True), "use_bias=true"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(time_step_limit=[0.0, 10.0]), "time_step_limit=\\[0.0, 10.0\\]: jaxpar does not clamp dt"),
    (dict(num_heads=4), "hidden_size x expand = 128 != num_heads x head_dim = 64"),
    (dict(state_size=None), "missing or malformed field"),
])
def test_unsupported_configs_are_refused_in_one_line(tmp_path, change, words):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | change))
    with pytest.raises(ConfigError, match=words) as e:
        read_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_weights_that_do_not_match_config_json_are_refused(tmp_path):
    """state_size 8 where the weights were written with 16: the packed rows do not add up (a silent misread
    otherwise: every slice would still have a valid shape)."""
    for f in DATA.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | dict(state_size=8)))
    cfg = read_config(str(tmp_path))
    abstract = nnx.state(nnx.eval_shape(lambda: LM(cfg, RunConfig(), rngs=nnx.Rngs(0))), nnx.Param)
    words = "mixer.(in_proj.weight has 328|conv1d.weight has 192) rows; config.json's .* give "
    with pytest.raises(ConfigError, match=words):
        load_params(str(tmp_path), cfg, abstract)


def test_mamba_ssms_own_config_names_the_conversion(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(d_model=768, n_layer=24, vocab_size=50277,
                                                          ssm_cfg=dict(layer="Mamba2"))))
    with pytest.raises(ConfigError, match="convert the checkpoint to transformers' Mamba2ForCausalLM"):
        read_config(str(tmp_path))
