"""Training: optimizer, sharded state, the jitted step, and the loop.

Follow one parameter from the model to the devices:
  1. the model annotates it with logical names (models/layers.py: `param`);
  2. `jaxpar.core.sharding.param_shardings` looks the names up in the strategy's rules table;
  3. `Trainer` initialises it under jit with those out_shardings, so it is born sharded;
  4. the step is jitted with the same shardings in and out, and XLA inserts the collectives.
"""
from __future__ import annotations

import functools
import math
import signal
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core import validate
from jaxpar.core.inputs import check_host_memory
from jaxpar.core.mesh import make_mesh
from jaxpar.core.sharding import model_layout, optimizer_shardings, param_shardings, use_layout
from jaxpar.core.strategy import Strategy, resolve_kernel
from jaxpar.cost.flops import Kernels, step_flops
from jaxpar.models.config import ModelConfig
from jaxpar.models.run import RunConfig
from jaxpar.models.lm import LM
from jaxpar.models.moe import AUX_FIELDS, aux_metrics, is_balance_bias
from jaxpar.errors import ConfigError
from jaxpar.ops.attention import AttentionCore, token_permutation
from jaxpar.ops.collective_matmul import Matmuls
from jaxpar.ops.fp8 import RECIPES
from jaxpar.ops.layer_scan import KEEP_UNITS, LayerScan
from jaxpar.ops.mamba_cp import SSMKernels
from jaxpar.pipeline import (pipelined_loss, pipelined_loss_and_grads, reorder, split_microbatches, stacked_paths,
                             unit_order)
from jaxpar.training import faults
from jaxpar.training.config import TrainConfig
from jaxpar.training.data import local_batch, process_indices, to_global
from jaxpar.xla_presets import compiler_options
from jaxpar.xla_workarounds import cast, compile_initializer, gathered


def make_schedule(tc: TrainConfig) -> optax.Schedule:
    """The learning rate of each update (optax counts updates from 0: step k, counted from 1, uses
    schedule(k - 1)): linear warmup from 0 over `warmup` updates, then the decay to the floor at update
    `steps`."""
    o, warmup = tc.optimizer, tc.warmup
    floor = tc.lr * o.min_lr_ratio
    if o.schedule == "cosine" and warmup:
        return optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup_steps=warmup,
                                                  decay_steps=max(tc.steps, warmup + 1), end_value=floor)
    span = max(tc.steps - warmup, 1)
    decay = {"cosine": lambda: optax.cosine_decay_schedule(tc.lr, span, alpha=o.min_lr_ratio),
             "linear": lambda: optax.linear_schedule(tc.lr, floor, span),
             "constant": lambda: optax.constant_schedule(tc.lr)}[o.schedule]()
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, tc.lr, warmup), decay], [warmup])


def make_optimizer(tc: TrainConfig, model: ModelConfig | None = None) -> optax.GradientTransformation:
    """AdamW on `make_schedule`, after global-norm clipping (the identity when clip is 0: the same
    empty state, so checkpoints restore across clip settings). A model with DeepSeek-V3's balancing bias
    (router_bias) moves it apart, by -router_bias_update x the sign of its gradient, the experts' overload
    (models/moe.py `balance_probe`): no moments, no weight decay, outside the clipped norm."""
    o = tc.optimizer
    clip = optax.clip_by_global_norm(o.clip) if o.clip > 0 else optax.identity()
    adamw = optax.chain(clip, optax.adamw(make_schedule(tc), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    if model is None or not model.router_bias:
        return adamw
    balance = optax.chain(optax.scale_by_sign(), optax.scale(-model.router_bias_update))
    return optax.multi_transform({"gradient": adamw, "balance": balance}, balance_labels)


def balance_labels(params):
    """"balance" for each MoE layer's balancing bias, "gradient" for every other parameter."""
    return jax.tree_util.tree_map_with_path(lambda p, _: "balance" if is_balance_bias(p) else "gradient", params)


def gradient_norm(grads) -> jax.Array:
    """The global norm of the loss's gradients (a balancing bias's is its experts' overload: left out)."""
    return optax.tree.norm(jax.tree_util.tree_map_with_path(
        lambda p, g: jnp.zeros_like(g) if is_balance_bias(p) else g, grads))


STATE_BYTES_PER_PARAM = 16  # float32 parameter, gradient and two Adam moments


class TrainState(NamedTuple):
    params: Any      # nnx.State of float32 master weights
    opt_state: Any
    step: jax.Array


def run_config(strategy: Strategy, seq: int | None = None) -> RunConfig:
    """How the model executes under `strategy`: the one place strategy options reach the model, each choosing
    an implementation (models/run.py): the projections' (plain dots or collective matmul rings, `overlap`),
    the attention core's (`attention`, `attention_kernel`, recomputed under remat "selective"), the layer
    scan's (`remat`, `fsdp_prefetch`), Mamba-2's kernels (split over `context`), under a remat that
    recomputes the unit the attention output projection gathered once for both its reads, and for
    sequences of `seq` tokens their stored order (`token_order`); under dtype=float8 the projections' scaling
    recipe (`fp8_recipe`), the rest in bfloat16, and whether FSDP gathers their weights in float8 (`fp8_gather`:
    the output projection too, in place of its `gathered` read)."""
    o = strategy.options
    order = None if seq is None else token_order(strategy, seq)
    recompute = o.remat not in KEEP_UNITS
    fp8 = RECIPES[o.fp8_recipe] if o.dtype == "float8" else None
    matmuls = Matmuls(o.overlap != "none", o.overlap == "collective_matmul_bidir", fp8, o.fp8_gather, recompute,
                      o.fp8_sp_gather)
    return RunConfig(dtype=o.program_dtype, matmuls=matmuls,
                     core=AttentionCore(o.attention, o.attention_kernel, o.remat == "selective"),
                     scan=LayerScan(o.remat, o.fsdp_prefetch), ssm=SSMKernels(strategy.size("context") > 1),
                     recomputed_weight=matmuls.weight if fp8 else gathered if recompute else cast,
                     moe_kernel=o.moe_kernel,
                     seq_order=None if order is None else tuple(int(i) for i in order))


def token_order(strategy: Strategy, seq: int) -> np.ndarray | None:
    """The token layout along the sequence (zigzag for load-balanced causal context parallelism)."""
    if strategy.size("context") == 1 or strategy.options.cp_layout == "contiguous":
        return None
    return token_permutation(seq, strategy.size("context"), strategy.options.cp_layout)


class Trainer:
    """Everything one training run needs, built and validated before anything compiles."""

    def __init__(self, model: ModelConfig, strategy: Strategy, tc: TrainConfig, devices: list | None = None):
        devices = list(jax.devices() if devices is None else devices)
        self.strategy = strategy.resolved(len(devices))
        validate.check(model, self.strategy, batch=tc.batch, seq=tc.seq)
        validate.check_backend(self.strategy, devices[0].platform)
        self.run = run_config(self.strategy, tc.seq)
        abstract = nnx.eval_shape(lambda: LM(model, self.run, rngs=nnx.Rngs(tc.seed)))  # nothing allocated
        self.graphdef, abstract_params = nnx.split(abstract)
        self.model_cfg, self.tc = model, tc
        self.extra_metrics = AUX_FIELDS if model.has_moe else ()  # what `_loss` reports beside the loss
        self.mesh = make_mesh(self.strategy, devices)
        self.layout = model_layout(self.mesh, self.strategy, model)
        self.optimizer = make_optimizer(tc, model)
        self.schedule = make_schedule(tc)
        self.order = token_order(self.strategy, tc.seq)
        # stacked units stored stage-major under a circular pipeline (jaxpar/pipeline/order.py)
        self.unit_order = unit_order(self.strategy, model.run_units)
        self.stacked = stacked_paths(abstract_params)

        self.param_shardings = param_shardings(abstract_params, self.layout)
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        self.opt_shardings = optimizer_shardings(abstract_opt, abstract_params, self.layout)
        # ZeRO-1: the gradient entering the update is sharded like the moments (reduce-scatter).
        self.grad_shardings = (param_shardings(abstract_params, self.layout, "optimizer")
                               if self.strategy.zero == 1 else self.param_shardings)
        replicated = NamedSharding(self.mesh, P())
        self.state_shardings = TrainState(self.param_shardings, self.opt_shardings, replicated)
        self.batch_sharding = self.layout.activation("batch", "seq")
        self.abstract_params = abstract_params
        self.compiler_options = compiler_options(self.strategy.options.xla_preset, self.mesh.devices.flat[0].platform)
        self._step = jax.jit(self._train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, replicated), donate_argnums=0,
                             compiler_options=self.compiler_options)
        self._grads = jax.jit(lambda p, b: self._loss_and_grads(p, b)[::2],
                              in_shardings=(self.param_shardings, self.batch_sharding),
                              out_shardings=(replicated, self.param_shardings),
                              compiler_options=self.compiler_options)
        self._compiled = None  # the step compiled ahead of the loop (`compile`)
        self._stored = {inverse: jax.jit(functools.partial(self.reorder, inverse=inverse),
                                         in_shardings=(self.state_shardings,), out_shardings=self.state_shardings)
                        for inverse in (False, True)}

    def check_host_memory(self) -> None:
        """Refuse, before allocating, a run that cannot fit this host when its devices are simulated CPU
        devices (they share the host's memory). Analysis from shapes (`jaxpar comm`) allocates nothing
        and does not call this."""
        if not all(d.platform == "cpu" for d in self.mesh.devices.flat):
            return
        m, tc = self.model_cfg, self.tc
        check_host_memory(STATE_BYTES_PER_PARAM * self.param_count + 3 * 4 * tc.batch * tc.seq
                          + 4 * tc.batch * tc.seq * m.d_model * m.layers,
                          f"training {m.name} (parameters, gradients, Adam moments, the batch and one "
                          f"residual activation per layer) on batch={tc.batch} x seq={tc.seq}")

    @property
    def param_count(self) -> int:
        """The model's parameters (MoE: every expert's)."""
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.abstract_params))

    def lr(self, step: int) -> float:
        """The learning rate step `step` (counted from 1) applies."""
        return float(self.schedule(step - 1))

    # ---- state --------------------------------------------------------------------------------
    def init_state(self) -> TrainState:
        """Parameters and optimizer state created directly in their shards (never a full replica), by one
        compiled function (compiled as `xla_workarounds.compile_initializer` says)."""
        return compile_initializer(self.lower_init(), self.mesh.devices.flat[0].platform)()

    def lower_init(self) -> jax.stages.Lowered:
        """The initialiser of `init_state`, lowered: the parameters from seed --seed, the optimizer's
        state of them and step 0, each output in its shards."""
        model, run, seed = self.model_cfg, self.run, self.tc.seed

        def init():
            params = self.reorder(nnx.state(LM(model, run, rngs=nnx.Rngs(seed))))
            return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

        return jax.jit(init, out_shardings=self.state_shardings).lower()

    def state_from_params(self, params) -> TrainState:
        """A fresh train state around given parameters (host or device arrays), placed in this
        strategy's shardings and the stored order of the stacked units (jaxpar/pipeline/order.py); the
        optimizer state is created directly in its shards."""
        params = jax.device_put(params, self.param_shardings)
        if self.unit_order is not None:
            params = jax.jit(self.reorder, out_shardings=self.param_shardings)(params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)
        return TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step))

    # ---- the step -----------------------------------------------------------------------------
    def _loss(self, params, batch) -> tuple[jax.Array, dict]:
        """(loss, extra metrics): the router statistics of MoE layers (models/moe.py), else none."""
        with use_layout(self.layout):
            dt = jnp.dtype(self.run.dtype)
            if dt != jnp.float32:
                params = jax.tree.map(lambda p: p.astype(dt), params)
            model = nnx.merge(self.graphdef, params)
            x = model.embed(batch["inputs"])
            if self.strategy.size("pipeline") > 1:  # the head and loss run inside (spread over the stages)
                loss, aux = pipelined_loss(model, x, batch["positions"], batch["labels"], self.strategy, self.layout)
            else:
                x, aux = self.apply_stack(model, x, batch["positions"], batch.get("segments"))
                loss = model.loss(x, batch["labels"], aux=aux)
            if aux is None:
                return loss, {}
            return loss, aux_metrics(self.model_cfg, aux)

    def apply_stack(self, model: LM, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array | None]:
        """The layer stack as a plain scan (a pipeline runs in `jaxpar.pipeline.gpipe.pipelined_loss`), and the MoE
        layers' auxiliary vector or None; `segments`: packed documents' ids (`use_document_mask`)."""
        return model.apply_stack_aux(x, positions, segments)

    def _value_and_grad(self, params, batch):
        """((loss, extra metrics), gradients) of one batch: jax.value_and_grad of `_loss`, but under the
        1F1B pipeline schedule, which computes its own backward (jaxpar/pipeline/one_f_one_b.py)."""
        if self.strategy.size("pipeline") > 1 and self.strategy.options.pp_schedule == "1f1b":
            with use_layout(self.layout):
                loss, aux, grads = pipelined_loss_and_grads(self.graphdef, params, batch, self.strategy, self.layout,
                                                            self.run.dtype)
            return (loss, {} if aux is None else aux_metrics(self.model_cfg, aux)), grads
        return jax.value_and_grad(self._loss, has_aux=True)(params, batch)

    def _loss_and_grads(self, params, batch):
        """(loss, extra metrics, gradients); under accumulation each is the micro-batches' mean."""
        accum = self.strategy.options.grad_accum
        if accum == 1:
            (loss, extra), grads = self._value_and_grad(params, batch)
            return loss, extra, grads

        def body(carry, micro):
            loss_sum, extra_sum, grad_sum = carry
            (loss, extra), grads = self._value_and_grad(params, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, extra_sum, extra),
                    jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        extra0 = {name: jnp.zeros((), jnp.float32) for name in self.extra_metrics}
        (loss, extra, grads), _ = jax.lax.scan(body, (jnp.zeros(()), extra0, zeros), jax.tree.map(lambda x: split_microbatches(x, accum), batch))
        return loss / accum, jax.tree.map(lambda m: m / accum, extra), jax.tree.map(lambda g: g / accum, grads)

    def _train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        loss, extra, grads = self._loss_and_grads(state.params, batch)
        with jax.named_scope("optimizer"):
            grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
            grad_norm = gradient_norm(grads)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": grad_norm, **extra}

    # ---- public API ---------------------------------------------------------------------------
    def batch(self, source, step: int) -> dict[str, jax.Array]:
        """This process's block of the global batch of `step` (only the rows its devices hold), as
        global arrays."""
        shape = (self.tc.batch, self.tc.seq)
        rows, positions = process_indices(self.batch_sharding, shape)
        local = local_batch(source, step, rows, self.tc.seq, self.order)
        if len(positions) < self.tc.seq:  # context parallelism across processes
            local = {k: np.ascontiguousarray(v[:, positions]) for k, v in local.items()}
        return to_global(local, self.batch_sharding, shape)

    document_mask = False  # batches carry segment ids (`use_document_mask`)

    def use_document_mask(self) -> None:
        """Batches will carry segment ids (packed documents, jaxpar/training/loader.py) that attention keeps
        apart; refused, before compiling, where the model or strategy cannot: a recurrence (Mamba layers)
        carries state across documents, the pipeline and context-parallel kernels take no segment ids,
        and cuDNN's kernel here is called without them."""
        s, m = self.strategy, self.model_cfg
        kernel = resolve_kernel(s.options.attention_kernel, jnp.dtype(self.run.dtype))
        for bad, why in ((m.has_mamba, f"model {m.name} has Mamba layers, whose recurrence crosses documents"),
                         (s.size("pipeline") > 1, "pipeline parallelism does not pass segment ids to its stages"),
                         (s.size("context") > 1, "context-parallel attention takes no segment ids"),
                         (m.mtp_depth > 0, f"model {m.name}'s multi-token prediction modules attend without "
                                           "segment ids"),
                         (kernel == "cudnn", "attention_kernel cudnn is called without segment ids")):
            if bad:
                raise ConfigError(f"--document-mask: {why}")
        self.document_mask = True
        self._compiled = None

    @functools.cached_property
    def eval_loss(self):
        """The jitted loss of one batch under the run's strategy (no gradients, no update): parameters in
        the step's shardings and stored order, the batch in its sharding."""
        return jax.jit(lambda params, batch: self._loss(params, batch)[0],
                       in_shardings=(self.param_shardings, self.batch_sharding),
                       out_shardings=NamedSharding(self.mesh, P()), compiler_options=self.compiler_options)

    def evaluate(self, state: TrainState, source, batches: int) -> dict[str, float]:
        """eval_loss (the mean loss of `source`'s batches 0 .. batches - 1, each the run's global batch)
        and eval_ppl = exp(eval_loss)."""
        loss = sum(float(self.eval_loss(state.params, self.batch(source, k))) for k in range(batches)) / batches
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One update: the step `compile` built ahead if it ran, else the jitted step (compiled at
        its first call)."""
        return (self._step if self._compiled is None else self._compiled)(state, batch)

    def compile(self) -> None:
        """Compile the step from shapes and shardings before the first batch exists, so that no step's
        time includes compilation."""
        self._compiled = self.lower_step().compile()

    def loss_and_grads(self, params, batch):
        """Loss and gradients of one batch (no update) from a state's (stored-order) parameters, the
        gradients in layer order — what the equivalence tests compare."""
        loss, grads = self._grads(params, batch)
        return loss, self.reorder(grads, inverse=True)

    @property
    def stored_loss_and_grads(self):
        """The jitted (loss, gradients) of the step itself: parameters and gradients in stored order."""
        return self._grads

    def reorder(self, tree, inverse: bool = False):
        """Parameters, gradients, optimizer or train state from layer order into the stored order of the
        stacked units (`inverse`: back); the identity but under a circular pipeline
        (jaxpar/pipeline/order.py)."""
        return reorder(tree, self.stacked, self.unit_order, inverse)

    def stored_state(self, state: TrainState, inverse: bool = False) -> TrainState:
        """A train state in this strategy's shardings moved into (`inverse`: out of) the stored order, for
        checkpoints: they hold layer order, whatever the strategy."""
        return state if self.unit_order is None else self._stored[inverse](state)

    def lower_step(self):
        """The step lowered for analysis, from shapes and shardings only (no arrays allocated)."""
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             self.abstract_state(), self.state_shardings)
        batch = {k: jax.ShapeDtypeStruct((self.tc.batch, self.tc.seq), jnp.int32, sharding=self.batch_sharding)
                 for k in ("inputs", "labels", "positions") + (("segments",) if self.document_mask else ())}
        return self._step.lower(state, batch)

    def _abstract_state(self) -> TrainState:
        params = self.abstract_params
        return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

    def abstract_state(self) -> TrainState:
        """Shapes and dtypes of the train state (no arrays)."""
        return jax.eval_shape(self._abstract_state)


def gather(tree) -> Any:
    """A pytree of global arrays as host numpy (for tests and reports)."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def train(trainer: Trainer, source, *, on_step=None, state: TrainState | None = None, start: int = 0,  # many parameters: the loop's optional hooks, each keyword-only with a default
          stop: int | None = None, checkpointer=None, on_save=None, evaluate=None):
    """Run steps start + 1 .. stop (or tc.steps), counted from 1 as everywhere a run reports them (a
    checkpoint of step N holds the state after N steps, so a run resumed from it starts at step N + 1).
    `on_step(step, metrics)` sees host floats after each step; `checkpointer.maybe_save(step, state,
    trainer)` runs after every step and `on_save(step)` after each save it starts; `evaluate(step, state)`
    returns the held-out fields to add to the step's record ({} on steps that do not evaluate)."""
    state = trainer.init_state() if state is None else state
    stop = trainer.tc.steps if stop is None else min(stop, trainer.tc.steps)
    tokens = trainer.tc.batch * trainer.tc.seq
    # model FLOPs (MoE: from the active parameters, the k routed experts per token)
    flops = step_flops(trainer.model_cfg, "none", trainer.tc.batch, trainer.tc.seq, Kernels(causal=True)).model
    for step in range(start + 1, stop + 1):
        batch = trainer.batch(source, step - 1)
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        loss = float(metrics["loss"])  # blocks until the step is done
        dt = time.perf_counter() - t0
        held_out = evaluate(step, state) if evaluate is not None else {}
        if on_step is not None:
            record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]), "lr": trainer.lr(step),
                      "tokens": step * tokens, "time": time.time(), "step_time_s": dt, "tokens_per_s": tokens / dt,
                      "model_flops_per_s": flops / dt}
            record.update((k, float(v)) for k, v in metrics.items() if k not in record)
            record.update(held_out)
            on_step(step, record)
        if checkpointer is not None and checkpointer.maybe_save(step, state, trainer) and on_save is not None:
            on_save(step)
        if preempted(step):
            if checkpointer is not None:
                checkpointer.maybe_save(step, state, trainer, force=True)
                checkpointer.wait()
            raise Preempted(step, checkpointer is not None, PreemptionNotice.received or signal.SIGTERM)
        faults.after_step(step)
    return state


class Preempted(Exception):
    """Training stopped at a preemption notice after `step` completed steps (checkpointed if `saved`);
    `signum` is the notice's signal (SIGTERM from a scheduler or the launcher, SIGINT: a Ctrl-C)."""

    def __init__(self, step: int, saved: bool = True, signum: int = signal.SIGTERM):
        super().__init__(f"preempted: checkpoint of step {step} saved; rerun with --resume to continue" if saved
                         else f"preempted after step {step}: nothing was saved (no --ckpt-dir)")
        self.step = step
        self.saved = saved
        self.signum = signum


class PreemptionNotice:
    """`with PreemptionNotice():` around training turns SIGTERM and a first Ctrl-C (SIGINT) into a notice
    that `preempted` reads after each step, in a single-process run; a second Ctrl-C raises
    KeyboardInterrupt at once (the previous handlers are restored on exit). A multi-process run needs
    nothing here: jax.distributed's preemption service catches SIGTERM, and `jaxpar launch` forwards a
    Ctrl-C to its processes as SIGTERM."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    received: int | None = None  # the notice's signal

    def __enter__(self):
        self.installed = jax.process_count() == 1 and threading.current_thread() is threading.main_thread()
        PreemptionNotice.received = None
        if self.installed:
            self.previous = {s: signal.signal(s, PreemptionNotice._notice) for s in self.SIGNALS}
        return self

    @staticmethod
    def _notice(signum, frame) -> None:
        if signum == signal.SIGINT:
            if PreemptionNotice.received is not None:
                raise KeyboardInterrupt
            print("\njaxpar: Ctrl-C: stopping after the step in flight (saved with --ckpt-dir); "
                  "Ctrl-C again stops at once, without saving", file=sys.stderr, flush=True)
        PreemptionNotice.received = signum

    def __exit__(self, *exc) -> None:
        if self.installed:  # None: the previous handler was not set from Python; the default is closest
            for s, handler in self.previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
        PreemptionNotice.received = None


def preempted(step: int) -> bool:
    """Whether a preemption notice (SIGTERM to any process: SLURM, a TPU maintenance event, `jaxpar
    launch` forwarding a signal or a Ctrl-C) has reached every process by this step. JAX's preemption
    sync manager agrees on the step across processes, so all of them save the same checkpoint and stop.
    In one process, the notice is a SIGTERM or a first Ctrl-C caught by `PreemptionNotice`."""
    if jax.process_count() == 1:
        return PreemptionNotice.received is not None
    return multihost_utils.reached_preemption_sync_point(step)
