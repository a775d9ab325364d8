"""Compiler scheduling presets: named sets of XLA options that let communication hide behind compute.

A strategy's option `xla_preset` picks one (mesh file `[options] xla_preset = "gpu_overlap"`, or
`--xla-preset` on the command line); `none` keeps XLA's defaults. The partitioning is the same under
every preset (same collectives, same bytes: `jaxpar comm` shows it); what changes is the schedule:
whether a collective is issued asynchronously, how early, and what compute runs while it is in flight
(`jaxpar comm`'s overlap report reads that from the compiled HLO: jaxpar/analysis/overlap.py).

How the options reach XLA
    GPU options are fields of XLA's DebugOptions; they are passed to each compile
    (`jax.jit(..., compiler_options=...)`), so one process can compile with and without a preset.
    The installed jaxlib must know every field: tests/test_xla_presets.py compiles with each GPU
    preset on XLA:CPU, which accepts (and ignores) GPU fields but refuses unknown ones. Flag names
    change between jaxlib releases (e.g. the boolean `xla_gpu_enable_pipelined_all_gather` became
    the enum `xla_gpu_pipeline_all_gather`); that test is what catches a rename.
    TPU options belong to libtpu, which reads them once, from the LIBTPU_INIT_ARGS environment
    variable, when the backend starts. `jaxpar` sets it before JAX starts (`export_tpu_flags`); in a
    process whose TPU backend already runs, a preset whose flags are missing is refused with the line
    to export.

Sources: JAX's "GPU performance tips" and NVIDIA JAX-Toolbox's "Tips for high-performance LLMs with JAX
and XLA" (GPU flags, what they do); MaxText's TPU run scripts (the LIBTPU_INIT_ARGS set below is the one
they export for large dense models). The effect of each preset is measured on an accelerator only
(experiments/bench_overlap.py); on XLA:CPU collectives are synchronous and these options change nothing.
"""
from __future__ import annotations

import dataclasses
import os

from jaxpar.errors import ConfigError

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    value: object
    does: str   # what the flag changes, in one line


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    platform: str                 # "gpu", "tpu", or "any" (none)
    flags: tuple[Flag, ...] = ()
    summary: str = ""

    def compiler_options(self, platform: str) -> dict[str, object]:
        """The DebugOptions to pass to a compile on `platform` (GPU presets only; XLA:CPU takes and
        ignores GPU fields, which is how the tests check the names)."""
        if self.platform != "gpu" or platform not in ("gpu", "cuda", "rocm", "cpu"):
            return {}
        return {f.name: f.value for f in self.flags}

    def libtpu_args(self) -> str:
        """The LIBTPU_INIT_ARGS words of a TPU preset ('' for others)."""
        if self.platform != "tpu":
            return ""
        return " ".join(f"--{f.name}={str(f.value).lower()}" for f in self.flags)


_GPU_OVERLAP = (
    Flag("xla_gpu_enable_latency_hiding_scheduler", True,
         "schedule with XLA's latency-hiding scheduler: each async collective's start is moved as early and "
         "its done as late as the data dependences allow, with independent compute placed in between"),
    Flag("xla_gpu_enable_highest_priority_async_stream", True,
         "run collectives on a high-priority CUDA stream so that concurrent compute kernels do not delay them"),
    Flag("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_ON",
         "collective pipeliner: move a loop iteration's all-gather into the previous iteration (FSDP's next-"
         "layer weight gather runs during this layer's compute)"),
    Flag("xla_gpu_pipeline_reduce_scatter", "COLLECTIVE_PIPELINING_MODE_ON",
         "collective pipeliner: finish a loop iteration's reduce-scatter in the next iteration (a layer's "
         "gradient reduction runs during the previous layer's backward)"),
    Flag("xla_gpu_pipeline_all_reduce", "COLLECTIVE_PIPELINING_MODE_ON",
         "collective pipeliner for all-reduces inside loops (tensor parallelism without SP)"),
    Flag("xla_gpu_enable_while_loop_double_buffering", True,
         "unroll loops by two so that pipelined collectives alternate between two buffers"),
    Flag("xla_gpu_all_gather_combine_threshold_bytes", 256 * _MIB,
         "merge independent all-gathers up to this size (fewer, larger NCCL calls; one per scanned layer)"),
    Flag("xla_gpu_reduce_scatter_combine_threshold_bytes", 256 * _MIB,
         "merge independent reduce-scatters up to this size"),
    Flag("xla_gpu_all_reduce_combine_threshold_bytes", 256 * _MIB,
         "merge independent all-reduces up to this size"),
)

_GPU_WINDOWED = _GPU_OVERLAP + (
    Flag("xla_gpu_threshold_for_windowed_einsum_mib", 0,
         "decompose every all-gather -> einsum and einsum -> reduce-scatter pair into a loop of collective-"
         "permutes and partial einsums (the compiler's own collective matmul), whatever their size"),
    Flag("xla_gpu_multi_streamed_windowed_einsum", True,
         "run the decomposed einsums and their permutes on separate streams so that they overlap"),
)

_TPU_OVERLAP = (
    Flag("xla_tpu_enable_async_collective_fusion", True, "issue collectives as asynchronous fusions"),
    Flag("xla_tpu_enable_async_collective_fusion_fuse_all_gather", True, "include all-gathers in them"),
    Flag("xla_tpu_enable_async_collective_fusion_multiple_steps", True,
         "let an asynchronous collective span several compute steps"),
    Flag("xla_tpu_overlap_compute_collective_tc", True, "overlap collectives with TensorCore compute"),
    Flag("xla_enable_async_all_gather", True, "all-gathers asynchronous (start/done pairs)"),
    Flag("xla_tpu_enable_data_parallel_all_reduce_opt", True,
         "overlap the data-parallel gradient all-reduces with the backward pass"),
    Flag("xla_tpu_data_parallel_opt_different_sized_ops", True, "... also when the reduced tensors differ in size"),
)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("none", "any", (), "XLA's defaults"),
    Preset("gpu_overlap", "gpu", _GPU_OVERLAP,
           "latency-hiding scheduler, pipelined collectives inside layer loops, combined collectives"),
    Preset("gpu_windowed_einsum", "gpu", _GPU_WINDOWED,
           "gpu_overlap + XLA's decomposed (windowed) einsums: collective matmul by the compiler"),
    Preset("tpu_overlap", "tpu", _TPU_OVERLAP, "asynchronous collective fusion and data-parallel all-reduce overlap"),
)}
NAMES: tuple[str, ...] = tuple(PRESETS)


def _family(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def check_platform(name: str, platform: str) -> None:
    """A GPU preset on TPU devices (or the reverse) is a mistake, not a no-op; XLA:CPU takes any preset
    (its compiles check GPU flag names; nothing changes in its schedule)."""
    preset = PRESETS[name]
    family = _family(platform)
    if preset.platform in ("any", family) or family == "cpu":
        return
    others = ", ".join(n for n, p in PRESETS.items() if p.platform in ("any", family))
    raise ConfigError(f"xla_preset={name} is for {preset.platform.upper()} devices, but the devices are "
                      f"{platform}: use one of {others}")


def export_tpu_flags(name: str) -> None:
    """Before JAX starts: append a TPU preset's flags to LIBTPU_INIT_ARGS (harmless where no TPU loads)."""
    args = PRESETS[name].libtpu_args()
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    if args and args not in current:
        os.environ["LIBTPU_INIT_ARGS"] = f"{current} {args}".strip()


def check_tpu_flags_exported(name: str, platform: str) -> None:
    """On a TPU backend that already started, the preset's flags must have been in LIBTPU_INIT_ARGS."""
    args = PRESETS[name].libtpu_args()
    if _family(platform) == "tpu" and args and args not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        raise ConfigError(f"xla_preset={name}: libtpu reads its flags once, when the TPU backend starts, and it "
                          f"started without them; run with\n  export LIBTPU_INIT_ARGS=\"{args}\"")


def compiler_options(name: str, platform: str) -> dict[str, object]:
    """What a compile on `platform` takes for preset `name`, after the checks above (before compiling)."""
    check_platform(name, platform)
    check_tpu_flags_exported(name, platform)
    return PRESETS[name].compiler_options(platform)


def describe(name: str) -> str:
    """The preset and its flags, one per line, for --help and docs."""
    p = PRESETS[name]
    lines = [f"{p.name} ({p.platform}): {p.summary}"]
    lines += [f"  --{f.name}={f.value}: {f.does}" for f in p.flags]
    return "\n".join(lines)


if __name__ == "__main__":   # python -m jaxpar.xla_presets: every preset, its flags and what each does
    print("\n\n".join(describe(n) for n in NAMES))
