"""Tests run on 8 simulated CPU devices; the flag must be set before JAX starts its backend."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Cheaper LLVM code generation: compiles ~3x faster on 2 cores. It changes neither the HLO passes
# (so the collective tallies are the same) nor float semantics.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import pytest  # noqa: E402

# `make test` runs two pytest-xdist workers, each taking one test file at a time (--dist loadfile) in
# collection order: the longest files go first (longest-processing-time-first), so that neither worker is
# left with a long file at the end. Seconds on a 2-core machine (`pytest --durations=0`, summed per file).
LONGEST_FIRST = ("test_strategies.py",      # ~200: every catalogue strategy vs one device, and its HLO walk
                 "test_experiments.py",     # ~130: every script's --quick run in its own process
                 "test_checkpoint_cli.py",  # ~80: runs in fresh processes
                 "test_multiprocess.py", "test_moe.py", "test_pipeline.py", "test_mamba_model.py",
                 "test_cost_vs_hlo.py", "test_cost_vs_xla.py", "test_checkpoint.py", "test_inference.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's own order is kept
