"""jaxpar.cost.overlap: the time model hides what jaxpar's overlap options issue beside compute, no more.

References: the same estimate without the option (compute, collectives and bytes must not move: the
options change the schedule, not the partitioning), and the seconds of the hidden collectives summed
from the prediction by hand (kind, axes and phase read off each record)."""
from __future__ import annotations

import dataclasses

import pytest

from jaxpar.cost import time as cost_time
from jaxpar.cost.estimate import estimate
from jaxpar.cost.hardware import load_hardware
from jaxpar.cost.software import MEGATRON_CORE
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import parse_strategy

M, HW = parse_model("llama3-8b"), load_hardware("h100-sxm")


def _run(mesh: str, batch: int = 256, **options):
    st = parse_strategy(mesh).with_options(**{"remat": "full", **options})
    st = st.resolved(st.num_devices)
    return st, estimate(M, st, HW, batch, 4096)


def _seconds(st, records) -> dict[str, float]:
    return cost_time.comm_seconds(tuple(records), st, HW)


def test_no_option_hides_nothing():
    st, e = _run("fsdp=4,tensor=2", sequence_parallel=True)
    assert e.time.data == e.time.data_total > 0
    assert e.time.tensor == pytest.approx(_seconds(st, e.predicted)["tensor"])


def test_fsdp_prefetch_hides_the_weight_gathers_only():
    st0, base = _run("fsdp=8")
    st, e = _run("fsdp=8", fsdp_prefetch=True)
    assert e.predicted == base.predicted and e.time.compute == base.time.compute
    gathers = [c for c in e.predicted if c[0] == "all-gather" and c[2] in ("forward", "backward")]
    assert gathers and e.time.data_total == pytest.approx(base.time.data_total)
    assert e.time.data == pytest.approx(base.time.data - _seconds(st, gathers)["data"])
    assert e.time.data >= _seconds(st, [c for c in e.predicted if c[0] == "reduce-scatter"])["data"] > 0


def test_collective_matmul_hides_the_tensor_rings_up_to_the_compute():
    st, e = _run("data=4,tensor=2", sequence_parallel=True, overlap="collective_matmul")
    _, base = _run("data=4,tensor=2", sequence_parallel=True)
    hidden = _seconds(st, [c for c in e.predicted if "tensor" in c[1] and c[0] != "all-reduce"])["tensor"]
    assert hidden > 0 and e.time.tensor == pytest.approx(_seconds(st, e.predicted)["tensor"] - hidden)
    assert e.time.total < base.time.total
    # never more than the projection GEMMs there are: on links 100x slower the rings outlast the matmuls
    # beside them, and the attention cores and the elementwise work hide none of the rest
    slow = dataclasses.replace(HW, intra_bw=HW.intra_bw / 100)
    slow_est = estimate(M, st, slow, 256, 4096)
    total = cost_time.comm_seconds(slow_est.predicted, st, slow)["tensor"]
    assert total > slow_est.time.compute
    assert total - slow_est.busy[0] <= slow_est.time.tensor < total - 0.8 * slow_est.busy[0]
    assert slow_est.time.tensor > total - slow_est.time.compute


def test_windowed_einsum_needs_sequence_parallelism():
    """Without SP tensor parallelism's collectives are all-reduces: XLA's windowed einsum takes none."""
    _, plain = _run("data=4,tensor=2")
    _, e = _run("data=4,tensor=2", xla_preset="gpu_windowed_einsum")
    assert e.time.tensor == pytest.approx(plain.time.tensor) and plain.time.tensor > 0
    _, sp = _run("data=4,tensor=2", sequence_parallel=True, xla_preset="gpu_windowed_einsum")
    assert sp.time.tensor < 0.01 * plain.time.tensor


def test_megatron_keeps_its_own_fractions_and_wrong_presets_are_refused():
    st = parse_strategy("fsdp=8").with_options(remat="full")
    e = estimate(M, st.with_options(fsdp_prefetch=True).resolved(8), HW, 256, 4096, software=MEGATRON_CORE)
    f = estimate(M, st.resolved(8), HW, 256, 4096, software=MEGATRON_CORE)
    assert e.time == f.time
    with pytest.raises(ConfigError, match="tpu_overlap is for TPU"):
        _run("fsdp=8", xla_preset="tpu_overlap")
