"""Named device meshes over the six canonical axes (jaxpar.core.strategy.AXES), Auto axis types.

Every mesh has all six axes, unused ones of size 1, so one rules table serves every strategy.

Hosts. In a multi-process run `jax.devices()` lists every process's devices, host by host, so the
plain reshape puts the outer axes (data, fsdp, ...) across hosts and the inner ones (tensor) inside
each. A strategy with a `[mesh.dcn]` table says which part of each axis crosses hosts: axis `a` of
size n = dcn[a] x ici[a], the across-host factor outermost, as `mesh_utils.create_hybrid_device_mesh`
lays it out. The granules are machines (jaxpar.distributed.process_hosts: one process per GPU is
common, so hosts are not processes), or slices on multi-slice TPU (there mesh_utils builds it, to
follow the torus). In one process (simulated devices) consecutive groups of devices stand in for
hosts, so an analysis of a multi-host layout sees the device order a real run would.
`jaxpar.core.validate.check_hosts` then refuses tensor-parallel groups that cross hosts unless asked.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.core import validate
from jaxpar.devices import is_compile_only
from jaxpar.distributed import process_hosts
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import AXES, Strategy


def make_mesh(strategy: Strategy, devices: list | None = None) -> Mesh:
    """A Mesh for a resolved strategy over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    strategy = strategy.resolved(len(devices))
    shape = tuple(strategy.size(a) for a in AXES)
    host = host_of(devices)
    if strategy.dcn:
        dcn_shape = tuple(dict(strategy.dcn).get(a, 1) for a in AXES)
        for a, n, size in zip(AXES, dcn_shape, shape):
            if size % n:
                raise ConfigError(f"[mesh.dcn] {a}={n} does not divide mesh {a}={size}")
        ici_shape = tuple(s // n for s, n in zip(shape, dcn_shape))
        array = hybrid_device_array(ici_shape, dcn_shape, devices, host)
    else:
        array = np.asarray(devices, dtype=object).reshape(shape)
    validate.check_hosts(strategy, np.vectorize(host.__getitem__, otypes=[int])(array), AXES)
    return Mesh(array, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def host_of(devices: list) -> dict:
    """device -> host number. The devices of a TPU topology compiled for ahead of time
    (jaxpar/analysis/target.py) belong to no process: they form one slice, whose chips ICI joins, so
    they are one granule (multi-slice topologies would be one per slice)."""
    if is_compile_only(devices[0]):
        return {d: getattr(d, "slice_index", 0) for d in devices}
    hosts = process_hosts()
    return {d: hosts[d.process_index] for d in devices}


def hybrid_device_array(ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...], devices: list,
                        host: dict) -> np.ndarray:
    """Devices laid out so that axis i = dcn_shape[i] host groups x ici_shape[i] devices inside one."""
    granules = math.prod(dcn_shape)
    if getattr(devices[0], "platform", "") == "tpu" and len({d.slice_index for d in devices}) > 1:
        return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
    devices = sorted(devices, key=lambda d: (host[d], d.process_index, d.id))
    hosts = len(set(host.values()))
    if hosts > 1 and hosts != granules:
        raise ConfigError(f"[mesh.dcn] spans {granules} hosts ({' x '.join(map(str, dcn_shape))}) but the run "
                          f"has {hosts} hosts; the across-host factors must multiply to the host count")
    if len(devices) % granules:
        raise ConfigError(f"[mesh.dcn] asks for {granules} hosts, which does not divide {len(devices)} devices")
    # Array axes (dcn..., ici...) -> interleave each axis's (dcn, ici) pair, dcn outermost.
    grid = np.asarray(devices, dtype=object).reshape(dcn_shape + ici_shape)
    n = len(AXES)
    order = [k for i in range(n) for k in (i, n + i)]
    return grid.transpose(order).reshape(tuple(a * b for a, b in zip(dcn_shape, ici_shape)))
