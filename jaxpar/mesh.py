"""Named device meshes over the six canonical axes (jaxpar.strategy.AXES), Auto axis types.

Every mesh has all six axes, unused ones of size 1, so one rules table serves every strategy.
A strategy with a `[mesh.dcn]` table splits axes into an in-host part and an across-host part
(mesh_utils.create_hybrid_device_mesh); the across-host part is outermost.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError
from jaxpar.strategy import AXES, Strategy


def make_mesh(strategy: Strategy, devices: list | None = None) -> Mesh:
    """A Mesh for a resolved strategy over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    strategy = strategy.resolved(len(devices))
    shape = tuple(strategy.size(a) for a in AXES)
    if strategy.dcn:
        from jax.experimental import mesh_utils  # noqa: PLC0415
        dcn = dict(strategy.dcn)
        dcn_shape = tuple(dcn.get(a, 1) for a in AXES)
        for a, n in zip(AXES, dcn_shape):
            if strategy.size(a) % n:
                raise ConfigError(f"[mesh.dcn] {a}={n} does not divide mesh {a}={strategy.size(a)}")
        ici_shape = tuple(s // n for s, n in zip(shape, dcn_shape))
        array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
    else:
        array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(array, AXES, axis_types=(AxisType.Auto,) * len(AXES))

