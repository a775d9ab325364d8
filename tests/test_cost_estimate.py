"""The estimate contract (docs/design.md), hardware profiles, and the human view."""
import dataclasses
import json
import pathlib

import pytest

from jaxpar.cost import MEGATRON, MEGATRON_CORE, estimate, format_estimate, known_profiles, load_hardware
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import parse_inline
from jaxpar.models.config import from_preset


def test_every_profile_loads():
    names = known_profiles()
    assert {"a100-80gb", "h100-sxm", "h200-sxm", "b200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"} <= set(names)
    for n in names:
        hw = load_hardware(n)
        assert hw.name == n and hw.peak_flops > 1e14


def test_unknown_hardware_names_the_known_ones():
    with pytest.raises(ConfigError, match="a100-80gb.*h100-sxm"):
        load_hardware("a100-40gb")


def test_user_profile_path(tmp_path: pathlib.Path):
    path = tmp_path / "mine.toml"
    path.write_text("[device]\npeak_flops = 1e15\nhbm_bytes = 1e11\nhbm_bw = 4e12\n"
                    "[links]\nintra_bw = 4e11\ninter_bw = 5e10\ndevices_per_node = 4\n")
    hw = load_hardware(str(path))
    assert hw.name == "mine" and hw.devices_per_node == 4 and not hw.calibrated
    path.write_text("[device]\npeak_flop = 1\n")
    load_hardware.cache_clear()
    with pytest.raises(ConfigError, match="unknown key.*peak_flop"):
        load_hardware(str(path))


def test_json_contract():
    m = from_preset("llama3-8b")
    st = parse_inline("data=2,fsdp=4,tensor=8").with_options(remat="full", sequence_parallel=True, dtype="bfloat16")
    out = estimate(m, st, "h100-sxm", 256, 8192).to_json()
    json.dumps(out)
    assert {"collectives", "flops_per_step", "step_time_s", "mfu", "tokens_per_s", "memory", "fits"} <= set(out)
    assert set(out["memory"]) == {"params", "grads", "optimizer", "activations", "total", "host"}
    assert 0 < out["mfu"] < 1 and isinstance(out["fits"], bool)
    assert out["tokens_per_s"] == pytest.approx(256 * 8192 / out["step_time_s"])
    for c in out["collectives"]:
        assert set(c) == {"kind", "axes", "count", "bytes", "wire_bytes", "phase"}
        assert c["kind"] in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
        assert c["phase"] in ("forward", "backward", "optimizer", "other")
    mem = out["memory"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"])


def test_fits_and_format():
    m = from_preset("llama3-70b")
    st = parse_inline("data=1").with_options(dtype="bfloat16")
    est = estimate(m, st, "h100-sxm", 8, 4096)
    assert not est.fits
    text = format_estimate(est)
    assert "does NOT fit" in text and "dominant:" in text and "collectives" in text
    est = estimate(from_preset("gpt3-175b"), parse_inline("data=16,pipeline=8,tensor=8").with_options(
        microbatches=16, remat="full", dtype="bfloat16"), "a100-80gb", 256, 2048, MEGATRON)
    assert est.fits and "fits in" in format_estimate(est)


def test_mamba_and_hybrid_estimates_run():
    for preset in ("mamba2-2.7b", "hybrid-tiny"):
        m = from_preset(preset)
        st = parse_inline("data=2,context=2,tensor=2").with_options(attention="ring", remat="dots_no_batch")
        est = estimate(m, st, "tpu-v5p", 16, 256 if preset == "hybrid-tiny" else 2048)
        assert 0 < est.mfu < 1 and est.memory.total > 0


def test_offload_is_bounded_by_the_hosts_memory():
    """What remat offload keeps on the host must fit the usable share of the device's host memory (a TPU v5e
    host: 512 GiB for 8 chips, 64 GiB each): Llama 3 70B with 8 sequences of 8,192 per chip offloads
    80 x 8 x 8,192 x 8,192 x 2 bytes = 85.9 GB, more than 92% of 64 GiB; with 4 sequences, 42.9 GB, it fits.
    A profile that states no host memory does not bound it; estimate prints the verdict."""
    m = from_preset("llama3-70b")
    st = parse_inline("fsdp=8").with_options(dtype="bfloat16", remat="offload").resolved(8)
    v5e = load_hardware("tpu-v5e")
    assert v5e.host_memory == 512 * 2**30 / 8
    big = estimate(m, st, v5e, 64, 8192, headroom=0.08)
    assert big.memory.host == 80 * 8 * 8192 * 8192 * 2 > 0.92 * v5e.host_memory
    assert not big.host_fits and not big.fits
    assert "does NOT fit in 58.9 GiB of 64.0 GiB host memory per device" in format_estimate(big)
    small = estimate(m, st, v5e, 32, 8192, headroom=0.08)
    assert small.memory.host == big.memory.host / 2 and small.host_fits
    unknown = estimate(m, st, dataclasses.replace(v5e, host_memory=0.0), 64, 8192, headroom=0.08)
    assert unknown.host_fits and "host memory not stated" in format_estimate(unknown)


def test_offload_keeps_the_unit_inputs_on_the_host_and_selective_recomputes_the_core():
    """remat offload: the host holds each unit's input, units x b x s x d in the compute dtype (a hand count),
    the device full's activations less those, and the copies cost host-link time only beyond the compute;
    a profile that states no host link refuses it. selective: none's memory less the scores, full's FLOPs
    no, the attention core's once more (Megatron reruns QK^T and PV: 4 b s^2 h d per layer, halved: its fused
    causal kernel computes the lower triangle)."""
    m = from_preset("llama3-8b")
    st = parse_inline("fsdp=8").with_options(dtype="bfloat16", grad_accum=2).resolved(8)
    est = {r: estimate(m, st.with_options(remat=r), "h100-sxm", 16, 4096) for r in ("none", "selective", "full", "offload")}
    tokens = 16 // 8 // 2 * 4096
    assert est["offload"].memory.host == m.layers * tokens * m.d_model * 2
    assert est["offload"].memory.activations < est["full"].memory.activations < est["selective"].memory.activations
    assert est["selective"].memory.activations < est["none"].memory.activations
    assert est["offload"].flops.hardware == est["full"].flops.hardware and est["offload"].time.host >= 0
    pcie = est["offload"].memory.host * 2 / (64e9 * 0.8)     # both ways over PCIe Gen5 at the link efficiency
    assert est["offload"].time.host == pytest.approx(max(0.0, pcie - est["offload"].time.compute))
    no_link = dataclasses.replace(load_hardware("h100-sxm"), host_bw=0.0)
    with pytest.raises(ConfigError, match="host_bw"):
        estimate(m, st.with_options(remat="offload"), no_link, 16, 4096)
    core = 4 * 16 * 4096 ** 2 * m.heads * m.head_dim * m.layers
    mega = {r: estimate(m, st.with_options(remat=r), "h100-sxm", 16, 4096, software=MEGATRON_CORE) for r in ("none", "selective")}
    assert mega["selective"].flops.recompute - mega["none"].flops.recompute == pytest.approx(core / 2, rel=1e-9)


@pytest.mark.parametrize("software", ["megatron-lm", "megatron-core", "nemo", "megatron-bridge", "torchtitan",
                                      "llm-foundry"])
def test_a_gpu_stack_prices_no_tpu(software, capsys):
    """A stack's preset prices only hardware it runs on (Software.platforms): CUDA stacks on a TPU are refused in
    one line naming the stacks that run there, by estimate, plan and the serving estimate alike."""
    from jaxpar.cli import main as cli
    from jaxpar.cost import SOFTWARE
    from jaxpar.cost.inference import Request, inference_estimate
    from jaxpar.planning.planner import plan
    m, st = from_preset("llama3-8b"), parse_inline("fsdp=8").resolved(8)
    line = f"software {SOFTWARE[software].name} runs on GPUs, not on tpu-v5p (TPU): --software jaxpar or maxtext"
    for call in (lambda: estimate(m, st, "tpu-v5p", 64, 4096, SOFTWARE[software]),
                 lambda: plan(m, "tpu-v5p", 8, 4096, 64, software=SOFTWARE[software]),
                 lambda: inference_estimate(m, st, "tpu-v5p", Request("decode", 8, 512, 128), SOFTWARE[software])):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value) == line
    assert cli.main(["estimate", "--model", "llama3-8b", "--mesh", "fsdp=8", "--hardware", "tpu-v5p",
                     "--software", software]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"jaxpar: error: {line}"
    assert estimate(m, st, "h100-sxm", 64, 4096, SOFTWARE[software]).tokens_per_s > 0   # on its own hardware


def test_the_tpu_stacks_price_a_tpu():
    from jaxpar.cost import SOFTWARE
    m, st = from_preset("llama3-8b"), parse_inline("fsdp=8").resolved(8)
    assert all(estimate(m, st, "tpu-v5p", 64, 4096, SOFTWARE[s]).tokens_per_s > 0 for s in ("jaxpar", "maxtext"))


def test_the_estimate_names_its_regime_and_says_where_no_run_calibrates_it(capsys, tmp_path):
    """`estimate` prints its layout's regime (stack, family, precision, PP >= 16, CP >= 8, MoE, > 1,024 devices)
    with its band, or that no run calibrates it; `--json` carries it as `band` (null where uncalibrated)."""
    import json
    from jaxpar.cli import main as cli
    from jaxpar.cost import band
    assert band.regime("megatron-core", "h100-sxm", "float8", {"pipeline": 16, "context": 8, "data": 16}, True) == \
        "megatron-core h100-sxm fp8 PP>=16 CP>=8 MoE >1024 devices"
    assert band.regime("jaxpar", "tpu-v5p", "bfloat16", {"fsdp": 8}, False) == "jaxpar tpu-v5p bf16"
    calibrated = band.regime_band("torchtitan h100-sxm fp8")
    cases = (("torchtitan", "h100-96gb-500w", "float8", "fsdp=8", calibrated),
             ("megatron-core", "h100-sxm", "float8", "data=2,pipeline=16", None))
    for software, hw, dtype, mesh, want in cases:
        out = tmp_path / f"{software}.json"
        assert cli.main(["estimate", "--model", "llama3-8b", "--mesh", mesh, "--hardware", hw, "--software", software,
                         "--dtype", dtype, "--global-batch", "64", "--json", str(out)]) == 0
        text = capsys.readouterr().out
        got = json.loads(out.read_text())["band"]
        if want is None:
            assert got is None and "regime megatron-core h100-sxm fp8 PP>=16: no calibrating run" in text
        else:
            assert got == {"regime": "torchtitan h100-sxm fp8", "low": want.low, "high": want.high, "count": want.count}
            assert f"regime torchtitan h100-sxm fp8: {want.low:+.1%} to {want.high:+.1%}" in text
