"""The console's everyday behaviour: Ctrl-C, a run without --devices on a host with libtpu, the docs'
decode estimate under a training recipe's stack, the decode step's bottleneck label, an expert axis on a
dense model in the run's header.

The real-signal runs (a Ctrl-C to `train` and to `launch`) are in test_checkpoint_cli.py and
test_multiprocess.py; here the second Ctrl-C, which must land inside a step, is delivered in process."""
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import jax
import pytest

from jaxpar.cli import main as cli
from jaxpar.cli.streams import unglued
from jaxpar.cli.train_log import header
from jaxpar.cost.hardware import load_hardware
from jaxpar.cost.inference import Request, inference_estimate
from jaxpar.core.strategy import parse_strategy
from jaxpar.models.config import parse_model
from jaxpar.training.trainer import PreemptionNotice, TrainConfig, Trainer, preempted

ROOT = pathlib.Path(__file__).resolve().parent.parent
main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="signal handlers are installed from the main thread only")


@main_thread_only
def test_a_first_ctrl_c_is_a_notice_and_a_second_stops_at_once(capsys):
    before = signal.getsignal(signal.SIGINT)
    with PreemptionNotice():
        os.kill(os.getpid(), signal.SIGINT)
        assert preempted(1) and PreemptionNotice.received == signal.SIGINT
        assert "Ctrl-C again stops at once" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and not preempted(1)


def test_an_interrupt_outside_the_steps_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.ANALYTIC, "estimate", interrupted)
    assert cli.main(["estimate", "--model", "llama-tiny", "--mesh", "dp8"]) == 128 + signal.SIGINT
    err = capsys.readouterr().err.strip()
    assert err == "jaxpar: interrupted (Ctrl-C): stopped at once, nothing saved"


def test_a_device_count_mismatch_names_the_flag_and_no_backend_noise():
    """With libtpu installed and no accelerator here, a run without --devices starts the CPU backend
    alone: its one line of output is jaxpar's, naming --devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", "train", "--model", "llama-tiny", "--mesh", "dp8",
                          "--steps", "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "jaxpar: error: mesh dp8: axis product 8 (data=8) != device count 1 (on CPU, --devices 8 simulates 8 devices)"]
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: nothing else would print here")


def test_the_docs_decode_estimate_under_megatron_core_runs(capsys):
    """docs/serving.md's command: Megatron-Core's training recipe (sequence parallelism wherever tensor > 1)
    is not applied to a decode step, which has one token per sequence."""
    assert cli.main(["estimate", "--model", "llama3-70b", "--mesh", "tensor=8", "--hardware", "h100-sxm",
                     "--phase", "decode", "--global-batch", "32", "--seq", "1024", "--gen-len", "256",
                     "--software", "megatron-core"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel" not in out and "llama3-70b decode on 8 x h100-sxm" in out


@pytest.mark.parametrize("phase, model, mesh, batch, bound", [
    ("decode", "llama3-70b", "tensor=8", 32, "collective"),  # 8.1 ms of all-reduces beside 5.8 ms of HBM
    ("decode", "llama3-8b", "data=8", 64, "memory bandwidth"),
    ("prefill", "llama3-8b", "data=8", 8, "compute")])
def test_the_inference_label_is_the_steps_largest_term(phase, model, mesh, batch, bound):
    est = inference_estimate(parse_model(model), parse_strategy(mesh).with_options(dtype="bfloat16"),
                             load_hardware("h100-sxm"), Request(phase, batch, 1024, 256))
    terms = {"compute": est.matmul_s, "memory bandwidth": est.memory_s, "collective": est.comm_s}
    assert max(terms.values()) == terms[bound] and est.bound == bound


def test_an_expert_axis_on_a_dense_model_is_stated_as_data_parallelism():
    def said(model):
        trainer = Trainer(parse_model(model), parse_strategy("data=2,expert=4"), TrainConfig(batch=8, seq=16),
                          devices=jax.devices()[:8])
        return [line for line in header(trainer, "synthetic", None, 0, 1) if line.startswith("expert=")]
    assert said("llama-tiny") == ["expert=4 acts as data parallelism: llama-tiny has no mixture-of-experts layers "
                                  "(the batch is split over it as over data)"]
    assert said("moe-tiny") == []


def test_estimate_plan_and_help_load_no_jax():
    """The analytic commands answer without JAX (the cost model reads the compiler's and the kernels' facts
    as data: Compiler.ragged_all_to_all, ops/tiles.py, core.strategy.resolve_kernel), so they start fast."""
    script = ("import contextlib, io, sys\nfrom jaxpar.cli import main\n"
              "for argv in (['estimate', '--model', 'moe-tiny', '--mesh', 'ep8', '--hardware', 'h100-sxm', '--seq', '256',"
              " '--attention-kernel', 'auto'], ['plan', '--model', 'llama3-8b', '--devices', '8', '--hardware',"
              " 'h100-sxm', '--top', '1']):\n"
              "    with contextlib.redirect_stdout(io.StringIO()):\n        assert main.main(argv) == 0, argv\n"
              "print(sorted(m for m in ('jax', 'flax', 'jaxlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] + out.stdout


def test_the_wall_time_counts_from_the_process_start():
    """`train`'s summary counts the interpreter's start and the imports: the process's age, read from /proc,
    includes a sleep before jaxpar was imported."""
    script = "import time\ntime.sleep(0.5)\nfrom jaxpar.cli.main import process_age\nprint(process_age())"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if not pathlib.Path("/proc/self/stat").exists():
        pytest.skip("no /proc here: the wall time counts from the command's start")
    assert 0.5 <= float(out.stdout) < 30, out.stderr


def test_a_warmup_longer_than_the_run_is_refused_or_stated(capsys):
    """Given, it is one line naming both flags; the default's 10 steps on a shorter run are said in the header."""
    assert cli.main(["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", "5", "--warmup", "6"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: --warmup 6 is longer than the run (--steps 5): the "
                                               "learning rate would never reach --lr 0.003; give --warmup <= 5")
    assert TrainConfig(steps=3).describe_schedule().startswith(
        "lr 0.003 peak, 10 warmup steps (longer than the 3-step run: the peak is never reached), then cosine")
    assert TrainConfig(steps=20).describe_schedule().startswith("lr 0.003 peak, 10 warmup steps, then cosine")


def test_the_launcher_drops_gloos_connection_notices_even_two_to_a_line():
    notice = "[Gloo] Rank {} is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    one, two = notice.format(1), notice.format(0)
    glued = one[:30] + two + one[30:] + "\n"  # two C++ threads writing at once
    assert unglued(glued) is None and unglued(two + "\n") is None
    assert unglued("step 1/4  loss 5.9896\n") == "step 1/4  loss 5.9896\n"
    assert unglued(f"W1202 a warning {two}\n") == "W1202 a warning \n"
    assert unglued("[Gloo] Rank \n") is None and unglued(two[12:] + "\n") is None  # a notice cut in two
    assert unglued("3\n") == "3\n"  # too short to tell: kept
    shuffled = ("[Gloo] Rank 1 is connected to 3[Gloo] Rank  peer ranks. 3Expected number of connected peer ranks "
                "is :  is connected to 33\n")  # two notices' pieces interleaved (seen in CI)
    assert unglued(shuffled) is None and unglued("W1207 peer ranks may differ\n") is not None


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_help_explains_every_stack(command, capsys):
    """Every --software choice (aliases too) has its line in --help, and no line names a stack not there."""
    from jaxpar.cost.software import SOFTWARE, STACKS  # noqa: PLC0415  the one test that reads them
    assert set(STACKS) == set(SOFTWARE)
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(capsys.readouterr().out.split()))  # argparse wraps at hyphens
    for name, what in STACKS.items():
        assert f"{name}: {' '.join(what.split())}" in text, name


def test_plan_with_nothing_that_fits_exits_2_naming_the_binding_constraint(capsys):
    """Memory: the least a valid layout needs, beside the limit; divisibility: the commonest refusal."""
    assert cli.main(["plan", "--model", "llama3-405b", "--devices", "8", "--hardware", "h100-sxm", "--seq", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    need, layout = re.fullmatch(r"jaxpar: error: nothing fits: memory: the \d+ valid layouts need at least ([\d.]+) GiB "
                                r"per device \((\w+)\), over the 73.3 GiB limit; more devices, a smaller batch or a "
                                r"shorter sequence", err).groups()
    assert float(need) > 405e9 * 16 / 8 / 2**30  # more than the weights and Adam state alone, split 8 ways
    # 7 devices: memory binds the few valid layouts, divisibility the rest, and the line says both
    assert cli.main(["plan", "--model", "llama3-8b", "--devices", "7", "--hardware", "h100-sxm"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(r"nothing fits: memory: the 3 valid layouts .*; 63 of 66 candidates were not valid \(the most "
                     r"common reason, \d+ of them: \w+=7 does not divide", err) and len(err.splitlines()) == 1, err
    assert cli.main(["plan", "--model", "llama-tiny", "--devices", "3", "--hardware", "h100-sxm", "--seq", "64",
                     "--global-batch", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "the most common reason (6 of them): batch=2 is not divisible by the data-parallel size data=3 (3)")


def test_comm_says_when_xla_cpu_widens_bfloat16_collectives(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cli.main(["comm", "--model", "llama-tiny", "--mesh", "data=4,tensor=2", "--devices", "8",
                     "--dtype", "bfloat16", "--batch", "8", "--seq", "16", "--json", str(out)]) == 0
    assert "note: XLA:CPU runs bfloat16 collectives in float32" in capsys.readouterr().out
    assert json.loads(out.read_text())["bf16_collectives_in_float32"] is True


def test_comm_compare_estimate_and_explain_share_one_default_question():
    """Without --batch/--seq (--global-batch): 256 sequences x min(4096, max_seq), the batch rounded up to
    what the layout's step splits (a hand count: data=512 needs 512), each printed as the default."""
    from jaxpar.cli import commands
    from jaxpar.cli.commands_cost import question_from
    args = cli.build_parser().parse_args(["comm", "--model", "llama-tiny", "--mesh", "data=512", "--abstract"])
    tc = commands.analysis_config(args, parse_model("llama-tiny"), [parse_strategy("data=512")])
    assert (tc.batch, tc.seq) == (512, 256) and "not given: the default question" in commands.analysis_shape(args, tc)
    est = cli.build_parser().parse_args(["estimate", "--model", "llama3-8b", "--mesh", "fsdp8", "--hardware", "h100-sxm"])
    question, _ = question_from(est)
    assert (question.global_batch, question.seq) == (256, 4096)


def test_one_step_has_one_model_flop_count_in_estimate_plan_and_the_guide(tmp_path, monkeypatch):
    """llama3.1-70b, 4,096 x 4,096 tokens: `estimate` under jaxpar's dense kernel and under megatron-core's
    causal one, `plan`'s top pick and the guide's MFU map (experiments/study_mfu_map.py) count the same
    model FLOPs, the hand count with the causal half of the scores (flops.MODEL_FLOPS_CONVENTION)."""
    d, layers, hq, hkv, f, vocab, s, batch = 8192, 80, 64 * 128, 8 * 128, 28672, 128256, 4096, 4096
    per_token = 2 * (layers * (d * (hq + 2 * hkv) + hq * d + 3 * d * f + s * hq) + d * vocab)  # causal: 2 s hq
    hand = 3 * per_token * batch * s
    counted = {}
    for software in ("jaxpar", "megatron-core"):
        out = tmp_path / f"{software}.json"
        assert cli.main(["estimate", "--model", "llama3.1-70b", "--mesh", "fsdp=64", "--hardware", "h100-sxm",
                         "--global-batch", str(batch), "--seq", str(s), "--software", software, "--json", str(out)]) == 0
        counted[f"estimate {software}"] = json.loads(out.read_text())["flops_per_step"]
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "llama3.1-70b", "--devices", "64", "--hardware", "h100-sxm", "--top", "1",
                     "--global-batch", str(batch), "--seq", str(s), "--software", "megatron-core", "--json", str(out)]) == 0
    counted["plan"] = json.loads(out.read_text())["plans"][0]["flops_per_step"]
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "experiments"))
    spec = importlib.util.spec_from_file_location("study_mfu_map", pathlib.Path(__file__).parents[1] / "experiments/study_mfu_map.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    counted["guide"] = study.cell("llama3.1-70b", 64, s)["est"].flops.model
    assert all(v == pytest.approx(hand, rel=1e-12) for v in counted.values()), (hand, counted)
