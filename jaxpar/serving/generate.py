"""Sharded generation: a prefill step and a decode step under a strategy, the cache sharded by the
rules table like a parameter, and sampling.

Follow one cached K block from the model to the devices:
  1. models/decode.py names it ("layers", "cache_batch", "cache_seq", "cache_kv_heads", "head_dim");
  2. jaxpar/core/rules.py maps cache_batch -> data x fsdp x expert, cache_kv_heads -> tensor, layers -> pipeline;
  3. `Generator` creates the cache born sharded (jit with out_shardings) and jits the prefill and the
     decode step with the cache donated (its buffers are reused for the updated cache) and the same
     shardings in and out, so the cache never moves between steps.

When tensor > kv_heads, K/V heads are replicated across tensor ranks (Megatron's rule,
`rules_for(..., replicate_kv_heads=True)`): the K/V projections are replicated and the cache holds
tensor/kv_heads copies of each head, one per rank that reads it.

A run: the prompts are left-padded to the longest (models/decode.py says why), the prefill writes
their state and samples the first new token (its time is the time to first token), and each decode
step feeds the newest token of every sequence at cache slot P + t and samples the next.

Serving weights: the parameters are held in the decode layout's `dtype` (float32 by default; with
bfloat16 they are converted once, as they load, keeping their shardings), since a decode step reads
every weight once and is bound by those bytes; the prefill casts them to its own dtype when it
differs. The cache is held in the decode dtype too (models/decode.py `cache_layout`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core import validate
from jaxpar.core.mesh import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.ops.attention import AttentionCore, token_permutation
from jaxpar.core.sharding import Layout, model_layout, param_shardings, spec_for, use_layout
from jaxpar.core.strategy import Strategy, resolve_kernel
from jaxpar.models import decode
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.training.checkpoint import flatten, restore_arrays, unflatten
from jaxpar.training.trainer import TrainState
from jaxpar.xla_workarounds import compile_initializer


INDEX_MASKED = ("cudnn", "splash")  # attention kernels whose causal mask compares indices (jaxpar/ops/attention.py)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: temperature 0 is greedy (argmax); otherwise
    softmax(logits / temperature) restricted to the top_k most likely tokens (0: all) and to the
    smallest set of most likely tokens whose probability reaches top_p (1.0: all), drawn with a key
    derived from `seed` and the step, so a run is reproducible."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Token ids [b] (int32) from float32 logits [b, vocab]."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < s.top_p  # the mass before a token is < top_p
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def pad_prompts(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to `width`: (tokens [b, width] int32, 0 at pads; positions [b, width] int32,
    0.. along each prompt and decode.PAD_POSITION at pads)."""
    tokens = np.zeros((len(prompts), width), np.int32)
    positions = np.full((len(prompts), width), decode.PAD_POSITION, np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, width - len(prompt):] = prompt
        positions[i, width - len(prompt):] = np.arange(len(prompt))
    return tokens, positions


@dataclasses.dataclass(frozen=True)
class Result:
    """One generation: tokens [b, max_new_tokens]; logits [b, max_new_tokens, vocab] when asked for."""
    tokens: np.ndarray
    time_to_first_token_s: float          # the prefill, up to the first token on the host
    decode_step_s: tuple[float, ...]      # each decode step's latency (max_new_tokens - 1 of them)
    compile_s: float
    logits: np.ndarray | None = None
    reshard_s: float = 0.0                # prefill layout -> decode layout (weights and cache), when they differ

    @property
    def per_token_latency_s(self) -> float:
        """Mean decode step time: the time between two tokens of one sequence."""
        return float(np.mean(self.decode_step_s)) if self.decode_step_s else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Every generated token over the whole run (prefill included)."""
        return self.tokens.size / (self.time_to_first_token_s + self.reshard_s + sum(self.decode_step_s))

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated by the decode steps over their time (the batch's decode throughput)."""
        n = self.tokens.shape[0] * len(self.decode_step_s)
        return n / sum(self.decode_step_s) if n else math.nan

    def to_json(self) -> dict[str, Any]:
        """The tokens and timings; the decode figures are null when max_new_tokens = 1 (no decode step)."""
        decoded = bool(self.decode_step_s)
        return {"tokens": self.tokens.tolist(), "time_to_first_token_s": self.time_to_first_token_s,
                "per_token_latency_s": self.per_token_latency_s if decoded else None,
                "decode_step_s": list(self.decode_step_s), "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s if decoded else None, "compile_s": self.compile_s,
                "reshard_s": self.reshard_s}


@dataclasses.dataclass(frozen=True)
class PhaseLayout:
    """Where one phase runs: its resolved strategy, mesh and layout, and the shardings of the
    parameters, the cache, the token rows [b, s] and the one-token vectors [b] on that mesh."""
    name: str
    strategy: Strategy
    mesh: Any
    layout: Layout
    params: Any
    cache: Any
    rows: NamedSharding
    vector: NamedSharding


def kv_copies(model: ModelConfig, *tensors: int) -> int:
    """How many copies of each K/V head the cache holds so that every layout's tensor ranks each find
    the head they read: tensor/kv_heads when tensor > kv_heads (Megatron's rule), the least common
    multiple over the phases' layouts."""
    if not model.has_attention:
        return 1
    return math.lcm(*(t // model.kv_heads if t > model.kv_heads else 1 for t in tensors))


def as_dtype(tree, dtype):
    """`tree` (arrays or ShapeDtypeStructs, e.g. an nnx.State) with its floating leaves in `dtype`; host
    arrays are converted on the host, abstract leaves described in `dtype`."""
    dtype = jnp.dtype(dtype)

    def one(a):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == dtype:
            return a
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding)
        return a.astype(dtype)
    return jax.tree.map(one, tree)


def generation_run(strategy: Strategy) -> RunConfig:
    """How the model executes in a generation step under `strategy`: its dtype, attention kernel (the
    prefill's; a decode step reads the cache densely) and MoE kernel; plain projections, no remat (the
    training-only options do not apply)."""
    o = strategy.options
    return RunConfig(dtype=o.dtype, core=AttentionCore(kernel=o.attention_kernel), moe_kernel=o.moe_kernel)


def prompt_width(model: ModelConfig, strategy: Strategy, longest: int) -> int:
    """The padded prompt width P: the longest prompt, rounded up so that a context-parallel prefill
    splits it into equal pieces (2 per context rank under zigzag), each at least the conv halo
    (d_conv - 1 tokens) long for Mamba-2 (jaxpar.core.validate.check_mamba). The extra columns are left
    pads, identity steps for every layer."""
    cp = strategy.size("context")
    if cp == 1:
        return longest
    pieces = cp * (2 if strategy.options.cp_layout == "zigzag" else 1)
    width = -(-longest // pieces) * pieces
    if model.has_mamba:
        width = max(width, pieces * (model.d_conv - 1))
    return width


class Generator:
    """The prefill and decode steps of one model under one strategy, for `batch` prompts left-padded
    to `prompt_len` and `max_new_tokens` new tokens each, validated and compiled once.

    The strategy's [prefill] and [decode] layouts (jaxpar/core/strategy.py) may differ: the prefill then
    runs on its mesh, and the weights and the filled cache are resharded onto the decode layout
    (jax.device_put with the decode shardings) before the first decode step. Parameters are given
    to `generate` in the prefill layout (`init_params`, `place_params`, `restore_params`)."""

    def __init__(self, model: ModelConfig, strategy: Strategy, prompts: list[list[int]], max_new_tokens: int,
                 sampling: Sampling = Sampling(), devices: list | None = None):
        devices = list(jax.devices() if devices is None else devices)
        validate.check_phases(strategy)
        self.strategy = strategy.resolved(len(devices))
        validate.check_generate(model, self.strategy, prompts, max_new_tokens)
        self.model_cfg, self.sampling, self.max_new_tokens = model, sampling, max_new_tokens
        pre, dec = self.strategy.phase("prefill"), self.strategy.phase("decode")
        self.batch, self.prompt_len = len(prompts), prompt_width(model, pre, max(len(p) for p in prompts))
        self.run, self.prefill_run = generation_run(dec), generation_run(pre)
        self.check_prefill_kernel(prompts, devices[0].platform)
        self.weight_dtype = jnp.dtype(dec.options.dtype)   # the serving weights' dtype (module docstring)
        self.kv_copies = kv_copies(model, pre.size("tensor"), dec.size("tensor"))
        cp = pre.size("context")
        self.order = (token_permutation(self.prompt_len, cp, pre.options.cp_layout)
                      if cp > 1 and pre.options.cp_layout != "contiguous" else None)

        abstract = nnx.eval_shape(lambda: LM(model, self.run, rngs=nnx.Rngs(0)))
        self.graphdef, self.master_params = nnx.split(abstract)   # float32, as training holds them
        self.abstract_params = as_dtype(self.master_params, self.weight_dtype)
        self.prefill_graphdef = nnx.graphdef(nnx.eval_shape(lambda: LM(model, self.prefill_run, rngs=nnx.Rngs(0))))
        length = self.prompt_len + max_new_tokens - 1  # the last new token is never fed back
        self.cache_layout = decode.cache_layout(model, self.run, self.batch, length, self.kv_copies)
        self.prefill = self._phase("prefill", pre, devices)
        same = (dec.mesh, dec.options, dec.dcn) == (pre.mesh, pre.options, pre.dcn)
        self.decode = self.prefill if same else self._phase("decode", dec, devices)
        self.resharded = self.decode is not self.prefill
        # the layout the parameters are given in, and the cache's (as the decode step wants it)
        self.mesh, self.layout = self.decode.mesh, self.decode.layout
        self.param_shardings, self.cache_shardings = self.prefill.params, self.decode.cache

        replicated = lambda ph: NamedSharding(ph.mesh, P())  # noqa: E731
        out = lambda ph: dict(out_shardings=(ph.vector, ph.layout.activation("batch", "act_vocab"), ph.cache),  # noqa: E731
                              donate_argnums=1)
        p, d = self.prefill, self.decode
        self._prefill = jax.jit(self._prefill_step, in_shardings=(p.params, p.cache, p.rows, p.rows, replicated(p)),
                                **out(p))
        self._decode = jax.jit(self._decode_step, in_shardings=(
            d.params, d.cache, d.vector, d.vector, replicated(d), replicated(d)), **out(d))
        self._new_cache = jax.jit(lambda: decode.init_cache(self.cache_layout), out_shardings=p.cache)
        self._to_weights = jax.jit(lambda t: as_dtype(t, self.weight_dtype), in_shardings=(p.params,),
                                   out_shardings=p.params)
        self._compiled: tuple | None = None
        self.compile_s = 0.0

    def _phase(self, name: str, strategy: Strategy, devices: list) -> PhaseLayout:
        mesh = make_mesh(strategy, devices)
        layout = model_layout(mesh, strategy, self.model_cfg)
        rules = layout.rules("activations")
        cache = jax.tree.map(lambda s: NamedSharding(mesh, spec_for(s.names, rules, mesh)),
                             self.cache_layout, is_leaf=decode.is_slot)
        return PhaseLayout(name, strategy, mesh, layout, param_shardings(self.abstract_params, layout), cache,
                           layout.activation("batch", None), layout.activation("batch"))

    def phase(self, name: str) -> PhaseLayout:
        """The prefill or decode layout."""
        return {"prefill": self.prefill, "decode": self.decode}[name]

    def describe(self) -> str:
        """The layouts, as the report prints them."""
        if not self.resharded:
            return self.strategy.describe()
        return (f"prefill on {self.prefill.strategy.describe()}, decode on {self.decode.strategy.describe()} "
                "(weights and cache resharded between them)")

    def check_prefill_kernel(self, prompts: list[list[int]], platform: str) -> None:
        """The prefill's attention kernel against its layout and the devices (jaxpar/core/validate.py), and
        against left padding: the kernels whose causal mask compares indices (INDEX_MASKED) would let a
        prompt's tokens read the pad columns before it, so they take only prompts of the padded width
        (`prompt_len`)."""
        pre = self.strategy.phase("prefill")
        validate.check_attention_kernel(pre)
        kernel = resolve_kernel(pre.options.attention_kernel, pre.options.dtype)
        width, lengths = self.prompt_len, sorted({len(p) for p in prompts})
        if kernel in INDEX_MASKED and lengths != [width] and self.model_cfg.has_attention:
            named = f"attention_kernel={kernel}" + (" (what auto picks here)" if kernel != pre.options.attention_kernel
                                                    else "")
            raise ConfigError(f"generate: {named} masks by index, but prompts of lengths {lengths} are left-padded "
                              f"to {width} tokens and pads must be masked by position; give prompts of one length "
                              "or use --attention-kernel blockwise")
        validate.check_backend(pre, platform)

    # ---- parameters -----------------------------------------------------------------------------
    def init_params(self, seed: int = 0):
        """Freshly initialised parameters (as training initialises them), born sharded, in the serving dtype."""
        model, run, dt = self.model_cfg, self.run, self.weight_dtype
        lowered = jax.jit(lambda: as_dtype(nnx.state(LM(model, run, rngs=nnx.Rngs(seed))), dt),
                          out_shardings=self.param_shardings).lower()
        return compile_initializer(lowered, self.mesh.devices.flat[0].platform)()

    def place_params(self, params):
        """Given parameters (host or device arrays, an nnx.State; float32 masters or already in the serving
        dtype) in this strategy's shardings and the serving dtype. Host arrays are converted before they
        move, device arrays on their devices."""
        host = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else as_dtype(np.asarray(a), self.weight_dtype),
                            params)
        return self.to_weights(jax.device_put(host, self.param_shardings))

    def to_weights(self, params):
        """Sharded parameters (in this strategy's shardings) in the serving dtype: one jitted conversion
        whose outputs keep the inputs' shardings; the identity when they are in it already."""
        if all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self.abstract_params))):
            return params
        return self._to_weights(params)

    def restore_params(self, directory: str, step: int | None = None) -> tuple[Any, str]:
        """(parameters, message) from a training checkpoint in `directory` (newest step unless given),
        read straight into this strategy's shardings as the float32 masters it holds (its checksums are
        of those bytes), then converted to the serving dtype; the optimizer state is not read."""
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              jax.eval_shape(lambda: self.master_params), self.param_shardings)
        template = TrainState(params, None, None)  # the checkpoint's tree, of which only the params are read
        flat, _, message = restore_arrays(directory, dataclasses.asdict(self.model_cfg), flatten(template), step)
        return self.to_weights(unflatten(template, flat).params), message

    def bytes_per_device(self) -> dict[str, int]:
        """What generation holds on each device of the decode layout: the weights' and the cache's bytes (each
        array's shard on one device: sharded arrays split evenly, replicated ones whole)."""
        def held(tree, shardings, is_leaf=None):
            return sum(math.prod(sh.shard_shape(tuple(a.shape))) * jnp.dtype(a.dtype).itemsize
                       for a, sh in zip(jax.tree.leaves(tree, is_leaf=is_leaf), jax.tree.leaves(shardings)))
        params = jax.eval_shape(lambda: self.abstract_params)
        return {"weights": held(params, self.decode.params),
                "cache": held(self.cache_layout, self.decode.cache, decode.is_slot)}

    # ---- the steps ------------------------------------------------------------------------------
    def _model(self, params, prefill: bool) -> LM:
        run, graphdef = (self.prefill_run, self.prefill_graphdef) if prefill else (self.run, self.graphdef)
        return nnx.merge(graphdef, as_dtype(params, run.dtype))  # the identity where the weights are in it

    def _prefill_step(self, params, cache, tokens, positions, key):
        with use_layout(self.prefill.layout):
            logits, cache = decode.forward(self._model(params, True), tokens, positions, cache, 0,
                                           prefill=True, order=self.order)
            return sample(logits, jax.random.fold_in(key, 0), self.sampling), logits, cache

    def _decode_step(self, params, cache, token, position, index, key):
        with use_layout(self.decode.layout):
            logits, cache = decode.forward(self._model(params, False), token[:, None], position[:, None], cache, index,
                                           prefill=False)
            return sample(logits, jax.random.fold_in(key, index), self.sampling), logits, cache

    def compile(self) -> float:
        """Compile both steps from shapes (once); returns the seconds it took."""
        if self._compiled is None:
            t0 = time.perf_counter()
            sds = lambda tree, sh: jax.tree.map(  # noqa: E731
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
            p, d = self.prefill, self.decode
            params = jax.eval_shape(lambda: self.abstract_params)
            cache = jax.eval_shape(lambda: decode.init_cache(self.cache_layout))
            rows = jax.ShapeDtypeStruct((self.batch, self.prompt_len), jnp.int32, sharding=p.rows)
            vector = jax.ShapeDtypeStruct((self.batch,), jnp.int32, sharding=d.vector)
            key = jax.eval_shape(lambda: jax.random.key(0))
            index = jax.ShapeDtypeStruct((), jnp.int32)
            self._compiled = (self._prefill.lower(sds(params, p.params), sds(cache, p.cache), rows, rows, key).compile(),
                              self._decode.lower(sds(params, d.params), sds(cache, d.cache), vector, vector, index,
                                                 key).compile())
            self.compile_s = time.perf_counter() - t0
        return self.compile_s

    def compiled_steps(self) -> tuple:
        """(prefill, decode) executables, compiled once (for `jaxpar comm --phase`)."""
        self.compile()
        return self._compiled

    def generate(self, params, prompts: list[list[int]], *, seed: int | None = None,
                 keep_logits: bool = False) -> Result:
        """Generate max_new_tokens after each prompt (as many prompts as this generator's batch, none
        longer than its prompt_len), sampling with `seed` (default: the Sampling's seed; the key is an
        argument of the compiled steps, so another seed compiles nothing)."""
        if len(prompts) != self.batch or max(map(len, prompts)) > self.prompt_len:
            raise ValueError(f"this generator takes {self.batch} prompts of at most {self.prompt_len} tokens")
        validate.check_generate(self.model_cfg, self.strategy, prompts, self.max_new_tokens)
        self.check_prefill_kernel(prompts, self.prefill.mesh.devices.flat[0].platform)
        self.compile()
        prefill, step = self._compiled
        tokens, positions = pad_prompts(prompts, self.prompt_len)
        if self.order is not None:  # the prefill's token layout (decode.forward finds the last token)
            tokens, positions = tokens[:, self.order], positions[:, self.order]
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens, positions = (jax.device_put(a, self.prefill.rows) for a in (tokens, positions))
        key = jax.random.key(self.sampling.seed if seed is None else seed)  # step t draws with fold_in(key, its cache slot)
        cache = self._new_cache()
        jax.block_until_ready((key, cache))

        t0 = time.perf_counter()
        token, logits, cache = prefill(params, cache, tokens, positions, key)
        out = [np.asarray(token)]
        ttft = time.perf_counter() - t0
        kept = [np.asarray(logits)] if keep_logits else []
        reshard_s = 0.0
        if self.resharded and self.max_new_tokens > 1:  # onto the decode layout: weights, cache, token
            t0 = time.perf_counter()
            params, cache, token = jax.device_put((params, cache, token),
                                                  (self.decode.params, self.decode.cache, self.decode.vector))
            jax.block_until_ready((params, cache, token))
            reshard_s = time.perf_counter() - t0
        steps = []
        for t in range(self.max_new_tokens - 1):
            t0 = time.perf_counter()
            position = jax.device_put(lengths + t, self.decode.vector)
            token, logits, cache = step(params, cache, token, position, np.int32(self.prompt_len + t), key)
            out.append(np.asarray(token))
            steps.append(time.perf_counter() - t0)
            if keep_logits:
                kept.append(np.asarray(logits))
        return Result(np.stack(out, axis=1), ttft, tuple(steps), self.compile_s,
                      np.stack(kept, axis=1) if keep_logits else None, reshard_s)
