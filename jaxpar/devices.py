"""Simulated CPU devices: XLA's CPU backend reads its device count from XLA_FLAGS once, when it starts.

Importing JAX does not start the backend; its first computation (or `jax.devices()`) does. This module
imports nothing from JAX, so `jaxpar estimate` and `jaxpar plan`, which use it, never load JAX.

With libtpu installed (the `tpu-aot` extra, for compiling to TPU topologies: jaxpar/analysis/target.py),
JAX's backend start also tries a TPU: on a host without one it prints errors about unset TPU_* variables
and holds libtpu's lock file for the process's life. `cpu_without_accelerator` (with --devices or
without) then names the platform (JAX_PLATFORMS=cpu) when the user set none and the host has no
accelerator device files (/dev/accel*, /dev/vfio/N: TPU; /dev/nvidia0: NVIDIA GPU), so that a GPU or TPU
host keeps its devices. libtpu still describes TPU topologies to the compiler under it."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys

from jaxpar.errors import ConfigError

FLAG = "--xla_force_host_platform_device_count"
MAX_DEVICES = 2048  # XLA:CPU compiles SPMD programs for at most this many devices (more abort inside XLA)


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA's CPU backend for `n` devices, keeping any other XLA_FLAGS the user set.

    Raises ConfigError if JAX's backend already started with a different count: the flag would
    be silently ignored otherwise.
    """
    if n < 1:
        raise ConfigError(f"--devices must be >= 1, got {n}")
    if n > MAX_DEVICES:
        raise ConfigError(f"--devices {n}: XLA:CPU simulates and compiles for at most {MAX_DEVICES} devices "
                          "(`jaxpar comm` analyses bigger meshes at reduced data parallelism from their full sizes)")
    if backend_started():  # then JAX is imported: sys.modules holds it
        have = sys.modules["jax"].device_count()
        if have != n:
            raise ConfigError(f"--devices {n} asked after JAX already started with {have} devices; "
                              "set it before the first JAX computation (or in a fresh process)")
        return
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    cpu_without_accelerator()


def cpu_without_accelerator() -> None:
    """Name the CPU platform (JAX_PLATFORMS=cpu, `cpu_without_accelerator`, also for a run without --devices) when the user set none, libtpu is installed and the host
    has no accelerator device files, so that JAX's backend start does not try a TPU that is not there
    (module docstring). Before the backend starts; a no-op after."""
    if backend_started() or "JAX_PLATFORMS" in os.environ:
        return
    if importlib.util.find_spec("libtpu") and not has_accelerator():
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:  # jax reads JAX_PLATFORMS when it is imported
            sys.modules["jax"].config.update("jax_platforms", "cpu")


def has_accelerator() -> bool:
    """Whether this host has TPU or NVIDIA GPU device files (module docstring)."""
    return any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*"))


def with_device_count(xla_flags: str, n: int) -> str:
    """`xla_flags` with the device-count flag set to n (any earlier value replaced, others kept)."""
    flags = re.sub(rf"{FLAG}=\S+", "", xla_flags).split()
    return " ".join(flags + [f"{FLAG}={n}"])


def backend_started() -> bool:
    """Whether JAX's backend already started in this process (its device count is then fixed). JAX has no
    public way to ask; its backend registry (`jax._src.xla_bridge._backends`) is read from sys.modules, as a
    process that has not imported JAX has not started it."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def is_compile_only(device) -> bool:
    """Whether `device` is one of a TPU topology's devices described by libtpu for ahead-of-time compiles
    (`jax.experimental.topologies`): it compiles but runs nothing, and belongs to no process's host.
    jax exposes no predicate; such devices come from a client of the class CompileOnlyPyClient."""
    return type(getattr(device, "client", None)).__name__ == "CompileOnlyPyClient"
