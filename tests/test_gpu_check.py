"""experiments/gpu_check.py: its dry run on CPU writes every section with numbers; it runs from a checkout
where jaxpar is not installed (models/ and mesh_configs/ registered as jaxpar.models and
jaxpar.mesh_configs, as pyproject's package-dir installs them); the GPU plan's batches fill at most 70%
of the memory by the cost model; an out-of-memory step is retried once at half the batch."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar.cost import estimate
from jaxpar.models.config import parse_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def run_dry(tmp_path: pathlib.Path) -> dict:
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def check_train(row: dict) -> None:
    assert positive(row["step_s"], row["tokens_per_s"], row["mfu"], row["compile_s"]), row
    assert math.isclose(row["tokens_per_s"] * row["step_s"], row["batch"] * row["seq"]), row
    assert positive(row["xla_memory"]["total"], row["xla_memory"]["temp"], row["loss"]), row
    p = row["predicted"]
    assert positive(p["step_s"], p["mfu"], p["memory_bytes"], p["flops_per_step"]), p
    # one MFU convention: the script's count from the compiled parameters is the cost model's model FLOPs
    assert p["flops_per_step"] == pytest.approx(p["convention_flops_per_step"], rel=1e-9), p


def test_dry_run_writes_every_section_with_numbers(tmp_path):
    report = run_dry(tmp_path)
    assert report["mode"] == "dry-run" and report["versions"]["jax"]
    assert all(status == "ok" for status in report["imports"].values()), report["imports"]
    assert "6 N + 6 L s d_attn" in report["convention"]
    for section in ("train", "attention", "presets", "decode"):
        assert "error" not in report[section], report[section]

    measured = [r for r in report["train"]["rows"] if "step_s" in r]
    assert measured and all("error" not in r for r in report["train"]["rows"])
    for row in measured:
        check_train(row)
    fp8 = [r for r in measured if r["options"].get("dtype") == "float8"]   # XLA:CPU forms no float8 GEMM
    assert {r["options"]["fp8_recipe"] for r in fp8} == {"tensorwise", "blockwise"}, measured
    assert all(r["fp8_gemms"] == 0 for r in fp8) and all(r["fp8_gemms"] == 0 for r in measured)

    rows = {r["label"]: r for r in report["attention"]["rows"]}
    assert "skipped" in rows["cudnn"]   # CPU: cuDNN is GPU-only
    for name in ("dense", "xla"):
        assert positive(rows[name]["step_s"], rows[name]["tflops"], rows[name]["xla_memory"]["temp"]), rows[name]
        assert rows[name]["max_abs_diff_vs_dense"] < 0.05, rows[name]

    rows = {r["label"]: r for r in report["presets"]["rows"]}
    assert "skipped" in rows["tpu_overlap"] and "skipped" in rows["collective_matmul"]
    assert {"none", "gpu_overlap"} <= set(rows)
    for name in ("none", "gpu_overlap"):
        check_train(rows[name])

    for row in report["decode"]["rows"]:
        assert positive(row["decode_tokens_per_s"], row["per_token_latency_s"], row["time_to_first_token_s"]), row
        assert positive(row["roofline"]["bytes_per_step"], row["roofline"]["tokens_per_s"]), row
        assert positive(row["predicted"]["step_s"], row["predicted"]["tokens_per_s"]), row


def test_installed_jaxpar_needs_no_registration():
    assert load_script().add_checkout_packages(ROOT) == []


def test_checkout_packages_registered_without_an_install(tmp_path):
    """In a process whose editable-install finder is removed, `jaxpar.models` and `jaxpar.mesh_configs`
    exist only through `add_checkout_packages`; the strategy catalogue is then found under mesh_configs/."""
    code = f"""
import importlib.util, sys
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "_EditableFinder"]
assert importlib.util.find_spec("jaxpar") is None  # not installed here
spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.add_checkout_packages(module.ROOT))
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import MESH_CONFIG_DIR, parse_strategy
print(parse_model("llama-tiny").d_model, MESH_CONFIG_DIR, parse_strategy("fsdp8").size("fsdp"))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    registered, figures = proc.stdout.strip().splitlines()[-2:]
    assert registered == "['jaxpar.models', 'jaxpar.mesh_configs']"
    assert figures == f"64 {ROOT / 'mesh_configs'} 8"


def test_gpu_batches_fill_at_most_70_percent_of_80_gb():
    """The GPU plan's batches, from the cost model's memory (CPU devices give no limit: 80 GB is assumed):
    the largest power of two that fits 70%, so the next one does not."""
    script = load_script()
    plan = script.GPU
    for _, spec in plan.train:
        batch = script.choose_batch(spec, plan)
        def memory(b, spec=spec):
            return estimate(parse_model(spec), script.strategy_for(), "h100-sxm", b, plan.seq).memory.total
        assert batch & (batch - 1) == 0 and (memory(batch) <= 0.7 * 80e9 or batch == 1), (spec, batch)
        assert batch == plan.max_batch or memory(2 * batch) > 0.7 * 80e9, (spec, batch)


def test_out_of_memory_retries_once_at_half_the_batch(monkeypatch):
    script = load_script()
    calls = []

    def fake_row(spec, batch, seq, options, warmup, steps):
        calls.append(batch)
        if batch > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
        return {"params": 1, "batch": batch, "seq": seq, "options": dict(options), "step_s": 1.0,
                "tokens_per_s": 1.0, "mfu": 0.1, "peak_bytes_in_use": None, "xla_memory": {},
                "compile_s": 1.0, "loss": 1.0, "predicted": {"error": "none"}}

    monkeypatch.setattr(script, "train_row", fake_row)
    monkeypatch.setattr(script, "choose_batch", lambda spec, plan, **options: 4)
    assert script.train_with_fallback("m", "llama-tiny", script.DRY)["batch"] == 2 and calls == [4, 2]
    monkeypatch.setattr(script, "choose_batch", lambda spec, plan, **options: 8)
    calls.clear()
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        script.train_with_fallback("m", "llama-tiny", script.DRY)
    assert calls == [8, 4]
