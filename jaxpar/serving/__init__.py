"""Serving: sharded generation (prefill and decode) and Hugging Face checkpoints."""
