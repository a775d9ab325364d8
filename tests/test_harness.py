"""The test harness's own machinery (tests/harness.py), tested as any other code."""
import jax
import numpy as np
import pytest

from tests import harness


@pytest.mark.skipif(harness.memory_mappings() is None, reason="no /proc: the kernel's limit is not readable")
def test_release_compiled_code_unmaps_the_executables_jax_keeps():
    """Forty small executables, kept by their jitted functions' caches, map their machine code; releasing
    gives back at least half of those mappings (the rest are allocator slack), and below `share` of the
    kernel's limit nothing is released."""
    assert not harness.release_compiled_code(share=1.01)
    harness.release_compiled_code(share=0.0)   # from empty caches: no earlier test's executables freed mid-count
    before, _ = harness.memory_mappings()
    kept = [jax.jit(lambda x, i=i: jax.numpy.sin(x) * i) for i in range(40)]
    for f in kept:
        f(np.ones(4, np.float32)).block_until_ready()
    grown, _ = harness.memory_mappings()
    assert grown - before >= 40                        # each executable maps its code
    assert harness.release_compiled_code(share=0.0)
    after, _ = harness.memory_mappings()
    assert grown - after >= (grown - before) / 2
