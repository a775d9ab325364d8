"""Training works end to end: the loss falls, accumulation is exact, the CLI writes metrics."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.training.data import Synthetic, TokenFile, local_batch
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import TrainConfig, Trainer, train
from jaxpar.models.config import parse_model
from tests import harness
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_hundred_steps_halve_the_loss():
    cfg = parse_model("llama-tiny")
    tc = TrainConfig(batch=16, seq=32, steps=100, lr=1e-2, warmup=10)
    trainer = Trainer(cfg, parse_strategy("data=1"), tc, devices=jax.devices()[:1])
    losses = []
    train(trainer, Synthetic(cfg.vocab), on_step=lambda s, m: losses.append(m["loss"]))
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


def test_gradient_accumulation_equals_the_full_batch():
    """4 accumulated micro-batches of 4 give the loss and update of one batch of 16 (dp2-tp4)."""
    full, _ = harness.trajectory("llama-tiny", "dp2-tp4")
    accum, _ = harness.trajectory("llama-tiny", "dp2-tp4", grad_accum=4)
    np.testing.assert_allclose(accum, full, rtol=1e-4, atol=1e-4)


def test_bfloat16_compute_stays_close_and_keeps_float32_masters():
    f32, _ = harness.trajectory("llama-tiny", "dp8")
    bf16, state = harness.trajectory("llama-tiny", "dp8", dtype="bfloat16")
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    np.testing.assert_allclose(bf16, f32, rtol=3e-2)


def test_token_file_windows(tmp_path):
    ids = (np.arange(1000) % 256).astype(np.uint16)
    path = tmp_path / "tokens.u16.bin"
    ids.tofile(path)
    batch = local_batch(TokenFile(str(path), vocab=256), step=3, rows=range(4), seq=16)
    for row in range(4):
        start = int(batch["inputs"][row, 0])
        window = (np.arange(start, start + 17) % 256)
        np.testing.assert_array_equal(batch["inputs"][row], window[:-1])
        np.testing.assert_array_equal(batch["labels"][row], window[1:])
    # deterministic in (seed, step, row): another process asking for row 2 alone gets the same row
    again = local_batch(TokenFile(str(path), vocab=256), step=3, rows=range(2, 3), seq=16)
    np.testing.assert_array_equal(again["inputs"][0], batch["inputs"][2])


def test_cli_train_writes_metrics_tensorboard_and_a_profile(tmp_path):
    """One run, three records: JSONL, TensorBoard event files (read back with TensorBoard's own reader:
    the same losses, as float32) and a profiler trace; MFU from the hardware profile's peak."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxpar.cost.hardware import load_hardware
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE  # a user's flags: must be kept beside --devices
    out = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", "train", "--model", "llama-tiny", "--mesh", "dp2-tp4",
         "--devices", "8", "--steps", "6", "--batch", "8", "--seq", "32", "--metrics", str(metrics),
         "--tensorboard", str(tb), "--hardware", "h100-sxm", "--remat", "full", "--xla-preset", "gpu_overlap",
         "--profile", str(tmp_path / "trace"), "--no-progress"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    # (a GPU scheduling preset compiles on XLA:CPU, which ignores it; the run records it)
    assert 'strategy dp2-tp4 [data=2 x tensor=4]; options: zero = 0, remat = "full", xla_preset = "gpu_overlap"' in out.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))  # counted from 1, as the bar counts
    peak = 8 * load_hardware("h100-sxm").peak_flops
    for r in rows:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "model_flops_per_s", "mfu"} <= r.keys()
        assert r["tokens_per_s"] > 0 and np.isfinite(r["loss"]) and r["xla_preset"] == "gpu_overlap"
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / peak, rel=1e-12)
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"train/loss", "train/grad_norm", "train/step_time_s", "train/tokens_per_s", "train/mfu"} <= set(
        events.Tags()["scalars"])
    for key in ("loss", "grad_norm", "mfu"):
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert got == [(r["step"], np.float32(r[key])) for r in rows], key
    assert any((tmp_path / "trace").rglob("*.xplane.pb"))
    assert "final loss" in out.stdout


def test_cli_train_refuses_an_unwritable_metrics_path_before_compiling(tmp_path, capsys):
    from jaxpar.cli import main as cli
    (tmp_path / "file").write_text("")
    args = ["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", "1", "--no-progress"]
    assert cli.main([*args, "--tensorboard", str(tmp_path / "file")]) == 2
    assert f"--tensorboard {tmp_path / 'file'} exists and is not a directory" in capsys.readouterr().err
    assert cli.main([*args, "--metrics", str(tmp_path)]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err


def test_a_diverged_run_is_an_error_not_a_success(tmp_path, monkeypatch, capsys):
    """A non-finite loss stops the run with exit 2 naming the step (the step itself is stubbed to
    return NaN: nothing here depends on what makes a real run diverge)."""
    from jaxpar.cli import main as cli
    from jaxpar.training.trainer import Trainer
    monkeypatch.setattr(Trainer, "step", lambda self, state, batch: (state, {"loss": float("nan"), "grad_norm": 0.0}))
    monkeypatch.setattr(Trainer, "compile", lambda self: None)  # the stub is the step: nothing to compile
    code = cli.main(["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", "3", "--batch", "8", "--seq",
                     "16", "--no-progress", "--ckpt-dir", str(tmp_path / "ck")])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: training diverged: loss is nan at step 1 (lr=0.003); "
                                               "no checkpoint was written from this step")
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.isdigit()]


def test_the_host_memory_guard_is_for_training_not_for_analysis():
    """A 70B model on 8 simulated devices is refused for training (it cannot fit this host), but the
    same Trainer builds from shapes, as `jaxpar comm --abstract` needs (it allocates nothing)."""
    from jaxpar.errors import ConfigError
    trainer = Trainer(parse_model("llama3-70b"), parse_strategy("dp8"), TrainConfig(batch=8, seq=64))
    with pytest.raises(ConfigError, match="training llama3-70b .* needs at least .* GiB, more than this host's"):
        trainer.check_host_memory()
