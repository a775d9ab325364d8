"""Compiler scheduling presets (jaxpar/xla_presets.py) and the overlap report (jaxpar/analysis/overlap.py).

The presets' effect on step time needs an accelerator (experiments/bench_overlap.py); here: every GPU
flag is a compile option the installed jaxlib knows (XLA:CPU takes GPU fields and refuses unknown ones,
so a renamed flag fails this test), a preset for the wrong platform is refused, TPU flags reach
LIBTPU_INIT_ARGS, a run records its preset, and the overlap report reads start/done pairs correctly
from a module written by hand (XLA:CPU emits none).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import xla_presets
from jaxpar.analysis.overlap import format_overlap, overlap_report
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import Trainer, TrainConfig
from jaxpar.models.config import parse_model


@pytest.mark.parametrize("name", [n for n, p in xla_presets.PRESETS.items() if p.platform == "gpu"])
def test_gpu_preset_flags_are_known_to_this_jaxlib(name):
    options = xla_presets.PRESETS[name].compiler_options("cpu")
    assert options and all(k.startswith("xla_gpu_") for k in options)
    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4)))
    lowered.compile(options)   # raises "No such compile option" for a name the jaxlib does not have
    with pytest.raises(Exception, match="No such compile option"):   # (the check above can fail)
        lowered.compile({"xla_gpu_no_such_flag_for_this_test": True})


@pytest.mark.parametrize("name, platform, ok", [
    ("gpu_overlap", "cpu", True), ("gpu_overlap", "gpu", True), ("gpu_overlap", "tpu", False),
    ("tpu_overlap", "gpu", False), ("tpu_overlap", "cpu", True), ("none", "tpu", True),
])
def test_preset_platforms(name, platform, ok):
    if ok:
        xla_presets.check_platform(name, platform)
    else:
        with pytest.raises(ConfigError, match=f"xla_preset={name} is for .* devices, but the devices are {platform}"):
            xla_presets.check_platform(name, platform)


def test_tpu_flags_go_to_libtpu_init_args(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
    with pytest.raises(ConfigError, match="export LIBTPU_INIT_ARGS=.*--xla_tpu_enable_async_collective_fusion=true"):
        xla_presets.check_tpu_flags_exported("tpu_overlap", "tpu")
    xla_presets.export_tpu_flags("tpu_overlap")
    env = __import__("os").environ["LIBTPU_INIT_ARGS"]
    assert env.startswith("--xla_tpu_scoped_vmem_limit_kib=65536 ")    # the user's flags are kept
    assert env.count("--xla_tpu_overlap_compute_collective_tc=true") == 1
    xla_presets.export_tpu_flags("tpu_overlap")                         # idempotent
    assert __import__("os").environ["LIBTPU_INIT_ARGS"] == env
    xla_presets.check_tpu_flags_exported("tpu_overlap", "tpu")
    assert xla_presets.compiler_options("tpu_overlap", "tpu") == {}     # libtpu's, not the compile's


def test_trainer_compiles_with_its_preset():
    strategy = parse_strategy("data=2").with_options(xla_preset="gpu_overlap")
    trainer = Trainer(parse_model("llama-tiny"), strategy, TrainConfig(batch=2, seq=8), devices=jax.devices()[:2])
    assert trainer.compiler_options == xla_presets.PRESETS["gpu_overlap"].compiler_options("cpu")
    assert "xla_preset = \"gpu_overlap\"" in strategy.describe_options()
    with pytest.raises(ConfigError, match="option xla_preset='fast' is not one of none | gpu_overlap"):
        parse_strategy("data=2").with_options(xla_preset="fast")


# ---- the overlap report, on a scheduled module written by hand ----------------------------------

HAND_SCHEDULED = """HloModule hand, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p0: f32[4,8], w: f32[8,8]) -> f32[16,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %p0), replica_groups={{0,1,2,3}}, dimensions={0}
  %d1 = f32[8,8]{1,0} dot(f32[8,8]{1,0} %w, f32[8,8]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = f32[16,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[16,8]{1,0}) %ags)
  %ars = f32[16,8]{1,0} all-reduce-start(f32[16,8]{1,0} %agd), replica_groups={{0,1,2,3}}, to_apply=%add
  %neg = f32[8,8]{1,0} negate(f32[8,8]{1,0} %d1)
  %ard = f32[16,8]{1,0} all-reduce-done(f32[16,8]{1,0} %ars)
  ROOT %ar2 = f32[16,8]{1,0} all-reduce(f32[16,8]{1,0} %ard), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""


def test_overlap_report_reads_start_done_pairs():
    """By hand: the all-gather has a dot in flight (overlapped), the async all-reduce only a negate
    (asynchronous but exposed), the last all-reduce is synchronous."""
    report = overlap_report(HAND_SCHEDULED, ("tensor",), np.arange(4).reshape(4))
    assert report["asynchronous"] and report["decomposed"] == []
    rows = {r["kind"]: r for r in report["rows"]}
    ag, ar = rows["all-gather"], rows["all-reduce"]
    assert (ag["runs"], ag["async_runs"], ag["overlapped_runs"], ag["bytes"], ag["overlapped_bytes"]) == (1, 1, 1, 512, 512)
    assert (ar["runs"], ar["async_runs"], ar["overlapped_runs"], ar["bytes"], ar["overlapped_bytes"]) == (2, 1, 0, 1024, 0)
    text = format_overlap(report)
    assert "all-gather" in text and "100%" in text and "0%" in text
