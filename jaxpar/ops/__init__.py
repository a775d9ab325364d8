"""Kernels that need hand-written collectives (jax.shard_map) or a choice of implementation."""
