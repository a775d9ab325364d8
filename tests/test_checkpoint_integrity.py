"""Damaged checkpoints are reported, never restored: checksums, truncated files, explicit fallback to an
older step, and the directory cases (read-only, set aside, overwrite). In-process, on 8 CPU devices;
the same cases through `jaxpar train` are in tests/test_checkpoint_cli.py."""
import pathlib
import re

import shutil

import jax
import numpy as np
import pytest

from jaxpar.training.checkpoint import SET_ASIDE, Checkpointer, flatten
from jaxpar.training.integrity import DamagedCheckpoint, checksums, shorten
from jaxpar.errors import ConfigError
from jaxpar.training.trainer import gather
from tests import harness

MODEL = "llama-tiny"
KEY = ".params['embedding'].value"  # the array `one_bit_off` damages


def saved(tmp_path, steps=(1,), mesh="dp8"):
    """A checkpoint directory holding `steps` (the same state, saved under each step)."""
    tr = harness.trainer(MODEL, mesh)
    state = tr.state_from_params(harness.reference_params(MODEL))
    ck = Checkpointer(str(tmp_path / "ck"), every=1)
    for s in steps:
        assert ck.maybe_save(s, state, tr)
        ck.wait()
    ck.close()
    return tr, state, tmp_path / "ck"


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """orbax's array data files (OCDBT: content-addressed files under .../d/)."""
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def flip_a_bit(step_dir: pathlib.Path) -> pathlib.Path:
    """Flip one bit in the middle of the biggest array data file. The data are zstd-compressed, so
    what that does depends on where the bit falls: the file may decode to other values (only the
    checksums can tell) or fail to decode. Returns the file changed."""
    f = max(data_files(step_dir), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return f


def one_bit_off(tmp_path, step_dir: pathlib.Path, mesh="dp8") -> None:
    """Replace the arrays of `step_dir` by a valid orbax item whose embedding differs in one bit:
    what a bit flip that still decodes leaves on disk, made deterministic."""
    tr = harness.trainer(MODEL, mesh)
    params = jax.tree.map(np.copy, harness.reference_params(MODEL))
    bits = params["embedding"][...].view(np.uint32)
    bits[3, 5] ^= 1 << 7
    other = Checkpointer(str(tmp_path / "other"), every=1)
    other.maybe_save(int(step_dir.name), tr.state_from_params(params), tr)
    other.close()
    shutil.rmtree(step_dir / "state")
    shutil.copytree(tmp_path / "other" / step_dir.name / "state", step_dir / "state")


def test_every_array_has_a_checksum_per_saved_slice():
    tr = harness.trainer(MODEL, "fsdp8")
    flat = flatten(tr.state_from_params(harness.reference_params(MODEL)))
    sums = checksums(flat)
    assert set(sums) == set(flat)
    sharded = [k for k, v in flat.items() if len({s.index for s in v.addressable_shards}) == 8]
    assert sharded and all(len(sums[k]) == 8 for k in sharded)  # one per distinct slice, not per device
    assert sums == checksums(flat)


def test_a_flipped_bit_in_a_data_file_names_the_array(tmp_path):
    tr, _, ck = saved(tmp_path)
    flip_a_bit(ck / "1")
    with pytest.raises(DamagedCheckpoint) as e:
        Checkpointer(str(ck), every=1).restore(tr)
    msg = str(e.value)
    assert re.match(rf"checkpoint step 1 in {re.escape(str(ck))} is (damaged|corrupt or incomplete): "
                    r"array \.\S+ (does not match the checksum written with it|cannot be read)", msg), msg
    assert msg.endswith("There is no older checkpoint to fall back to.")


def test_an_array_that_decodes_to_other_bytes_is_named(tmp_path):
    tr, _, ck = saved(tmp_path)
    one_bit_off(tmp_path, ck / "1")
    with pytest.raises(DamagedCheckpoint) as e:
        Checkpointer(str(ck), every=1).restore(tr)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step 1 in {ck} is damaged: array {KEY} does not match the checksum "
                          "written with it: crc32 0x")
    assert re.search(r"crc32 0x[0-9a-f]{8} saved, 0x[0-9a-f]{8} read\. There is no older", msg)


def test_a_damaged_array_is_found_after_resharding(tmp_path):
    """Saved on fsdp8 (8 slices per array), restored onto tp8: every saved slice is still checked."""
    _, _, ck = saved(tmp_path, mesh="fsdp8")
    one_bit_off(tmp_path, ck / "1", mesh="fsdp8")
    with pytest.raises(DamagedCheckpoint, match=re.escape(f"array {KEY} (slice [0:256,0:8]) does not match")):
        Checkpointer(str(ck), every=1).restore(harness.trainer(MODEL, "tp8"))


def test_a_truncated_file_is_named_and_the_message_is_whole(tmp_path):
    tr, _, ck = saved(tmp_path)
    biggest = max(data_files(ck / "1"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises(DamagedCheckpoint) as e:
        Checkpointer(str(ck), every=1).restore(tr)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step 1 in {ck} is corrupt or incomplete: array .")
    assert re.search(r"array \.\S+ cannot be read", msg)
    assert f"file {biggest} (" in msg and "truncated?" in msg
    assert "\n" not in msg and "TensorStore({" not in msg  # one line, not orbax's whole spec
    assert msg.endswith("There is no older checkpoint to fall back to.")


def test_shorten_cuts_between_words():
    text = "Error reading " + " ".join(f"word{i:03d}" for i in range(200))
    short = shorten(text, 100)
    assert len(short) <= 106 and short.endswith(" [...]")
    assert set(short.removesuffix(" [...]").split()) <= set(text.split())  # no word cut in half
    assert shorten("a  short\n text") == "a short text"


def test_a_damaged_newest_names_the_older_steps_and_an_older_one_restores_on_request(tmp_path):
    tr, state, ck = saved(tmp_path, steps=(2, 4, 6))
    one_bit_off(tmp_path, ck / "6")
    with pytest.raises(DamagedCheckpoint) as e:
        Checkpointer(str(ck), every=1).restore(tr)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step 6 in {ck} is damaged: array {KEY} ")
    assert "Older checkpoints there: steps 2, 4; to resume from one, add --resume-step 4" in msg
    restored, step, message = Checkpointer(str(ck), every=1).restore(tr, step=4)
    assert step == 4 and message.startswith("restored step 4")
    np.testing.assert_array_equal(gather(restored.params)["embedding"][...], gather(state.params)["embedding"][...])


def test_asking_for_a_step_that_is_not_there(tmp_path):
    tr, _, ck = saved(tmp_path, steps=(2, 4))
    with pytest.raises(ConfigError, match=rf"--resume-step 3: no complete checkpoint of step 3 in {ck}; "
                                          r"it holds steps 2, 4$"):
        Checkpointer(str(ck), every=1).restore(tr, step=3)


def test_newer_checkpoints_are_set_aside_not_deleted(tmp_path):
    tr, _, ck = saved(tmp_path, steps=(2, 4, 6))
    c = Checkpointer(str(ck), every=1)
    moved = c.set_aside_after(2)
    assert moved == [ck / SET_ASIDE / "4", ck / SET_ASIDE / "6"]
    assert c.steps() == [2] and all((m / "state").is_dir() for m in moved)
    assert Checkpointer(str(ck), every=1).steps() == [2]  # a new manager does not list them either


def test_delete_all(tmp_path):
    _, _, ck = saved(tmp_path, steps=(2, 4))
    c = Checkpointer(str(ck), every=1)
    assert c.delete_all() == [2, 4]
    assert c.steps() == [] and Checkpointer(str(ck), every=1).steps() == []


def test_a_failed_write_is_a_config_error(tmp_path, monkeypatch):
    """Where os.access says yes but the write fails (root on a read-only mount): the probe's OSError."""
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "write_text", refuse)
    with pytest.raises(ConfigError, match=rf"^--ckpt-dir {tmp_path}/ck cannot be written: Permission denied \("):
        Checkpointer(str(tmp_path / "ck"), every=1)
