"""GPU check: jaxpar's own program measured on one GPU, each figure beside the cost model's prediction.

    python experiments/gpu_check.py --out gpu_check.json    # one NVIDIA GPU: a few minutes on an H100
    python experiments/gpu_check.py --dry-run --out x.json  # on CPU: tiny shapes, every section, seconds
    python experiments/gpu_check.py --probe                 # versions, devices, which jaxpar modules import

Sections (each prints one line per figure and goes into the --out JSON; a section or a row that fails
prints its error in one line and the others still run; a row that would start after --budget-s seconds,
270 on a GPU, is skipped, so that the whole run stays within about five minutes; tests/test_gpu_check.py
runs the dry run):
  train      jaxpar's training step (`Trainer`, one device, `dtype = bfloat16`, dense attention) for llama
             models from llama-tiny to ~1B parameters at seq 2048: step time, tokens/s, MFU, the device's
             peak memory and XLA's memory analysis of the compiled step; the batch is the largest power of
             two whose predicted memory fills at most 70% of the device (halved once on out-of-memory).
             Each model again with `attention_kernel = auto` (cuDNN's flash kernel on a GPU). Then the ~1B
             model once per `attention_kernel` that runs on these devices (dense: the row above; blockwise
             everywhere; cudnn on an NVIDIA GPU; splash on a TPU) and with `auto` under `remat` selective,
             offload (each layer's input in host memory) and full, and in float8 (tensorwise, blockwise:
             jaxpar/ops/fp8.py), each with the count of cuBLASLt float8 GEMMs XLA formed in the step.
  attention  causal GQA attention alone at the ~1B model's shape, forward + backward: jaxpar's
             `dense_attention` against `jax.nn.dot_product_attention` with implementation "cudnn" (the
             fused flash kernel; GPU only) and "xla": time, achieved TFLOP/s, XLA's temporary memory, and
             the largest difference from the dense kernel's output (what a fused kernel buys).
  presets    the ~125M step compiled under each XLA preset of jaxpar/xla_presets.py: one GPU has no
             collectives to overlap, so this checks that XLA:GPU accepts every flag and that the step
             time does not suffer; `overlap = collective_matmul` needs tensor > 1 and is skipped.
  decode     jaxpar's generation (jaxpar/serving/generate.py, `dtype = bfloat16`: the weights converted to
             bfloat16 once as they load, a bfloat16 cache) at batch 1 and 32: decode tokens/s, per-token latency, time to first
             token, beside the HBM roofline (the decode step's argument bytes, read once per step, over
             the profile's bandwidth) and the cost model's decode estimate (jaxpar/cost/inference.py).
The predictions are `jaxpar.cost.estimate` and `inference_estimate` for hardware profile `h100-sxm`
(software `jaxpar`), the same calls `jaxpar estimate` makes (jaxpar/cli/commands_cost.py).

MFU convention (jaxpar.cost.flops.MODEL_FLOPS_CONVENTION, the one every command uses): model FLOPs per
token = 6 N + 6 L s d_attn, N the parameters that multiply (the matrices but the input embedding's lookup table),
L the attention layers, d_attn = heads x head_dim, s the sequence: the causal half of the s x s scores
(PaLM's appendix B counts the full s x s, 12 L s d_attn), over the profile's dense bf16 peak (989
TFLOP/s for h100-sxm).

Peak memory: `peak_bytes_in_use` of the device is the process's high-water mark (it cannot be reset
between rows), so each row also gives XLA's memory analysis of its own compiled step.

Runs from a checkout without installing jaxpar: pyproject installs models/ and mesh_configs/ as
jaxpar.models and jaxpar.mesh_configs; `add_checkout_packages` registers them from the folders when
they are not installed. jaxpar's modules are imported inside the sections, so that one that fails
under the installed jax reports its error in one line and the other sections still run.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import platform
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARDWARE = "h100-sxm"
MODULES = ("jaxpar.models.lm", "jaxpar.core.strategy", "jaxpar.training.trainer", "jaxpar.ops.attention",
           "jaxpar.serving.generate", "jaxpar.cost.estimate", "jaxpar.cost.inference", "jaxpar.xla_presets")
DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                 "flax", "optax", "numpy", "orbax-checkpoint")
KERNEL_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}  # fused attention kernels that run on one platform only
# llama shapes: tiny (the preset, at seq 2048), ~125M (GPT-3 small's width with GQA), ~1.1B (Llama 3.2 1B's
# width, depth and MLP with 16 heads of 128, vocab 32000)
TINY = "llama-tiny:max_seq=2048"
M125 = "llama-tiny:layers=12,d_model=768,heads=12,kv_heads=4,head_dim=64,mlp_dim=2048,vocab=32000,max_seq=2048"
M1B = "llama-tiny:layers=16,d_model=2048,heads=16,kv_heads=8,head_dim=128,mlp_dim=8192,vocab=32000,max_seq=2048"


# ---- running from a checkout ---------------------------------------------------------------------

def add_checkout_packages(root: pathlib.Path) -> list[str]:
    """Put `root` first on sys.path and register root/models and root/mesh_configs as jaxpar.models and
    jaxpar.mesh_configs where no installed jaxpar provides them; returns the names it registered."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import jaxpar  # noqa: PLC0415 (after sys.path names the checkout)
    registered = []
    for folder in ("models", "mesh_configs"):
        name = f"jaxpar.{folder}"
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        path = root / folder
        init = path / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
        else:  # a folder of data files only: a namespace package
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(path)]
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if spec.loader is not None:
            spec.loader.exec_module(module)
        setattr(jaxpar, folder, module)
        registered.append(name)
    return registered


# ---- the plan: shapes and counts of each mode ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    train: tuple[tuple[str, str], ...]          # (label, model spec)
    seq: int
    max_batch: int
    fixed_batch: int | None                     # None: the largest that fits (`choose_batch`)
    warmup: int
    steps: int
    attention: tuple[int, int, int, int, int]   # batch, seq, heads, kv_heads, head_dim
    presets_model: str
    presets: tuple[str, ...] | None             # None: every preset of jaxpar/xla_presets.py
    kernel_model: str                           # trained with each `attention_kernel` (dense, blockwise, cudnn)
    decode_model: str
    decode_batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    budget_s: float


GPU = Plan(train=(("llama-tiny", TINY), ("llama-125m", M125), ("llama-1b", M1B)), seq=2048, max_batch=32,
           fixed_batch=None, warmup=3, steps=10, attention=(4, 2048, 16, 8, 128), presets_model=M125, presets=None,
           kernel_model=M1B, decode_model=M1B, decode_batches=(1, 32), prompt=128, new_tokens=64, budget_s=270.0)
DRY = Plan(train=(("llama-tiny", "llama-tiny"),), seq=64, max_batch=2, fixed_batch=2, warmup=1, steps=2,
           attention=(1, 64, 4, 2, 16), presets_model="llama-tiny", presets=("none", "gpu_overlap", "tpu_overlap"),
           kernel_model="llama-tiny", decode_model="llama-tiny", decode_batches=(2,), prompt=8, new_tokens=4,
           budget_s=120.0)


class Clock:
    """Seconds since the start, and why a row is skipped once the time budget is spent."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> str | None:
        return f"time budget {self.budget_s:.0f} s spent" if self.elapsed() > self.budget_s else None


# ---- small helpers -------------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def guarded(label: str, fn: Callable[[], dict], quiet: bool = False) -> dict:
    """fn() or {"label", "error"}, printed in one line unless `quiet`: a failing row, prediction or
    section leaves the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (any failure is a reported result here)
        if not quiet:
            print(f"  {label}: FAILED {one_line(e)}", flush=True)
        return {"label": label, "error": one_line(e)}


def skipped(label: str, reason: str) -> dict:
    print(f"  {label}: skipped ({reason})", flush=True)
    return {"label": label, "skipped": reason}


def out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def xla_memory(compiled) -> dict[str, float]:
    """XLA's memory analysis of a compiled executable, in bytes (total = arguments + outputs - aliased + temp)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    out = {f.removesuffix("_size_in_bytes"): float(getattr(m, f, 0) or 0) for f in fields}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def device_stat(name: str) -> float | None:
    """A field of the first device's memory_stats() (peak_bytes_in_use, bytes_limit); None on CPU."""
    stats = jax.devices()[0].memory_stats()
    return float(stats[name]) if stats and name in stats else None


def timed(fn: Callable[[], Any], warmup: int, steps: int) -> float:
    """Mean seconds per call of `fn` over `steps` calls after `warmup` calls, dispatched back to back and
    waited for at the end (the device's throughput, not the host's round trips)."""
    out = None
    for _ in range(warmup):
        out = fn()
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def size(x: float | None) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point."""
    if x is None:
        return "n/a"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


# ---- versions and imports ------------------------------------------------------------------------

def versions() -> dict[str, Any]:
    found = {"python": platform.python_version(), "jax.__version__": jax.__version__}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def devices() -> list[dict[str, Any]]:
    return [{"platform": d.platform, "kind": d.device_kind, "id": d.id,
             "bytes_limit": (d.memory_stats() or {}).get("bytes_limit")} for d in jax.devices()]


def probe_imports() -> dict[str, str]:
    """Each module jaxpar needs here: "ok", or its import error in one line (e.g. a jax API this jax lacks)."""
    result = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
            result[name] = "ok"
        except Exception as e:  # noqa: BLE001 (reported, not raised)
            result[name] = one_line(e)
    return result


def print_header(report: dict) -> None:
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    for d in report["devices"]:
        print(f"device: {d['platform']} {d['kind']} (memory limit {size(d['bytes_limit'])})")
    if report.get("registered"):
        print("checkout packages registered: " + ", ".join(report["registered"]))
    for name, status in report["imports"].items():
        print(f"import {name}: {status}")
    print(report["convention"], flush=True)


# ---- section: training step ----------------------------------------------------------------------

def model_flops_per_token(m, seq: int, n_matmul: float) -> float:
    """6N + 6 L s d_attn: the convention's FLOPs per token (the causal half of the scores)."""
    return 6.0 * n_matmul + 6.0 * m.attention_layers * seq * m.heads * m.head_dim


def parameter_counts(m, abstract_params) -> tuple[int, float]:
    """(all parameters, those that multiply: the matrices but the input embedding's table, a lookup,
    unless the head shares it; the norms' scales are elementwise)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    scales = sum(math.prod(a.shape) for path, a in leaves if "norm" in jax.tree_util.keystr(path).lower())
    total = sum(math.prod(a.shape) for _, a in leaves)
    return total, float(total - scales - (0 if m.tie_embeddings else m.vocab * m.d_model))


def strategy_for(**options):
    """One device, bfloat16 compute (unless `options` name a dtype), and `options` (None: the default)."""
    from jaxpar.core.strategy import parse_strategy  # noqa: PLC0415 (module docstring: imports per section)
    return parse_strategy("data=1").with_options(**{"dtype": "bfloat16", **options}).resolved(1)


def choose_batch(spec: str, plan: Plan, **options) -> int:
    """The largest power of two up to plan.max_batch whose predicted memory (the cost model's jaxpar
    program) is at most 70% of the device's memory limit (80 GB where the device gives none)."""
    from jaxpar.cost import estimate  # noqa: PLC0415 (module docstring: imports per section)
    from jaxpar.models.config import parse_model  # noqa: PLC0415
    if plan.fixed_batch is not None:
        return plan.fixed_batch
    limit, m, st = device_stat("bytes_limit") or 80e9, parse_model(spec), strategy_for(**options)
    batch = 1
    while batch * 2 <= plan.max_batch and estimate(m, st, HARDWARE, batch * 2, plan.seq).memory.total <= 0.7 * limit:
        batch *= 2
    return batch


def predicted_train(m, strategy, batch: int, seq: int, per_token: float) -> dict:
    """The cost model's step (jaxpar/cost/estimate.py), its MFU under this script's convention too."""
    from jaxpar.cost import estimate, load_hardware  # noqa: PLC0415 (module docstring: imports per section)
    hw = load_hardware(HARDWARE)
    est = estimate(m, strategy, hw, batch, seq)
    return {"step_s": est.step_time_s, "mfu": per_token * batch * seq / (est.step_time_s * hw.peak_flops),
            "mfu_cost_model": est.mfu, "memory_bytes": est.memory.total, "flops_per_step": est.flops.model,
            "convention_flops_per_step": per_token * batch * seq}


@functools.cache
def train_row(spec: str, batch: int, seq: int, options: tuple, warmup: int, steps: int) -> dict:
    """One training step of `spec` under strategy `options`, compiled, timed, with its memory and the cost
    model's prediction (cached: the presets section reuses the train section's row for `none`)."""
    from jaxpar.cost import load_hardware  # noqa: PLC0415 (module docstring: imports per section)
    from jaxpar.models.config import parse_model  # noqa: PLC0415
    from jaxpar.training.data import Synthetic  # noqa: PLC0415
    from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: PLC0415

    m = parse_model(spec)
    tr = Trainer(m, strategy_for(**dict(options)), TrainConfig(batch=batch, seq=seq, steps=warmup + steps),
                 devices=jax.devices()[:1])
    t0 = time.perf_counter()
    compiled = tr.lower_step().compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": tr.init_state()}
    data = tr.batch(Synthetic(m.vocab), 0)

    def one_step():
        holder["state"], metrics = compiled(holder["state"], data)
        return metrics

    step_s = timed(one_step, warmup, steps)
    fp8_gemms = compiled.as_text().count(FP8_GEMM)
    loss = float(one_step()["loss"])
    del holder, data
    gc.collect()

    peak = load_hardware(HARDWARE).peak_flops
    params, n_matmul = parameter_counts(m, tr.abstract_params)
    per_token = model_flops_per_token(m, seq, n_matmul)
    tokens = batch * seq
    return {"model": spec, "params": params, "batch": batch, "seq": seq, "options": dict(options),
            "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": per_token * tokens / (step_s * peak),
            "loss": loss, "peak_bytes_in_use": device_stat("peak_bytes_in_use"), "xla_memory": xla_memory(compiled),
            "fp8_gemms": fp8_gemms,
            "predicted": guarded("prediction", lambda: predicted_train(m, tr.strategy, batch, seq, per_token),
                                 quiet=True)}


def train_with_fallback(label: str, spec: str, plan: Plan, **options) -> dict:
    """`train_row` at `choose_batch`'s batch, retried once at half of it when the device runs out of memory."""
    batch = choose_batch(spec, plan, **options)
    key = tuple(sorted(options.items()))
    try:
        row = train_row(spec, batch, plan.seq, key, plan.warmup, plan.steps)
    except Exception as e:
        if not out_of_memory(e) or batch == 1:
            raise
        row = None   # retried below, once the traceback (and the failed step's buffers it holds) is gone
    if row is None:
        print(f"  {label}: out of memory at batch {batch}; retrying at {batch // 2}", flush=True)
        gc.collect()
        row = train_row(spec, batch // 2, plan.seq, key, plan.warmup, plan.steps)
    row = {"label": label, **row}
    print_train(row)
    return row


def prediction_text(p: dict, text) -> str:
    """The cost model's figure as `text()` words it, or why it could not be had."""
    return text() if "error" not in p else f"prediction FAILED {p['error']}"


def print_train(row: dict) -> None:
    p, x = row["predicted"], row["xla_memory"]
    options = ", ".join(f"{k} {v}" for k, v in row["options"].items()) or "defaults"
    predicted = prediction_text(p, lambda: f"predicted {ms(p['step_s'])}, MFU {p['mfu']:.1%}, "
                                           f"memory {size(p['memory_bytes'])}")
    if row["options"].get("dtype") == "float8":
        options += f" (cuBLASLt float8 GEMMs in the compiled step: {row['fp8_gemms']})"
    print(f"  {row['label']} ({row['params'] / 1e6:.1f}M params) batch {row['batch']} x seq {row['seq']}, {options}: "
          f"step {ms(row['step_s'])}, {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}, peak in use {size(row['peak_bytes_in_use'])}, XLA {size(x.get('total'))} (temp "
          f"{size(x.get('temp'))}), compile {row['compile_s']:.1f} s, loss {row['loss']:.3f} | {predicted}", flush=True)


def kernel_options() -> list[tuple[str, dict]]:
    """(kernel, strategy options) for each choice of the strategy option `attention_kernel` but `auto` (which
    is one of the others): dense is the default, so its options are empty and its row is the train
    section's own run of the kernel model (train_row caches it)."""
    from jaxpar.core.strategy import CHOICES  # noqa: PLC0415 (module docstring: imports per section)
    return [(k, {} if k == "dense" else {"attention_kernel": k}) for k in CHOICES["attention_kernel"] if k != "auto"]


REMAT_ROWS = ("selective", "offload", "full")   # the kernel model with the fused kernel under each policy
FP8_ROWS = ("tensorwise", "blockwise")          # the kernel model with `auto`'s kernel in float8 by each recipe
FP8_GEMM = "__cublas$lt$matmul$f8"              # the custom call of a float8 GEMM XLA:GPU formed (docs/fp8.md)


def train_runs(plan: Plan) -> list[tuple[str, str, str | None, dict]]:
    """(label, model, kernel, options): each model of the plan with dense attention and with the kernel `auto`
    picks on these devices, the kernel model in float8 by each recipe of FP8_ROWS, with each attention
    kernel, and under each recompute policy of REMAT_ROWS with `auto`'s kernel."""
    name = dict((spec, label) for label, spec in plan.train).get(plan.kernel_model, plan.kernel_model)
    auto = {"attention_kernel": "auto"}
    runs = [(label, spec, None, {}) for label, spec in plan.train]
    runs += [(f"{label} auto", spec, "auto", auto) for label, spec in plan.train if spec != plan.kernel_model]
    runs += [(f"{name} auto float8 {r}", plan.kernel_model, "auto", {**auto, "dtype": "float8", "fp8_recipe": r})
             for r in FP8_ROWS]
    runs += [(f"{name} {k}", plan.kernel_model, k, options) for k, options in kernel_options()]
    runs += [(f"{name} auto remat={r}", plan.kernel_model, "auto", {**auto, "remat": r}) for r in REMAT_ROWS]
    return runs


def section_train(plan: Plan, clock: Clock) -> dict:
    """`train_runs`, each skipped where its kernel needs another platform or the time budget is spent."""
    device = jax.devices()[0].platform
    runs = train_runs(plan)
    rows = []
    for label, spec, kernel, options in runs:
        wanted = KERNEL_PLATFORM.get(kernel, device)
        reason = clock.spent() or (f"a {wanted.upper()} kernel (devices are {device})" if wanted != device else None)
        rows.append(skipped(label, reason) if reason else
                    guarded(label, lambda: train_with_fallback(label, spec, plan, **options)))
    return {"rows": rows}


# ---- section: attention kernels ------------------------------------------------------------------

def attention_kernels() -> dict[str, Callable]:
    """name -> f(q, k, v, positions): causal GQA attention [b, s, h, d]."""
    from jaxpar.ops.attention import dense_attention  # noqa: PLC0415 (module docstring: imports per section)

    def fused(implementation):
        return lambda q, k, v, pos: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                 implementation=implementation)
    return {"dense": lambda q, k, v, pos: dense_attention(q, k, v, pos, pos, causal=True),
            "cudnn": fused("cudnn"), "xla": fused("xla")}


def attention_row(name: str, kernel: Callable, inputs: tuple, reference, plan: Plan) -> tuple[dict, jax.Array]:
    """(row, output) of forward + backward of `kernel` (gradients of q, k, v for a fixed random cotangent;
    the output is returned too, for the comparison): time, achieved TFLOP/s on the causal work (6 b s^2 hq d:
    forward 2 matmuls, backward 4, each over half of s x s), XLA's memory analysis, and the output's
    largest difference from `reference` (dense's output; None where dense failed)."""
    q, k, v, pos, cotangent = inputs
    b, s, hq, hkv, d = plan.attention

    def loss(q, k, v):
        out = kernel(q, k, v, pos)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    step_s = timed(lambda: compiled(q, k, v), plan.warmup, plan.steps)
    out = compiled(q, k, v)[0][1].astype(jnp.float32)
    reference = out if name == "dense" else reference
    diff = None if reference is None else float(jnp.max(jnp.abs(out - reference)))
    row = {"label": name, "step_s": step_s, "tflops": 6.0 * b * s * s * hq * d / step_s / 1e12,
           "compile_s": compile_s, "xla_memory": xla_memory(compiled),
           "peak_bytes_in_use": device_stat("peak_bytes_in_use"),
           "max_abs_diff_vs_dense": diff}
    print(f"  {name}: forward+backward {ms(step_s)}, {row['tflops']:.1f} TFLOP/s (causal work), XLA temp "
          f"{size(row['xla_memory'].get('temp'))}, max |out - dense| {'n/a' if diff is None else f'{diff:.3g}'}, "
          f"compile {compile_s:.1f} s", flush=True)
    return row, out


def section_attention(plan: Plan, clock: Clock) -> dict:
    b, s, hq, hkv, d = plan.attention
    keys = jax.random.split(jax.random.key(0), 4)
    inputs = (jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16),
              jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16),
              jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16),
              jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
              jax.random.normal(keys[3], (b, s, hq, d), jnp.float32))
    device = jax.devices()[0].platform
    print(f"  shape: batch {b}, seq {s}, {hq} query heads, {hkv} kv heads, head_dim {d}, bfloat16, causal", flush=True)
    rows, outputs = [], {}
    for name, kernel in attention_kernels().items():   # dense first: the others are compared with its output
        reason = clock.spent() or (f"cuDNN needs an NVIDIA GPU (platform {device})"
                                   if name == "cudnn" and device != "gpu" else None)
        if reason:
            rows.append(skipped(name, reason))
            continue
        row = guarded(name, lambda: attention_row(name, kernel, inputs, outputs.get("dense"), plan))
        if isinstance(row, tuple):
            row, outputs[name] = row
        rows.append(row)
    return {"shape": {"batch": b, "seq": s, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": "bfloat16",
                      "causal": True}, "rows": rows}


# ---- section: XLA presets ------------------------------------------------------------------------

def preset_skip_reason(name: str) -> str | None:
    """Why preset `name` does not apply to these devices (XLA:CPU takes GPU fields and ignores them, so
    the dry run still checks their names)."""
    from jaxpar.xla_presets import PRESETS  # noqa: PLC0415 (module docstring: imports per section)
    family = {"cuda": "gpu", "rocm": "gpu"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    wanted = PRESETS[name].platform
    if wanted in ("any", family) or (family == "cpu" and wanted == "gpu"):
        return None
    return f"a {wanted.upper()} preset (devices are {family})"


def section_presets(plan: Plan, clock: Clock) -> dict:
    from jaxpar.xla_presets import NAMES  # noqa: PLC0415 (module docstring: imports per section)
    print(f"  model {plan.presets_model}", flush=True)
    rows = []
    for name in plan.presets or NAMES:
        reason = preset_skip_reason(name) or clock.spent()
        options = {} if name == "none" else {"xla_preset": name}  # `none`: the train section's step, if it ran
        rows.append(skipped(name, reason) if reason else
                    guarded(name, lambda: train_with_fallback(name, plan.presets_model, plan, **options)))
    rows.append(skipped("collective_matmul", "overlap = collective_matmul needs tensor > 1 with sequence_parallel; "
                                             "one GPU has tensor = 1"))
    return {"model": plan.presets_model, "rows": rows}


# ---- section: decode -----------------------------------------------------------------------------

def predicted_decode(m, strategy, batch: int, plan: Plan) -> dict:
    """The cost model's decode step at a full cache (jaxpar/cost/inference.py)."""
    from jaxpar.cost.inference import Request, inference_estimate  # noqa: PLC0415 (module docstring: imports per section)
    est = inference_estimate(m, strategy, HARDWARE, Request("decode", batch, plan.prompt, plan.new_tokens))
    return {"step_s": est.step_s, "tokens_per_s": est.tokens_per_s, "hbm_bytes": est.hbm_bytes, "bound": est.bound}


def decode_row(spec: str, batch: int, plan: Plan) -> dict:
    """jaxpar's generation of plan.new_tokens tokens after plan.prompt-token prompts (the second of two
    runs), beside the HBM roofline of its decode step and the cost model's."""
    from jaxpar.cost import load_hardware  # noqa: PLC0415 (module docstring: imports per section)
    from jaxpar.models.config import parse_model  # noqa: PLC0415
    from jaxpar.serving.generate import Generator  # noqa: PLC0415

    m = parse_model(spec)
    prompts = [[(7 * i + 3 * j + 1) % m.vocab for j in range(plan.prompt)] for i in range(batch)]
    gen = Generator(m, strategy_for(), prompts, plan.new_tokens, devices=jax.devices()[:1])
    gen.compile()
    params = gen.init_params()
    gen.generate(params, prompts)            # the first run pays for the executables' first launches
    result = gen.generate(params, prompts)
    del params
    gc.collect()
    step_bytes = xla_memory(gen.compiled_steps()[1]).get("argument")
    bw = load_hardware(HARDWARE).hbm_bw
    row = {"label": f"batch {batch}", "model": spec, "batch": batch, "prompt": plan.prompt,
           "new_tokens": plan.new_tokens, "compile_s": gen.compile_s,
           "time_to_first_token_s": result.time_to_first_token_s, "per_token_latency_s": result.per_token_latency_s,
           "decode_tokens_per_s": result.decode_tokens_per_s, "peak_bytes_in_use": device_stat("peak_bytes_in_use"),
           "roofline": {"bytes_per_step": step_bytes, "hbm_bw": bw, "step_s": step_bytes / bw,
                        "tokens_per_s": batch * bw / step_bytes},
           "predicted": guarded("prediction", lambda: predicted_decode(m, gen.strategy, batch, plan), quiet=True)}
    r, p = row["roofline"], row["predicted"]
    predicted = prediction_text(p, lambda: f"predicted {ms(p['step_s'])}, {p['tokens_per_s']:,.0f} tokens/s "
                                           f"({p['bound']}-bound)")
    print(f"  batch {batch}, prompt {plan.prompt}, {plan.new_tokens} new: {row['decode_tokens_per_s']:,.0f} decode "
          f"tokens/s, {ms(row['per_token_latency_s'])}/token, first token {ms(row['time_to_first_token_s'])}, "
          f"compile {row['compile_s']:.1f} s | roofline {size(step_bytes)}/step: {ms(r['step_s'])}, "
          f"{r['tokens_per_s']:,.0f} tokens/s | {predicted}", flush=True)
    return row


def section_decode(plan: Plan, clock: Clock) -> dict:
    rows = [skipped(f"batch {batch}", reason) if (reason := clock.spent()) else
            guarded(f"batch {batch}", lambda: decode_row(plan.decode_model, batch, plan))
            for batch in plan.decode_batches]
    return {"model": plan.decode_model, "weights": "bfloat16, converted once as they load", "rows": rows}


# ---- main ----------------------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[Plan, Clock], dict]] = {
    "train": section_train, "attention": section_attention, "decode": section_decode, "presets": section_presets}


def convention(peak_flops: float) -> str:
    return (f"MFU = (6 N + 6 L s d_attn) x tokens / (step time x {peak_flops / 1e12:.0f} TFLOP/s): N the parameters "
            "that multiply (not the embedding lookup), attention over the causal half of the s x s scores "
            "(jaxpar.cost.flops.MODEL_FLOPS_CONVENTION). Predictions: jaxpar.cost, "
            f"hardware {HARDWARE}, software jaxpar")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write every figure to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, tiny shapes: every section in seconds")
    parser.add_argument("--probe", action="store_true", help="print versions, devices and imports only")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of " + ", ".join(SECTIONS))
    parser.add_argument("--budget-s", type=float, help="skip the rows that would start after this many seconds")
    return parser.parse_args(argv)


def start_backend(dry_run: bool) -> None:
    """Before the backend starts (XLA reads its flags and JAX its platform once): the dry run on CPU
    with XLA's backend optimisations off (its timings mean nothing); a GPU run may use 92% of the
    device's memory (JAX's default preallocation takes 75%)."""
    if dry_run:
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                                   " --xla_llvm_disable_expensive_passes=true").strip()
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")


def header(dry_run: bool) -> dict[str, Any]:
    """Versions, devices, the checkout packages registered, each module's import, the MFU convention."""
    report: dict[str, Any] = {"mode": "dry-run" if dry_run else "gpu", "versions": versions(), "devices": devices(),
                              "registered": add_checkout_packages(ROOT)}
    report["imports"] = probe_imports()
    try:
        from jaxpar.cost import load_hardware  # noqa: PLC0415 (module docstring: imports per section)
        peak = load_hardware(HARDWARE).peak_flops
    except Exception:  # noqa: BLE001 (the profile's figure, written out)
        peak = 989e12
    report["convention"] = convention(peak)
    print_header(report)
    if not dry_run and report["devices"][0]["platform"] != "gpu":
        print(f"WARNING: no GPU ({report['devices'][0]['platform']} devices): these are not GPU figures", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_backend(args.dry_run)
    plan = DRY if args.dry_run else GPU
    plan = dataclasses.replace(plan, budget_s=args.budget_s) if args.budget_s else plan
    clock = Clock(plan.budget_s)
    report = header(args.dry_run)
    for name in [] if args.probe else args.sections.split(","):
        print(f"[{name}]", flush=True)
        report[name] = guarded(name, lambda: SECTIONS[name](plan, clock))
        print(f"  ({clock.elapsed():.0f} s so far)", flush=True)
    report["elapsed_s"] = clock.elapsed()
    print(f"done in {report['elapsed_s']:.0f} s", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
