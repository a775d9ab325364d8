"""Compile targets: jaxpar's steps compiled for a TPU topology ahead of time, on a host without a TPU.

`jaxpar comm` and `compare` compile on simulated CPU devices by default, with XLA:CPU, a compiler no one
trains on: it forms no reduce-scatter, issues no collective asynchronously, and its memory analysis is not
a TPU's. `--target tpu-v5e:2x4` (any topology libtpu names: v4, v5e, v5p, v6e, e.g. `tpu-v5p:8x8x4`)
compiles the same step with XLA:TPU instead: libtpu, installed by the `tpu-aot` extra, describes the
topology's chips as compile-only devices (`jax.experimental.topologies.get_topology_desc`, as MaxText's
train_compile.py does), and `jit(...).lower(...).compile()` over a mesh of them gives XLA:TPU's optimized
HLO and memory analysis. Nothing runs on those devices: anything executed stays on CPU devices.

The mesh axes map onto the chips as `jax.experimental.mesh_utils.create_device_mesh` lays them out on the
real slice (inner mesh axes along the torus's physical axes). `mesh_order` returns the chips in that
order, flattened, so that jaxpar.core.mesh.make_mesh's reshape rebuilds the same array.

`--target cpu` is the default (`None` here). A strategy must use every chip of the topology: a slice runs
one program on all its chips. One slice: libtpu describes several (`num_slices`), but XLA:TPU's module for
them numbers its device groups per slice, which the tally does not map onto the mesh; a `[mesh.dcn]` layout
is refused.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re

import jax
from jax.experimental import mesh_utils, topologies

from jaxpar.core.strategy import AXES, Strategy
from jaxpar.errors import ConfigError

PREFIX = "tpu-"
LIBTPU = "libtpu==0.0.52"  # the `tpu-aot` extra of pyproject.toml, paired with the installed jax
_ACCELERATOR_TYPES = {"v5e": "v5litepod", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}  # generation -> GCE type prefix
_TOPOLOGY = re.compile(r"(v\d+[a-z]*|tpu\d+x?):\d+(x\d+)*")


def parse_target(text: str | None) -> str | None:
    """The libtpu topology name of `--target` (`tpu-v5e:2x4` -> `v5e:2x4`), or None for `cpu`/absent."""
    if text is None or text == "cpu":
        return None
    name = text.removeprefix(PREFIX)
    if not text.startswith(PREFIX) or not _TOPOLOGY.fullmatch(name):
        raise ConfigError(f"--target {text!r}: expected cpu or tpu-GENERATION:SHAPE, e.g. tpu-v5e:2x4, "
                          "tpu-v5p:8x8x4, tpu-v6e:16x16, tpu-v4:4x4x4")
    return name


def check_libtpu(target: str) -> None:
    """Refuse a TPU target when libtpu, which holds XLA:TPU, is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"--target {target} compiles with XLA:TPU, which needs libtpu: "
                          f"pip install 'jaxpar[tpu-aot]' (or \"{LIBTPU}\")")


def topology(name: str) -> list:
    """The compile-only devices of libtpu's topology `name` (e.g. `v5e:2x4`), in libtpu's order."""
    check_libtpu(PREFIX + name)
    # libtpu locks a file so that one process drives a host's TPU chips; compile-only devices drive none,
    # and concurrent compiles (another analysis, a test worker) must not refuse each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # libtpu's start-up asks the host's metadata for its accelerator and workers, printing errors on a host
    # that is no TPU VM; naming one host of the target's generation answers it (the topology is `name`'s).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", _ACCELERATOR_TYPES.get(name.split(":")[0], "v5p") + "-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:
        raise ConfigError(f"--target {PREFIX}{name}: libtpu does not describe this topology: "
                          f"{str(e).splitlines()[0]}") from None


def devices(target: str | None, n: int) -> list:
    """What `comm` and `compare` compile for: the first `n` (simulated) JAX devices, or with a TPU
    `--target` all the chips of its topology."""
    name = parse_target(target)
    return jax.devices()[:n] if name is None else topology(name)


def mesh_order(chips: list, strategy: Strategy) -> list:
    """`chips` (a topology's) ordered so that reshaping them to `strategy`'s mesh gives
    `mesh_utils.create_device_mesh`'s layout on the real slice (module docstring)."""
    shape = tuple(strategy.size(a) for a in AXES)
    kind = chips[0].device_kind
    if math.prod(shape) != len(chips):
        raise ConfigError(f"--target: the topology has {len(chips)} chips ({kind}) but mesh {strategy.name} "
                          f"needs {math.prod(shape)}: a slice runs one program on all its chips")
    if strategy.dcn:
        raise ConfigError(f"mesh {strategy.name} has a [mesh.dcn] table (several slices over DCN); --target "
                          "compiles one TPU slice: drop [mesh.dcn], or analyse the multi-slice layout on CPU")
    try:
        array = mesh_utils.create_device_mesh(shape, chips, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError) as e:
        raise ConfigError(f"mesh {strategy.name} does not map onto the {len(chips)} {kind} chips' physical "
                          f"axes: {e}") from None
    return list(array.ravel())


def is_tpu_target(devices: list) -> bool:
    """Whether `devices` are a TPU topology's chips (then XLA:TPU compiles)."""
    return bool(devices) and devices[0].platform == "tpu"
