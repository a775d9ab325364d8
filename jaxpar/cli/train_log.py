"""What `jaxpar train` says while it runs: the header (what the run is), the per-step record (the metric
sinks, the progress bar on a terminal or, with --no-progress or into a file, a log line every
--log-every steps), one line per checkpoint, the profiler trace's window, and the closing summary.
docs/running.md shows a run's output line by line and the metrics' schema.

Steps are counted from 1 everywhere: the bar, the log lines, the JSONL `step`, the checkpoints (a
checkpoint of step N holds the state after N steps). The step is compiled before the bar starts
(`Trainer.compile`), so no step time, rate or ETA includes compilation.
"""
from __future__ import annotations

import datetime
import math
import statistics
import sys
import time
from typing import NamedTuple

import jax
from tqdm import tqdm

from jaxpar.core.schedule import schedule_summary
from jaxpar.cost.flops import MODEL_FLOPS_CONVENTION
from jaxpar.core.strategy import Strategy
from jaxpar.cost.hardware import Hardware
from jaxpar.models.config import ModelConfig
from jaxpar.errors import ConfigError
from jaxpar.training.metrics import Sinks
from jaxpar.training.trainer import Trainer


class Phases(NamedTuple):
    """Where a run's wall time went, in seconds: since the process started (`wall`), until the trainer's
    modules were imported (`imports`: the interpreter, JAX, Flax), compiling the step, initialising the
    state (0 when restored or loaded)."""
    wall: float
    imports: float
    compile: float
    init: float

    def split(self, steps: float) -> str:
        """'wall W s (imports, compile, initialisation, steps, the rest)': the rest is the set-up between
        them, evaluation and checkpoints; `steps`: the steps' own times summed."""
        parts = [("imports", self.imports), ("compile", self.compile), ("initialisation", self.init),
                 ("steps", steps)]
        rest = self.wall - sum(t for _, t in parts)
        shown = ", ".join(f"{name} {t:.1f} s" for name, t in parts if t or name != "initialisation")
        return f"wall {self.wall:.1f} s ({shown}, the rest {max(rest, 0.0):.1f} s)"


def mfu_is_nominal(trainer: Trainer) -> bool:
    """MFU against a hardware profile means something only on that hardware: on CPU devices (simulated
    on this host) it is a nominal figure, kept in the metrics with `mfu_nominal: true` and left off the
    bar and the log lines."""
    return trainer.mesh.devices.flat[0].platform == "cpu"


def header(trainer: Trainer, data: str, hardware: Hardware | None, start: int, stop: int) -> list[str]:
    """The lines that say what the run is, before it compiles."""
    model, strategy, tc = trainer.model_cfg, trainer.strategy, trainer.tc
    devices = trainer.mesh.devices.flat
    tokens = tc.batch * tc.seq
    lines = [f"model {model.name}: {model.layers} layers, d_model={model.d_model}, pattern={model.pattern}; "
             f"{trainer.param_count:,} parameters",
             f"strategy {strategy.describe()}; options: {strategy.describe_options()}; "
             f"{trainer.mesh.size} {devices[0].platform} device{'s' if trainer.mesh.size > 1 else ''}",
             f"batch {tc.batch} sequences x {tc.seq} tokens = {tokens:,} tokens per step (global); "
             f"steps {start + 1}-{stop} of {tc.steps}, {(stop - start) * tokens:,} tokens"]
    if strategy.size("pipeline") > 1:
        lines.append(schedule_summary(strategy, model.run_units))
    if strategy.size("expert") > 1 and not model.has_moe:
        lines.append(f"expert={strategy.size('expert')} acts as data parallelism: {model.name} has no "
                     "mixture-of-experts layers (the batch is split over it as over data)")
    lines += [f"precision float32 parameters, gradients and Adam moments; {compute_precision(strategy, model)}",
              f"optimizer {tc.optimizer.describe()}",
              f"schedule {tc.describe_schedule()}",
              "data SYNTHETIC tokens (--data synthetic, the default): a bigram rule with 10% noise, not text"
              if data == "synthetic" else f"data {data} (token ids)"]
    if hardware is None:
        lines.append("mfu not measured (--hardware PROFILE gives it against the profile's peak)")
    else:
        peak = f"{trainer.mesh.size} x {hardware.name} at {hardware.peak_flops / 1e12:,.0f} TFLOP/s each"
        lines.append(f"mfu nominal, CPU devices (against {peak}; in the metrics with mfu_nominal=true, "
                     "not on the bar)" if mfu_is_nominal(trainer) else f"mfu against {peak}")
        lines[-1] += f"; model FLOPs = {MODEL_FLOPS_CONVENTION}"
    return lines


def timed(what: str, work, show: bool):
    """(work(), its seconds), announced as `what ... 3.2 s` on one line when `show`."""
    if show:
        print(f"{what} ...", end="", flush=True)
    t0 = time.perf_counter()
    result = work()
    jax.block_until_ready(result)
    seconds = time.perf_counter() - t0
    if show:
        print(f" {seconds:.1f} s", flush=True)
    return result, seconds


def check_profile_steps(args, start: int, stop: int) -> None:
    """--profile traces steps --profile-steps A-B: all of them must be steps this run takes."""
    if not args.profile:
        return
    a, b = args.profile_steps
    if a <= start or b > stop:
        more = ", or more --steps" if b > stop else ""
        raise ConfigError(f"--profile traces steps {a}-{b} (--profile-steps), but this run takes steps "
                          f"{start + 1}-{stop}: give --profile-steps within them{more}")


class StepLog:
    """After each step: the profiler window (--profile), the MFU (--hardware), the metric sinks, the
    divergence check, and the bar or the log line. Keeps the step times for the summary."""

    def __init__(self, args, trainer: Trainer, sinks: Sinks, hardware: Hardware | None, show: bool):
        self.args, self.trainer, self.sinks, self.show = args, trainer, sinks, show
        self.peak = hardware.peak_flops * trainer.mesh.size if hardware is not None else None
        self.nominal = mfu_is_nominal(trainer)
        self.bar = None
        self.tracing = False
        self.times: list[float] = []
        self.last: dict = {}

    def begin(self, start: int, stop: int) -> None:
        """Just before step start + 1 (the step already compiled): the bar, and a trace that starts there."""
        self.stop = stop
        if self.show and not self.args.no_progress and sys.stderr.isatty():  # a log file gets log lines, not \r frames
            self.bar = tqdm(total=self.trainer.tc.steps, initial=start, unit="step", dynamic_ncols=True)
        if self.args.profile and self.args.profile_steps[0] == start + 1:
            self._trace(True)

    def _trace(self, on: bool) -> None:
        if on:
            jax.profiler.start_trace(self.args.profile)
        else:
            jax.profiler.stop_trace()
        self.tracing = on

    def __call__(self, step: int, m: dict) -> None:
        if self.args.profile:
            first, last = self.args.profile_steps
            if step == first - 1 or (step == last and self.tracing):
                self._trace(step != last)
        if self.peak and "model_flops_per_s" in m:
            m["mfu"] = m["model_flops_per_s"] / self.peak
            m["mfu_nominal"] = self.nominal
        m["xla_preset"] = self.trainer.strategy.options.xla_preset   # what the step was compiled with
        self.sinks.write(m)
        self.last, self.times = m, self.times + [m["step_time_s"]]
        if not math.isfinite(m["loss"]):  # never report a diverged run as a success
            raise ConfigError(f"training diverged: loss is {m['loss']} at step {step} (lr={self.args.lr}); "
                              "no checkpoint was written from this step")
        if self.bar is not None:
            self.bar.set_postfix_str(self.fields(m, "bar"), refresh=False)
            self.bar.update(1)
        elif self.show and (step % self.args.log_every == 0 or step == self.stop):
            print(f"step {step}/{self.trainer.tc.steps}  {self.fields(m, 'log')}", flush=True)

    def fields(self, m: dict, where: str) -> str:
        """loss, grad norm, learning rate, tokens/s, step time and (on real hardware) MFU; the log line
        adds the time left at the median step time."""
        out = [f"loss {m['loss']:.4f}", f"grad_norm {m['grad_norm']:.3g}", f"lr {m['lr']:.3g}",
               f"{m['tokens_per_s']:,.0f} tokens/s", f"{m['step_time_s'] * 1e3:.1f} ms/step"]
        if "mfu" in m and not self.nominal:
            out.append(f"mfu {m['mfu']:.1%}")
        if where == "log":
            left = (self.stop - m["step"]) * statistics.median(self.times)
            out.append(f"eta {datetime.timedelta(seconds=round(left))}")
        return "  ".join(out)

    def saved(self, step: int) -> None:
        """A checkpoint of step `step` was saved (asynchronously: it completes during the next step)."""
        if self.show:
            (print if self.bar is None else self.bar.write)(f"checkpoint saved at step {step} in {self.args.ckpt_dir}")

    def close(self) -> None:
        if self.tracing:
            self._trace(False)
        if self.bar is not None:
            self.bar.close()

    def summary(self, phases: Phases) -> str:
        """The closing line: the last loss, the median step time (not the last), the tokens seen and the
        wall time since the process started, split into its phases (`Phases`)."""
        median = statistics.median(self.times)
        tc = self.trainer.tc
        return (f"final loss {self.last['loss']:.4f} at step {self.last['step']}; median step {median * 1e3:.1f} ms "
                f"({tc.batch * tc.seq / median:,.0f} tokens/s) over {len(self.times)} steps; "
                f"{self.last['tokens']:,} tokens seen; {phases.split(sum(self.times))}")


def compute_precision(strategy: Strategy, model: ModelConfig) -> str:
    """What computes in which dtype: under dtype=float8, which GEMMs are scaled float8 (jaxpar/ops/fp8.py)."""
    o = strategy.options
    if o.dtype != "float8":
        return f"{o.dtype} compute"
    experts = ", experts (rows and weights scaled apart)" if model.has_moe else ""
    mamba = "; Mamba-2 projections" if model.has_mamba else ""
    return (f"float8 {o.fp8_recipe} GEMMs for the attention and MLP projections{experts}; the head, router, "
            f"attention scores{mamba} and the rest in bfloat16"
            + ("; FSDP gathers their weights in float8" if o.fp8_gather else "")
            + ("; their sequence-parallel input gathered in float8" if o.fp8_sp_gather else ""))
