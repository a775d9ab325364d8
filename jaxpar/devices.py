"""Simulated CPU devices. Imports nothing from JAX: the flag must be set before the backend starts."""
from __future__ import annotations

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
    if backend_started():
        import jax  # noqa: PLC0415
        have = jax.device_count()
        if have != n:
            raise ConfigError(f"--devices {n} asked after JAX already started with {have} devices; "
                              "set it before the first JAX computation (or in a fresh process)")
        return
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)


def with_device_count(xla_flags: str, n: int) -> str:
    """`xla_flags` with the device-count flag set to n (any earlier value replaced, others kept)."""
    flags = re.sub(rf"{FLAG}=\S+", "", xla_flags).split()
    return " ".join(flags + [f"{FLAG}={n}"])


def backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # noqa: PLC0415
        return bool(xla_bridge._backends)  # noqa: SLF001 (no public way to ask)
    except Exception:  # pragma: no cover - jax internals moved
        return False
