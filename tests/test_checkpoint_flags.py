"""`jaxpar train`'s checkpoint flags: every contradiction or empty value is one error line, exit 2,
before anything is built (in-process: nothing here compiles or trains)."""
import os
import pathlib

import pytest

from jaxpar.cli import main as cli

TRAIN = ["train", "--model", "llama-tiny", "--mesh", "data=8", "--steps", "4", "--batch", "8", "--seq", "16",
         "--no-progress"]


@pytest.mark.parametrize("flags, message", [
    (["--ckpt-dir", ""], "--ckpt-dir"),                          # empty: an error, not "no checkpoints"
    (["--ckpt-dir", "   "], "--ckpt-dir"),
    (["--ckpt-dir", "CK", "--stop-after", "0"], "--stop-after"),  # would label the untrained state a step
    (["--ckpt-dir", "CK", "--stop-after", "-1"], "--stop-after"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--overwrite-ckpt"], "--overwrite-ckpt needs --ckpt-dir"),
    (["--ckpt-dir", "CK", "--resume", "--overwrite-ckpt"], "--resume and --overwrite-ckpt contradict each other"),
    (["--ckpt-dir", "CK", "--resume-step", "4"], "--resume-step 4 needs --resume"),
    (["--ckpt-dir", "CK", "--resume", "--resume-step", "-4"], "--resume-step"),
])
def test_bad_checkpoint_flags(flags, message, tmp_path, capsys):
    flags = [str(tmp_path / "ck") if f == "CK" else f for f in flags]
    assert cli.main([*TRAIN, *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("jaxpar") and ": error: " in err
    assert message in err
    assert not (tmp_path / "ck").exists()  # refused before anything was written


def test_a_read_only_checkpoint_directory_is_one_error_line(tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: play the read-only mount (os.access says no)
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if pathlib.Path(p) == ro else real(p, mode))
    assert cli.main([*TRAIN, "--ckpt-dir", str(ro / "ck")]) == 2
    assert capsys.readouterr().err == f"jaxpar: error: --ckpt-dir {ro}/ck cannot be written: {ro} is not writable\n"
