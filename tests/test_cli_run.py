"""What `jaxpar train` says and records (docs/running.md), and the command line's help: defaults on every
flag, `--version`, near matches for unknown names, the optimizer's flags reaching optax."""
import argparse
import contextlib
import importlib.metadata
import io
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.cli import main as cli
from jaxpar.cli.commands import train_config
from jaxpar.core.strategy import OPTION_FIELDS
from jaxpar.cost.hardware import load_hardware
from jaxpar.errors import ConfigError
from jaxpar.training.trainer import make_optimizer

STEPS, BATCH, SEQ, LR = 3, 8, 16, 2e-3
OPTIONS = {f.name for f in OPTION_FIELDS}
RUN = ["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", str(STEPS), "--batch", str(BATCH),
       "--seq", str(SEQ)]


def llama_tiny_parameters() -> int:
    """Counted by hand from the preset (models/config.py): embedding, per layer q/k/v/o, the gated MLP's
    three matrices and two norms, the final norm and an untied head."""
    vocab, d, layers, heads, kv, hd, mlp = 256, 64, 2, 16, 8, 8, 128
    layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * mlp + 2 * d
    return vocab * d + layers * layer + d + d * vocab


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 3-step run into files, not a terminal (so log lines every 2 steps, no progress bar's \\r
    frames), checkpoints every 2 steps, a constant learning rate and a hardware profile on CPU devices:
    (stdout, JSONL rows, wall-clock bounds)."""
    tmp = tmp_path_factory.mktemp("run")
    metrics = tmp / "m.jsonl"
    before = time.time()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*RUN, "--log-every", "2", "--metrics", str(metrics), "--hardware",
                         "h100-sxm", "--ckpt-dir", str(tmp / "ck"), "--ckpt-every", "2", "--schedule", "constant",
                         "--warmup", "0", "--lr", str(LR)])
    assert code == 0
    assert "\r" not in out.getvalue() + err.getvalue()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return out.getvalue(), rows, (before, time.time()), tmp / "ck"


def test_the_header_says_what_the_run_is(run):
    out, _, _, _ = run
    lines = out.splitlines()
    assert lines[0] == (f"model llama-tiny: 2 layers, d_model=64, pattern=A; {llama_tiny_parameters():,} parameters")
    assert lines[1] == "strategy dp8 [data=8]; options: zero = 0; 8 cpu devices"
    assert lines[2] == (f"batch {BATCH} sequences x {SEQ} tokens = {BATCH * SEQ:,} tokens per step (global); "
                        f"steps 1-{STEPS} of {STEPS}, {STEPS * BATCH * SEQ:,} tokens")
    assert "precision float32 parameters, gradients and Adam moments; float32 compute" in lines
    assert "optimizer AdamW (b1 0.9, b2 0.95, weight decay 0.1), global-norm clip 1" in lines
    assert f"schedule lr {LR:g} peak, no warmup, constant" in lines
    assert any(line.startswith("data SYNTHETIC tokens") for line in lines)
    mfu = next(line for line in lines if line.startswith("mfu nominal, CPU devices (against 8 x h100-sxm"))
    assert mfu.endswith("; model FLOPs = 6 x parameters x tokens + attention over the causal half of the s x s "
                        "scores; no recompute")
    compiled = re.compile(r"compiling the training step \.\.\. \d+\.\d s")
    compiling = [i for i, line in enumerate(lines) if compiled.fullmatch(line)]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert len(compiling) == 1 and compiling[0] < first_step   # compiled before any step ran
    assert any(line.startswith("initialising the parameters and optimizer state in their shards ... ")
               for line in lines[compiling[0]:first_step])


def test_log_lines_checkpoints_and_summary_agree_with_the_metrics(run):
    out, rows, _, ckpt = run
    logged = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in logged] == [f"2/{STEPS}", f"{STEPS}/{STEPS}"]  # every 2, and the last
    by_step = {r["step"]: r for r in rows}
    for line in logged:
        r = by_step[int(line.split()[1].split("/")[0])]
        assert f"loss {r['loss']:.4f}" in line and f"{r['step_time_s'] * 1e3:.1f} ms/step" in line
        assert "mfu" not in line   # nominal on CPU devices: not shown
    saved = [line for line in out.splitlines() if line.startswith("checkpoint saved")]
    assert saved == [f"checkpoint saved at step 2 in {ckpt}", f"checkpoint saved at step {STEPS} in {ckpt}"]
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, STEPS]
    median = statistics.median(r["step_time_s"] for r in rows)
    summary = out.splitlines()[-1]
    assert summary.startswith(f"final loss {rows[-1]['loss']:.4f} at step {STEPS}; median step {median * 1e3:.1f} ms")
    assert f"{STEPS * BATCH * SEQ:,} tokens seen; wall " in summary


def test_the_metrics_schema(run):
    _, rows, (before, after), _ = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the bar's and the log lines' numbering
    peak = 8 * load_hardware("h100-sxm").peak_flops
    for r in rows:
        assert r["tokens"] == r["step"] * BATCH * SEQ
        assert r["lr"] == pytest.approx(LR, rel=1e-6)     # --schedule constant --warmup 0: the peak throughout
        assert before <= r["time"] <= after
        assert r["tokens_per_s"] == pytest.approx(BATCH * SEQ / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / peak) and r["mfu_nominal"] is True
        assert {"loss", "grad_norm", "xla_preset"} <= r.keys()
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)


def test_profile_steps_outside_the_run_are_refused_before_compiling(tmp_path, capsys):
    assert cli.main([*RUN, "--profile", str(tmp_path / "trace")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"jaxpar: error: --profile traces steps 2-4 (--profile-steps), but this run takes steps 1-{STEPS}: "
        "give --profile-steps within them, or more --steps")
    assert cli.main([*RUN, "--profile", str(tmp_path / "trace"), "--profile-steps", "3-2"]) == 2
    assert "argument --profile-steps: '3-2' must be A-B with 1 <= A <= B" in capsys.readouterr().err
    assert not (tmp_path / "trace").exists()


def test_optimizer_flags_reach_optax():
    """Flags -> OptimizerConfig -> the optimizer: one update equals optax's AdamW built by hand from the
    same numbers (linear schedule, 2 warmup steps, at update 3 of 10)."""
    args = cli.build_parser().parse_args([*RUN, "--steps", "10", "--lr", "0.01", "--warmup", "2", "--schedule",
                                          "linear", "--min-lr-ratio", "0.2", "--weight-decay", "0.05", "--b1",
                                          "0.8", "--b2", "0.9", "--clip", "0.5"])
    tc = train_config(args)
    lr = optax.join_schedules([optax.linear_schedule(0.0, 0.01, 2), optax.linear_schedule(0.01, 0.002, 8)], [2])
    by_hand = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(lr, b1=0.8, b2=0.9, weight_decay=0.05))
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda p: jnp.cos(p) * 3.0, params)
    ours, theirs = make_optimizer(tc), by_hand
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for _ in range(4):
        u_ours, s_ours = ours.update(grads, s_ours, params)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, params)
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert float(jnp.abs(u_ours["w"]).sum()) > 0


def test_version():
    out = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(out):
        cli.main(["--version"])
    assert e.value.code == 0
    assert out.getvalue().strip() == f"jaxpar {importlib.metadata.version('jaxpar')}"


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "llama-tiny:layrs=4", "--mesh", "dp8"],
     "unknown model field 'layrs' (did you mean 'layers'?)"),
    (["train", "--model", "llama-tiny", "--mesh", "dp8", "--stpes", "5"],
     "train: unrecognized arguments: --stpes (did you mean '--steps'?) 5"),
    (["train", "--model", "llama-tiny", "--mesh", "dp8", "--remat", "ful"], "invalid choice: 'ful'"),
    (["train", "--model", "llama-tiny", "--mesh", "data=2,tensr=4"],
     "unknown mesh axis 'tensr' (did you mean 'tensor'?)"),
    (["train", "--model", "lama-tiny", "--mesh", "dp8"], "unknown model preset 'lama-tiny' (did you mean 'llama-tiny'"),
    (["estimate", "--model", "llama3-8b", "--mesh", "dp8", "--hardware", "h100-sx"], "(did you mean 'h100-sxm'"),
    (["trian"], "invalid choice: 'trian'"),
])
def test_unknown_names_get_near_matches(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    if "invalid choice" in message:
        assert "(did you mean" in err


def help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag's entry in the rendered --help, keyed by its first option string."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if m := re.match(r"^  (-[-\w]+)", line):
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_every_flag_of_every_command_has_help_and_its_default():
    parser = cli.build_parser()
    missing = []
    for name, sub in parser.commands.items():
        entries = help_entries(sub)
        for action in sub._actions:
            if not action.option_strings or action.option_strings[0] in ("-h", "--version"):
                continue
            flag = action.option_strings[0]
            entry = entries.get(flag, "")
            has_default = not any(action.default is none for none in (None, False, argparse.SUPPRESS))
            strategy_flag = action.dest in OPTIONS
            if not action.help or ((has_default or strategy_flag) and "default" not in entry):
                missing.append(f"{name} {flag}")
    assert missing == []
