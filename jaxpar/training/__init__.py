"""Training: the trainer (optimizer, sharded state, the jitted step, the loop), checkpoints and their
integrity, data and metrics."""
