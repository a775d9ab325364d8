"""Shared, cached pieces for the strategy tests: the 1-device reference and one Trainer per strategy.

Compiling a train step costs seconds on a 2-core machine, so every test that needs the trainer of a
(model, strategy) pair gets the same instance, compiled once per session.
"""
from __future__ import annotations

import functools
import gc
import pathlib

import jax
import numpy as np

from jaxpar.training.data import Synthetic
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import TrainConfig, Trainer, gather
from jaxpar.models.config import parse_model

TC = TrainConfig(batch=16, seq=32, steps=10, lr=3e-3, warmup=3)
STEPS = 10


def distinct(strategies: list) -> list:
    """One strategy per distinct (mesh, options), under its shortest name: a catalogue entry that trains
    like another (a layout named for its use, e.g. infer-tp8 or h100-node-tp8 = tp8) is checked once."""
    seen: dict = {}
    for s in sorted(strategies, key=lambda s: (len(s.name), s.name)):
        seen.setdefault((s.mesh, s.options), s)
    return sorted(seen.values(), key=lambda s: s.name)


def trainer(model: str, mesh: str, devices: int = 8, **options) -> Trainer:
    return _trainer(model, mesh, devices, tuple(sorted(options.items())))


@functools.cache
def _trainer(model: str, mesh: str, devices: int, options: tuple) -> Trainer:
    strategy = parse_strategy(mesh).with_options(**dict(options))
    return Trainer(parse_model(model), strategy, TC, devices=jax.devices()[:devices])


def compiled_step(model: str, mesh: str, devices: int = 8, **options):
    """The trainer's step compiled once per session, from shapes, as `jaxpar comm` compiles it (its
    options equal the tests' XLA_FLAGS): the trajectories run this executable and the communication
    tests read its HLO, so each strategy's step is compiled once for both."""
    return _compiled_step(trainer(model, mesh, devices, **options))


@functools.cache
def _compiled_step(tr: Trainer):
    from jaxpar.analysis import comm  # noqa: PLC0415
    return tr.lower_step().compile(comm.ANALYSIS_COMPILER_OPTIONS)


@functools.cache
def reference_params(model: str):
    """Parameters initialised on one device (host numpy)."""
    return gather(trainer(model, "data=1", devices=1).init_state().params)


def source(model: str) -> Synthetic:
    return Synthetic(parse_model(model).vocab, seed=0)


@functools.cache
def loss_and_grads(model: str, mesh: str, devices: int = 8, **options):
    tr = trainer(model, mesh, devices, **options)
    state = tr.state_from_params(reference_params(model))
    loss, grads = tr.loss_and_grads(state.params, tr.batch(source(model), 0))
    return float(loss), gather(grads)


@functools.cache
def trajectory(model: str, mesh: str, devices: int = 8, **options) -> tuple[np.ndarray, object]:
    """Losses of STEPS steps from the reference parameters, and the final state."""
    tr = trainer(model, mesh, devices, **options)
    step_fn = compiled_step(model, mesh, devices, **options)
    state = tr.state_from_params(reference_params(model))
    losses = []
    for step in range(STEPS):
        state, metrics = step_fn(state, tr.batch(source(model), step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def leaves_with_paths(tree):
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def assert_matches_one_device(model: str, mesh: str, devices: int = 8, **options) -> None:
    """Loss (rtol 1e-5) and every gradient leaf (rtol 1e-5 of the leaf's scale) equal the 1-device run."""
    ref_loss, ref_grads = loss_and_grads(model, "data=1", devices=1)
    loss, grads = loss_and_grads(model, mesh, devices, **options)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref = dict(leaves_with_paths(ref_grads))
    got = dict(leaves_with_paths(grads))
    assert got.keys() == ref.keys()
    for path, g in got.items():
        np.testing.assert_allclose(g, ref[path], rtol=1e-5, atol=1e-5 * np.max(np.abs(ref[path])), err_msg=path)


def compiled_text(model: str, mesh: str, devices: int = 8, **options) -> str:
    """Optimized HLO of the trainer's step (the executable `trajectory` runs)."""
    return compiled_step(model, mesh, devices, **options).as_text()


def clear_caches() -> None:
    """Drop every cached trainer, compiled step and result (tests/conftest.py: near the kernel's limit of
    memory mappings, the compiled steps held here are what keeps a worker's code mapped)."""
    for cached in (_trainer, _compiled_step, reference_params, loss_and_grads, trajectory):
        cached.cache_clear()


# ---- a long-lived test process under the kernel's memory-mapping limit --------------------------------

MAPS = pathlib.Path("/proc/self/maps")
MAP_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")


def memory_mappings() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where Linux's /proc does not say."""
    try:
        with MAPS.open() as f:
            held = sum(1 for _ in f)
        return held, int(MAP_LIMIT.read_text())
    except (OSError, ValueError):
        return None


def near_map_limit(share: float = 0.5) -> bool:
    """Whether this process holds more than `share` of the kernel's limit of memory mappings."""
    counts = memory_mappings()
    return counts is not None and counts[0] >= share * counts[1]


def release_compiled_code(share: float = 0.5) -> bool:
    """Empty JAX's caches of compiled executables when this process's memory mappings pass `share` of the
    kernel's limit (Linux vm.max_map_count, 65,530 by default), and collect garbage: each executable XLA:CPU
    compiles maps its machine code, JAX keeps every one while its jitted function's cache lives, and when mmap
    fails inside LLVM's code allocator the compile dies with SIGSEGV, not an error (seen in the slow run's
    long-lived pytest worker after ~50,000 mappings). Executables a caller holds itself stay mapped: drop
    those first. Returns whether it released."""
    if not near_map_limit(share):
        return False
    jax.clear_caches()
    gc.collect()
    return True
