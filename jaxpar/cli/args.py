"""Command-line values into the objects the commands use: a model (preset, TOML or hf:DIR), a
strategy with the flags' options, and Hugging Face weights checked against the model."""
from __future__ import annotations

from jaxpar.core.strategy import OPTION_FIELDS, parse_strategy
from jaxpar.devices import backend_started
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.serving.hf import PREFIX, load_params, read_config
from jaxpar.xla_presets import export_tpu_flags


def model_from(spec: str):
    """A --model value: a preset (with overrides), a TOML path, or hf:DIR (a Hugging Face LLaMA-layout,
    Mixtral, Qwen3-MoE, DeepSeek-V3 or Mamba-2 checkpoint's config.json: jaxpar/serving/hf.py)."""
    return read_config(spec[len(PREFIX):]) if spec.startswith(PREFIX) else parse_model(spec)


def hf_params(directory: str, model, abstract_params):
    """Parameters from a Hugging Face checkpoint for `model`, whose shapes must be the checkpoint's."""
    theirs = read_config(directory)
    fields = ("layers", "d_model", "heads", "kv_heads", "head_dim", "mlp_dim", "vocab", "tie_embeddings", "pattern",
              "qk_norm", "experts", "top_k", "moe_mlp_dim", "router", "router_norm")
    differ = [f"{f}={getattr(model, f)} (checkpoint: {getattr(theirs, f)})" for f in fields
              if getattr(model, f) != getattr(theirs, f)]
    if differ:
        raise ConfigError(f"--hf-checkpoint {directory} is another model: {', '.join(differ)}; use --model hf:{directory}")
    return load_params(directory, model, abstract_params)


def strategy_from_args(args, spec: str | None = None):
    """The strategy of --mesh (or `spec`) with the strategy flags' options over the mesh file's."""
    strategy = parse_strategy(spec or args.mesh)
    strategy = strategy.with_options(**{f.name: getattr(args, f.name, None) for f in OPTION_FIELDS})
    if not backend_started():  # libtpu reads a TPU preset's flags once, when the backend starts
        export_tpu_flags(strategy.options.xla_preset)
    return strategy
