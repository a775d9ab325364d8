"""Tests run on 8 simulated CPU devices; the flag must be set before JAX starts its backend."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)
