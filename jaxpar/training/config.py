"""The settings of a training run: its size and learning rate (`TrainConfig`) and its optimizer
(`OptimizerConfig`), plain frozen dataclasses that import nothing heavy, so that the command line reads
their defaults without loading JAX. jaxpar/training/trainer.py builds the optimizer from them.
"""
from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW after global-norm clipping, and the shape of the learning-rate schedule. The defaults are
    the LLaMA recipe (Touvron et al. 2023, section 2.2: b2 0.95, weight decay 0.1, clip 1.0, cosine to
    10% of the peak), which GPT-3 shares (Brown et al. 2020, appendix B)."""
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip: float = 1.0            # global-norm clip; 0: none
    schedule: str = "cosine"     # after warmup, from the peak to the floor over the run: cosine | linear | constant
    min_lr_ratio: float = 0.1    # the floor, as a fraction of the peak (cosine, linear)

    def __post_init__(self):
        """Refuse what AdamW cannot run (its bias correction divides by 1 - b^t, so b1, b2 < 1)."""
        for name, ok, must in (("b1", 0 <= self.b1 < 1, "be in [0, 1)"), ("b2", 0 <= self.b2 < 1, "be in [0, 1)"),
                               ("weight_decay", self.weight_decay >= 0, "be >= 0"), ("clip", self.clip >= 0, "be >= 0"),
                               ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "be in [0, 1]"),
                               ("schedule", self.schedule in SCHEDULES, f"be one of {', '.join(SCHEDULES)}")):
            if not ok:
                raise ConfigError(f"optimizer {name}={getattr(self, name)!r} must {must}")

    def describe(self) -> str:
        """One line for the run's header."""
        clip = f"global-norm clip {self.clip:g}" if self.clip > 0 else "no clipping"
        return f"AdamW (b1 {self.b1:g}, b2 {self.b2:g}, weight decay {self.weight_decay:g}), {clip}"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run: the global batch, the sequence, the steps, the peak learning rate and its warmup, the
    seed (parameters and synthetic data) and the optimizer."""
    batch: int = 16          # global, in sequences
    seq: int = 64
    steps: int = 20
    lr: float = 3e-3         # peak learning rate
    warmup: int = 10         # steps of linear warmup from 0 (0: none)
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()

    def describe_schedule(self) -> str:
        """The learning-rate schedule in one line for the run's header."""
        o = self.optimizer
        longer = f" (longer than the {self.steps}-step run: the peak is never reached)" if self.warmup > self.steps else ""
        warmup = f"{self.warmup} warmup steps{longer}, then " if self.warmup else "no warmup, "
        after = ("constant" if o.schedule == "constant" else
                 f"{o.schedule} decay to {self.lr * o.min_lr_ratio:.3g} ({o.min_lr_ratio:g} x peak) over the run")
        return f"lr {self.lr:g} peak, {warmup}{after}"
