"""Checkpoints: restore onto other meshes with the same next step, and every odd case.

The crash and fresh-process cases run the CLI in subprocesses (tests/test_checkpoint_cli.py).
"""

import jax
import numpy as np
import pytest

from jaxpar.training.checkpoint import Checkpointer
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import Trainer
from jaxpar.models.config import parse_model
from tests import harness

MODEL = "llama-tiny"
SAVE_AT = 3  # steps taken on the source mesh before saving


def run_steps(trainer, state, start, stop):
    losses = []
    for step in range(start, stop):
        state, m = trainer.step(state, trainer.batch(harness.source(MODEL), step))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("src, src_devices, dst, dst_devices", [
    ("fsdp8", 8, "tp8", 8),
    ("dp2-fsdp2-tp2", 8, "fsdp=4", 4),
    ("tp8", 8, "data=1", 1),
    ("zero1-dp8", 8, "fsdp8", 8),
    ("data=1", 1, "dp2-fsdp2-tp2", 8),
    ("dp2-tp4", 8, "tp4-sp", 8),
    ("fsdp8", 8, "cp8-ring", 8),
])
def test_restore_onto_another_mesh_gives_the_same_next_step(tmp_path, src, src_devices, dst, dst_devices):
    source = harness.trainer(MODEL, src, src_devices)
    state = source.state_from_params(harness.reference_params(MODEL))
    state, _ = run_steps(source, state, 0, SAVE_AT)
    ckpt = Checkpointer(str(tmp_path / "ck"), every=SAVE_AT)
    assert ckpt.maybe_save(SAVE_AT, state, source)
    ckpt.wait()
    _, expected = run_steps(source, state, SAVE_AT, SAVE_AT + 1)

    target = harness.trainer(MODEL, dst, dst_devices)
    restored, step, message = Checkpointer(str(tmp_path / "ck"), every=SAVE_AT).restore(target)
    assert step == SAVE_AT and int(restored.step) == SAVE_AT
    assert ("resharded from" in message) == (source.strategy.describe() != target.strategy.describe()
                                            or src_devices != dst_devices)
    for x, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(target.state_shardings)):
        assert x.sharding.is_equivalent_to(sh, x.ndim)
    _, got = run_steps(target, restored, SAVE_AT, SAVE_AT + 1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    state, step, message = Checkpointer(str(tmp_path / "empty"), every=5).restore(harness.trainer(MODEL, "dp8"))
    assert state is None and step == 0
    assert "no checkpoint" in message and "starting from scratch" in message


def test_model_mismatch_names_the_field(tmp_path):
    tr = harness.trainer(MODEL, "dp8")
    ck = Checkpointer(str(tmp_path / "ck"), every=1)
    ck.maybe_save(1, tr.state_from_params(harness.reference_params(MODEL)), tr)
    ck.wait()
    other = Trainer(parse_model("llama-tiny:mlp_dim=256"), parse_strategy("dp8"), harness.TC)
    with pytest.raises(ConfigError, match=r"mlp_dim=128 in the checkpoint, mlp_dim=256 now"):
        Checkpointer(str(tmp_path / "ck"), every=1).restore(other)


def test_a_directory_from_another_program_is_refused(tmp_path):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="was not written by jaxpar"):
        Checkpointer(str(tmp_path / "theirs"), every=1)


def test_a_corrupt_checkpoint_is_an_error(tmp_path):
    tr = harness.trainer(MODEL, "dp8")
    ck = Checkpointer(str(tmp_path / "ck"), every=1)
    ck.maybe_save(1, tr.state_from_params(harness.reference_params(MODEL)), tr)
    ck.wait()
    for f in (tmp_path / "ck" / "1" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="checkpoint step 1 in .* (is corrupt|cannot be read)"):
        Checkpointer(str(tmp_path / "ck"), every=1).restore(tr)
