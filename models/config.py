"""Model configuration: one frozen dataclass for every model family, plus named presets.

A model is a stack of `layers` blocks: "A" is a LLaMA-style attention block (GQA attention + MLP), "M" a
Mamba-2 block, "E" an attention block whose MLP is a mixture of experts (models/moe.py). `pattern` says
which block each layer is, in one of two forms:
    a unit, repeated to fill `layers`: "A" (a transformer), "M" (Mamba-2), "MMMA" (a hybrid), "E" (all
        MoE), "AE" (dense and MoE alternating), "MMME" (Jamba-style);
    a block sequence, runs of `count*unit` joined by "+": "3*A+58*E" (DeepSeek-V3: 3 dense layers, then
        58 MoE), "A+3*E" (a count of 1 may be left out); it fixes `layers`.
Each run (`runs`) is stacked and scanned as one: a model compiles one body per run, not per layer.

Spec strings (the CLI's `--model`):
    llama-tiny                          a preset
    llama-tiny:layers=4,d_model=256     a preset with overrides
    path/to/model.toml                  a TOML file: optional `preset = "..."` plus fields
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
from typing import Any, NamedTuple

from jaxpar.errors import ConfigError
from jaxpar.core.inputs import did_you_mean, parse_int, parse_real, read_toml


BLOCKS = {"A": "attention", "M": "Mamba-2", "E": "attention + mixture of experts"}   # the block letters


class Yarn(NamedTuple):
    """YaRN's RoPE scaling (Peng et al. 2023, section 3): models/layers.py `rope_frequencies` and `rope`."""
    factor: float
    original: int         # the pre-training context
    beta_fast: float
    beta_slow: float
    cos_sin: float        # the attention factor cos and sin are multiplied by


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 x mscale x ln(factor) + 1 (Peng et al. 2023, eq. 21; 1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Run(NamedTuple):
    """`count` repetitions of `unit` (block letters applied in order), stacked on a `layers` dim and scanned."""
    unit: str
    count: int

    @property
    def layers(self) -> int:
        return len(self.unit) * self.count


_TERM = re.compile(r"(?:(\d+)\*)?([A-Z]+)")


@functools.cache   # the cost model reads a model's runs for every candidate it prices
def parse_runs(pattern: str, layers: int) -> tuple[Run, ...]:
    """The runs of `pattern` (module docstring): its unit repeated to fill `layers`, or its `count*unit`
    terms, equal neighbours merged. ConfigError naming the term that is not one."""
    if "*" not in pattern and "+" not in pattern:
        return (Run(pattern, layers // max(len(pattern), 1)),)
    runs: list[Run] = []
    for term in pattern.split("+"):
        match = _TERM.fullmatch(term.strip())
        if not match or (match.group(1) is not None and int(match.group(1)) < 1):
            raise ConfigError(f"pattern {pattern!r}: term {term!r} is not count*unit (e.g. 3*A) or a unit of the "
                              f"block letters {', '.join(BLOCKS)}")
        unit, count = match.group(2), int(match.group(1) or 1)
        if runs and runs[-1].unit == unit:
            runs[-1] = Run(unit, runs[-1].count + count)
        else:
            runs.append(Run(unit, count))
    return tuple(runs)


def is_sequence(pattern: str) -> bool:
    """Whether `pattern` is a block sequence (it fixes `layers`) rather than a repeated unit."""
    return "*" in pattern or "+" in pattern


def pattern_of(kinds: str) -> str:
    """The pattern of a per-layer string of block letters (a checkpoint's layers): its shortest repeating
    unit when that repeats, else its runs of equal letters, e.g. "AEEE" -> "A+3*E"."""
    unit = next(kinds[:n] for n in range(1, len(kinds) + 1) if len(kinds) % n == 0
                and kinds[:n] * (len(kinds) // n) == kinds)
    if len(unit) < len(kinds) or len(kinds) == 1:
        return unit
    return "+".join(f"{len(m.group(0))}*{m.group(1)}" if len(m.group(0)) > 1 else m.group(1)
                    for m in re.finditer(r"([A-Z])\1*", kinds))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    layers: int = 2
    d_model: int = 64
    vocab: int = 256
    max_seq: int = 256
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    pattern: str = "A"  # A attention, M Mamba-2, E attention + MoE: a unit repeated, or runs "3*A+58*E"
    # attention blocks (A and E)
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 8
    mlp_dim: int = 256
    mlp_type: str = "swiglu"  # swiglu | gelu
    rope_theta: float = 10_000.0
    qk_norm: bool = False         # RMSNorm of each query and key head (scale [head_dim]) before RoPE (Qwen3)
    # Llama 3.1 long-context RoPE scaling (models/layers.py `rope_frequencies`); factor 0 = none
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq: int = 8192
    # ... or, with rope_type "yarn", YaRN's (Peng et al. 2023; DeepSeek-V2 / V3 and transformers' `yarn`): a
    # dimension turning more than rope_beta_fast times over the original context keeps its frequency, one
    # turning fewer than rope_beta_slow times is divided by the factor, a linear ramp between; cos and sin
    # scaled by mscale(rope_mscale) / mscale(rope_mscale_all_dim) (mscale(m) = 0.1 m ln(factor) + 1; both 0:
    # mscale(1)); latent attention's softmax scale times mscale(rope_mscale_all_dim)^2 (DeepSeek's)
    rope_type: str = "llama3"     # llama3 | yarn
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # multi-head latent attention (models/mla.py; DeepSeek-V2 section 2.1): kv_lora_rank 0 = GQA. With MLA,
    # kv_heads = heads (each head's K and V are up-projected from the latent) and head_dim is the q/k head
    # dim, qk_nope_head_dim + qk_rope_head_dim
    kv_lora_rank: int = 0         # the latent K and V are compressed into (and the decode cache holds)
    q_lora_rank: int = 0          # the query's low-rank latent; 0 = a full d x heads x head_dim projection
    qk_rope_head_dim: int = 0     # the decoupled RoPE part of q/k; the key's is one head shared by all
    v_head_dim: int = 0           # each head's value width
    # Mamba-2 blocks
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    ssm_head_dim: int = 16
    ngroups: int = 1
    chunk: int = 16
    # mixture-of-experts blocks (E)
    experts: int = 0              # routed experts
    top_k: int = 2                # experts per token
    expert_mlp_dim: int = 0       # each expert's SwiGLU width; 0 = mlp_dim
    shared_experts: int = 0       # always-on experts (DeepSeek), one SwiGLU of shared_experts * expert width
    router: str = "softmax"       # softmax | sigmoid (DeepSeek-V3) scores over the experts
    router_norm: bool = True      # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0   # the routed experts' weights times this (DeepSeek-V3: 2.5)
    router_bias: bool = False     # a per-expert bias on the scores, for the choice only (DeepSeek-V3's
                                  # auxiliary-loss-free balancing), moved outside the gradient:
    router_bias_update: float = 0.0   # by -this x sign(load - mean load) each step (DeepSeek-V3: gamma 0.001)
    n_group: int = 1              # group-limited routing: experts in n_group groups (DeepSeek-V3: 8, one per node)
    topk_group: int = 1           # ... of which a token's experts come from at most topk_group (DeepSeek-V3: 4)
    capacity_factor: float = 0.0  # 0 = dropless; > 0: per sequence and expert, ceil(cf * seq * top_k / experts)
    aux_loss_coef: float = 0.01   # load balancing (Switch / GShard): experts * sum_e f_e * p_e
    z_loss_coef: float = 0.001    # router z-loss (ST-MoE): mean(logsumexp(logits)^2)
    # multi-token prediction (models/mtp.py; DeepSeek-V3 section 2.2): mtp_depth modules after the stack,
    # module k predicting the token k further ahead than the main head, its loss weighted by mtp_weight / depth
    mtp_depth: int = 0
    mtp_weight: float = 0.3       # DeepSeek-V3's lambda (0.3 for the first 10T tokens, then 0.1)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | Yarn | None:
        """Llama 3.1's (factor, low_freq_factor, high_freq_factor, original context), YaRN's `Yarn`, or None."""
        if not self.rope_scaling_factor:
            return None
        if self.rope_type == "yarn":
            m, m_all = self.rope_mscale, self.rope_mscale_all_dim
            cos_sin = yarn_mscale(self.rope_scaling_factor, m) / yarn_mscale(self.rope_scaling_factor, m_all) \
                if m and m_all else yarn_mscale(self.rope_scaling_factor, 1.0)
            return Yarn(self.rope_scaling_factor, self.rope_original_max_seq, self.rope_beta_fast,
                        self.rope_beta_slow, cos_sin)
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_seq)

    @property
    def latent_softmax_scale(self) -> float:
        """What latent attention's softmax scale is multiplied by: mscale(factor, rope_mscale_all_dim)^2 under
        YaRN with rope_mscale_all_dim (DeepSeek-V2 / V3, as transformers' yarn_apply_mscale), else 1."""
        if self.rope_type != "yarn" or not self.rope_scaling_factor or not self.rope_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_scaling_factor, self.rope_mscale_all_dim) ** 2

    @functools.cached_property   # read in the cost model's hot path
    def runs(self) -> tuple[Run, ...]:
        """The stacked runs, in layer order (one for a repeated unit)."""
        return parse_runs(self.pattern, self.layers)

    @functools.cached_property
    def run_units(self) -> tuple[int, ...]:
        """Scanned units per run (what a pipeline cuts into stages)."""
        return tuple(r.count for r in self.runs)

    @functools.cached_property
    def units(self) -> int:
        """Scanned units, all runs together (each a repetition of its run's unit)."""
        return sum(self.run_units)

    def layers_of(self, run: int, block: int) -> list[int]:
        """The layer index of block `block` in each unit of run `run` (a checkpoint's layer numbering)."""
        start = sum(r.layers for r in self.runs[:run])
        unit = len(self.runs[run].unit)
        return [start + u * unit + block for u in range(self.runs[run].count)]

    @functools.cached_property
    def layer_kinds(self) -> str:
        """The block letter of every layer, in order ("AEEE")."""
        return "".join(r.unit * r.count for r in self.runs)

    @functools.cached_property
    def attention_layers(self) -> int:
        return self.layer_kinds.count("A")

    @functools.cached_property
    def mamba_layers(self) -> int:
        return self.layer_kinds.count("M")

    @functools.cached_property
    def moe_layers(self) -> int:
        return self.layer_kinds.count("E")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (models/mla.py) rather than GQA."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        """The part of an MLA q/k head without RoPE (head_dim - qk_rope_head_dim)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """Each attention head's value width: v_head_dim under MLA, head_dim under GQA."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def has_attention(self) -> bool:
        """Whether some block has attention (A and E blocks)."""
        return "A" in self.pattern or "E" in self.pattern

    @property
    def mtp_kind(self) -> str:
        """The block letter of a multi-token prediction module's block: the last layer's kind (DeepSeek-V3's
        MTP module holds a MoE layer)."""
        return self.layer_kinds[-1]

    @property
    def mtp_moe_layers(self) -> int:
        """MoE blocks in the multi-token prediction modules."""
        return self.mtp_depth if self.mtp_kind == "E" else 0

    @property
    def has_mamba(self) -> bool:
        return "M" in self.pattern

    @property
    def has_moe(self) -> bool:
        return "E" in self.pattern

    @property
    def moe_mlp_dim(self) -> int:
        """One expert's SwiGLU width (expert_mlp_dim, or mlp_dim when that is 0)."""
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def d_inner(self) -> int:
        """Mamba-2 inner width (expand * d_model)."""
        return self.expand * self.d_model

    @property
    def ssm_heads(self) -> int:
        return self.d_inner // self.ssm_head_dim

    def validate(self) -> None:
        """Constraints internal to the model (strategy constraints live in jaxpar.core.validate)."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"model {self.name}: {msg}")
        for f in ("layers", "d_model", "vocab", "max_seq"):
            need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
        for f in ("rope_theta", "norm_eps"):
            value = getattr(self, f)
            need(math.isfinite(value) and value > 0, f"{f} must be a positive finite number, got {value}")
        need(self.vocab <= 2**31 - 1, f"vocab must fit an int32 token id, got {self.vocab}")
        self._validate_rope(need)
        letters = "".join(r.unit for r in self.runs) if is_sequence(self.pattern) else self.pattern
        need(letters != "" and set(letters) <= set(BLOCKS),
             "pattern must be a non-empty unit of 'A' (attention), 'M' (Mamba) and 'E' (attention + mixture of "
             f"experts), or runs of them as count*unit joined by '+' (3*A+58*E), got {self.pattern!r}")
        if is_sequence(self.pattern):
            need(sum(r.layers for r in self.runs) == self.layers,
                 f"pattern {self.pattern!r} has {sum(r.layers for r in self.runs)} layers, but layers={self.layers}")
        else:
            need(self.layers % len(self.pattern) == 0,
                 f"pattern length {len(self.pattern)} ({self.pattern!r}) does not divide layers={self.layers}")
        need(self.has_attention or not self.qk_norm,
             f"qk_norm normalises attention heads: pattern {self.pattern!r} has no A or E block")
        if self.has_attention:
            for f in ("heads", "kv_heads", "head_dim", "mlp_dim"):
                need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
            need(self.heads % self.kv_heads == 0,
                 f"kv_heads={self.kv_heads} does not divide heads={self.heads}")
            need(self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")
            need(self.mlp_type in ("swiglu", "gelu"), f"mlp_type must be swiglu or gelu, got {self.mlp_type!r}")
        need(self.kv_lora_rank >= 0, f"kv_lora_rank must be >= 0 (0: GQA attention), got {self.kv_lora_rank}")
        if self.mla:
            self._validate_mla(need)
        if self.has_mamba:
            for f in ("d_state", "d_conv", "expand", "ssm_head_dim", "ngroups", "chunk"):
                need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
            need(self.d_inner % self.ssm_head_dim == 0,
                 f"ssm_head_dim={self.ssm_head_dim} does not divide d_inner=expand*d_model={self.d_inner}")
            need(self.ssm_heads % self.ngroups == 0,
                 f"ngroups={self.ngroups} does not divide ssm heads={self.ssm_heads}")
        if self.has_moe:
            self._validate_moe(need)
        self._validate_mtp(need)

    def _validate_mla(self, need) -> None:
        need(self.has_attention, f"kv_lora_rank={self.kv_lora_rank} sets latent attention: pattern "
                                 f"{self.pattern!r} has no A or E block")
        for f in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(self, f) >= 0, f"{f} must be >= 0, got {getattr(self, f)}")
        need(self.kv_heads == self.heads, f"latent attention up-projects K and V to every head: kv_heads must "
                                          f"equal heads, got kv_heads={self.kv_heads}, heads={self.heads}")
        need(0 < self.v_head_dim <= self.head_dim, f"latent attention needs 0 < v_head_dim <= head_dim (the fused "
             f"kernels pad V to the q/k head dim), got v_head_dim={self.v_head_dim}, head_dim={self.head_dim}")
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
             f"latent attention needs an even qk_rope_head_dim > 0 (the decoupled RoPE key), got {self.qk_rope_head_dim}")
        need(self.qk_nope_head_dim > 0, f"latent attention's head_dim is qk_nope + qk_rope: head_dim="
                                        f"{self.head_dim} leaves no room beside qk_rope_head_dim={self.qk_rope_head_dim}")
        need(not self.qk_norm, "qk_norm is for GQA heads; latent attention normalises its latents instead")

    def _validate_moe(self, need) -> None:
        need(self.experts >= 1, f"experts must be >= 1 with 'E' in the pattern, got {self.experts}")
        need(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        need(self.top_k <= self.experts, f"top_k={self.top_k} must be <= experts={self.experts}")
        need(self.expert_mlp_dim >= 0, f"expert_mlp_dim must be >= 0 (0 = mlp_dim), got {self.expert_mlp_dim}")
        need(self.shared_experts >= 0, f"shared_experts must be >= 0, got {self.shared_experts}")
        need(self.router in ("softmax", "sigmoid"), f"router must be softmax or sigmoid, got {self.router!r}")
        need(math.isfinite(self.router_bias_update) and self.router_bias_update >= 0,
             f"router_bias_update must be a finite number >= 0, got {self.router_bias_update}")
        need(self.router_bias or not self.router_bias_update,
             f"router_bias_update={self.router_bias_update} moves the routing bias: set router_bias=true")
        need(math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0,
             f"routed_scaling_factor must be a positive finite number, got {self.routed_scaling_factor}")
        need(self.n_group >= 1 and self.experts % self.n_group == 0,
             f"n_group={self.n_group} must be >= 1 and divide experts={self.experts}")
        if self.n_group > 1:
            size = self.experts // self.n_group
            need(size >= 2, f"group-limited routing scores a group by its top 2 experts: experts={self.experts} "
                            f"/ n_group={self.n_group} leaves {size} per group")
            need(1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            need(self.top_k <= self.topk_group * size, f"top_k={self.top_k} experts do not fit in topk_group="
                 f"{self.topk_group} groups of {size}")
        for f in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, f)
            need(math.isfinite(value) and value >= 0, f"{f} must be a finite number >= 0, got {value}")

    def _validate_rope(self, need) -> None:
        need(self.rope_type in ("llama3", "yarn"), f"rope_type must be llama3 or yarn, got {self.rope_type!r}")
        for f in ("rope_mscale", "rope_mscale_all_dim"):
            need(math.isfinite(getattr(self, f)) and getattr(self, f) >= 0,
                 f"{f} must be a finite number >= 0, got {getattr(self, f)}")
        need(math.isfinite(self.rope_beta_slow) and math.isfinite(self.rope_beta_fast)
             and 0 < self.rope_beta_slow < self.rope_beta_fast,
             f"YaRN needs 0 < rope_beta_slow < rope_beta_fast, got {self.rope_beta_slow} and {self.rope_beta_fast}")
        if not self.rope_scaling_factor:
            return
        need(math.isfinite(self.rope_scaling_factor) and self.rope_scaling_factor >= 1,
             f"rope_scaling_factor must be a finite number >= 1 (or 0: none), got {self.rope_scaling_factor}")
        need(self.rope_original_max_seq > 0,
             f"rope_original_max_seq must be positive, got {self.rope_original_max_seq}")
        if self.rope_type == "llama3":
            for f in ("rope_low_freq_factor", "rope_high_freq_factor"):
                need(math.isfinite(getattr(self, f)), f"{f} must be finite, got {getattr(self, f)}")
            need(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 f"RoPE scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                 f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")

    def _validate_mtp(self, need) -> None:
        need(self.mtp_depth >= 0, f"mtp_depth must be >= 0 (0: no multi-token prediction), got {self.mtp_depth}")
        need(math.isfinite(self.mtp_weight) and self.mtp_weight >= 0,
             f"mtp_weight must be a finite number >= 0, got {self.mtp_weight}")
        if self.mtp_depth:
            need(self.mtp_kind != "M", f"multi-token prediction modules hold the last layer's block, an attention "
                                       f"or MoE block: pattern {self.pattern!r} ends in a Mamba-2 block")


# Published dimensions. LLaMA 3: Meta's model card / "The Llama 3 Herd of Models" (2024), table 3.
# GPT-3 175B: Brown et al. 2020 table 2.1; vocab padded to 51200 as Megatron-LM does (50257 -> x128).
# Mamba-2: Dao & Gu 2024, the state-spaces/mamba2-* checkpoints' configs (vocab padded to 50280).
# Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", and mistralai/Mixtral-8x7B-v0.1 config.json
# (router_aux_loss_coef 0.02, no z-loss). DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"
# section 4.2, and deepseek-ai/DeepSeek-V3 config.json: 61 layers, d 7168, 1 shared + 256 routed experts
# of width 2048, top-8, sigmoid scores normalised over the top 8, sequence-wise balance loss 1e-4; pre-training
# context 4K. Here every layer is MoE, though the real model's first 3 layers are dense (width 18432), and
# its multi-head latent attention is plain GQA with 128 heads x 128 (128 kv heads); node-limited routing,
# the bias-based (auxiliary-loss-free) balancing, the routed scaling factor 2.5 and multi-token prediction
# are left out. Qwen3-30B-A3B: Qwen Team 2025, "Qwen3 Technical Report", and Qwen/Qwen3-30B-A3B
# config.json (norm_topk_prob, router_aux_loss_coef 0.001; its per-head q/k RMSNorm is left out).
_LLAMA3_8B = dict(layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128, mlp_dim=14336,
                  vocab=128256, max_seq=8192, rope_theta=500_000.0)
_LLAMA3_70B = dict(layers=80, d_model=8192, heads=64, kv_heads=8, head_dim=128, mlp_dim=28672,
                   vocab=128256, max_seq=8192, rope_theta=500_000.0)
_LLAMA3_405B = dict(layers=126, d_model=16384, heads=128, kv_heads=8, head_dim=128, mlp_dim=53248,
                    vocab=128256, max_seq=8192, rope_theta=500_000.0)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(layers=2, d_model=64, heads=16, kv_heads=8, head_dim=8, mlp_dim=128,
                       vocab=256, max_seq=256),
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_70B,
    "llama3-405b": _LLAMA3_405B,
    # Llama 3.1 (the 128k-context release): the same shapes, RoPE scaled by 8 above the original 8192-token
    # context (meta-llama/Llama-3.1-*/config.json rope_scaling: factor 8, low_freq_factor 1,
    # high_freq_factor 4, original_max_position_embeddings 8192; Dubey et al. 2024, section 3.4)
    **{f"llama3.1-{size}": dict(base, max_seq=131072, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                                rope_high_freq_factor=4.0, rope_original_max_seq=8192)
       for size, base in (("8b", _LLAMA3_8B), ("70b", _LLAMA3_70B), ("405b", _LLAMA3_405B))},
    "gpt3-175b": dict(layers=96, d_model=12288, heads=96, kv_heads=96, head_dim=128, mlp_dim=49152,
                      mlp_type="gelu", vocab=51200, max_seq=2048, tie_embeddings=True),
    "mamba2-tiny": dict(pattern="M", layers=2, d_model=64, vocab=256, max_seq=256, d_state=16,
                        d_conv=4, expand=2, ssm_head_dim=16, ngroups=2, chunk=16),
    "mamba2-130m": dict(pattern="M", layers=24, d_model=768, vocab=50280, max_seq=2048, d_state=128,
                        d_conv=4, expand=2, ssm_head_dim=64, ngroups=1, chunk=256, tie_embeddings=True),
    "mamba2-370m": dict(pattern="M", layers=48, d_model=1024, vocab=50280, max_seq=2048, d_state=128,
                        d_conv=4, expand=2, ssm_head_dim=64, ngroups=1, chunk=256, tie_embeddings=True),
    "mamba2-1.3b": dict(pattern="M", layers=48, d_model=2048, vocab=50280, max_seq=2048, d_state=128,
                        d_conv=4, expand=2, ssm_head_dim=64, ngroups=1, chunk=256, tie_embeddings=True),
    "mamba2-2.7b": dict(pattern="M", layers=64, d_model=2560, vocab=50280, max_seq=2048, d_state=128,
                        d_conv=4, expand=2, ssm_head_dim=64, ngroups=1, chunk=256, tie_embeddings=True),
    "hybrid-tiny": dict(pattern="MMMA", layers=4, d_model=64, heads=8, kv_heads=4, head_dim=8,
                        mlp_dim=128, vocab=256, max_seq=256, d_state=16, d_conv=4, expand=2,
                        ssm_head_dim=16, ngroups=2, chunk=16),
    "moe-tiny": dict(pattern="E", layers=2, d_model=64, heads=8, kv_heads=4, head_dim=8, mlp_dim=128,
                     experts=8, top_k=2, expert_mlp_dim=32, vocab=256, max_seq=256),
    "mixtral-8x7b": dict(pattern="E", layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128,
                         mlp_dim=14336, experts=8, top_k=2, expert_mlp_dim=14336, vocab=32000,
                         max_seq=32768, rope_theta=1_000_000.0, aux_loss_coef=0.02, z_loss_coef=0.0),
    "deepseek-v3-moe": dict(pattern="E", layers=61, d_model=7168, heads=128, kv_heads=128, head_dim=128,
                            mlp_dim=18432, experts=256, top_k=8, shared_experts=1, expert_mlp_dim=2048,
                            router="sigmoid", router_norm=True, vocab=129280, max_seq=4096, norm_eps=1e-6,
                            aux_loss_coef=0.0001, z_loss_coef=0.0),
    # DeepSeek with its multi-head latent attention (models/mla.py) and dense first layers. DeepSeek-V3:
    # deepseek-ai/DeepSeek-V3 config.json (first_k_dense_replace 3, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, intermediate_size 18432) and the report's
    # section 4.2 (group-limited routing: 8 groups, 4 per token; routed_scaling_factor 2.5; the balancing
    # bias's update speed gamma 0.001); its 4K pre-training context (the released 160K extension: its
    # config.json through hf:DIR, or rope_type=yarn, rope_scaling_factor=40, rope_original_max_seq=4096,
    # rope_mscale=1, rope_mscale_all_dim=1). The 671B are the main model's: DeepSeek-V3 trained with one
    # multi-token prediction module (section 4.2, num_nextn_predict_layers 1: the released checkpoint's 14B
    # more), deepseek-v3:mtp_depth=1.
    # DeepSeek-V2-Lite: deepseek-ai/DeepSeek-V2-Lite config.json (27 layers, first 1 dense of width 10944,
    # no query latent, 2 shared + 64 routed experts of width 1408, top-6 of softmax scores, not renormalised,
    # aux_loss_alpha 0.001) and DeepSeek-AI 2024, "DeepSeek-V2", appendix B.
    "deepseek-v3": dict(pattern="3*A+58*E", layers=61, d_model=7168, heads=128, kv_heads=128, head_dim=192,
                        qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512, mlp_dim=18432,
                        experts=256, top_k=8, shared_experts=1, expert_mlp_dim=2048, router="sigmoid",
                        router_norm=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, router_bias=True,
                        router_bias_update=0.001, vocab=129280,
                        max_seq=4096, norm_eps=1e-6, aux_loss_coef=0.0001, z_loss_coef=0.0),
    "deepseek-v2-lite": dict(pattern="A+26*E", layers=27, d_model=2048, heads=16, kv_heads=16, head_dim=192,
                             qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, mlp_dim=10944, experts=64,
                             top_k=6, shared_experts=2, expert_mlp_dim=1408, router_norm=False, vocab=102400,
                             max_seq=4096, norm_eps=1e-6, aux_loss_coef=0.001, z_loss_coef=0.0),
    # the shapes of DeepSeek-V3 at a size 8 simulated CPU devices train: latent attention (q and kv latents),
    # one dense first layer, a shared expert beside 8 routed ones, sigmoid scores, 2 of 4 groups per token,
    # one multi-token prediction module
    "deepseek-tiny": dict(pattern="A+3*E", layers=4, d_model=64, heads=4, kv_heads=4, head_dim=12,
                          qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=24, kv_lora_rank=16, mlp_dim=128,
                          experts=8, top_k=2, shared_experts=1, expert_mlp_dim=32, router="sigmoid",
                          routed_scaling_factor=2.5, n_group=4, topk_group=2, router_bias=True,
                          router_bias_update=0.01, vocab=256, max_seq=256, mtp_depth=1,
                          aux_loss_coef=0.0001, z_loss_coef=0.0),
    "qwen3-30b-a3b": dict(pattern="E", layers=48, d_model=2048, heads=32, kv_heads=4, head_dim=128,
                          mlp_dim=6144, experts=128, top_k=8, expert_mlp_dim=768, vocab=151936,
                          max_seq=32768, rope_theta=1_000_000.0, norm_eps=1e-6, aux_loss_coef=0.001,
                          z_loss_coef=0.0),
    "jamba-tiny": dict(pattern="MMME", layers=4, d_model=64, heads=8, kv_heads=4, head_dim=8, mlp_dim=128,
                       experts=4, top_k=2, expert_mlp_dim=64, vocab=256, max_seq=256, d_state=16, d_conv=4,
                       expand=2, ssm_head_dim=16, ngroups=2, chunk=16),
}

_FIELDS = {f.name: f.type for f in dataclasses.fields(ModelConfig)}


def _coerce(key: str, raw: Any, where: str) -> Any:
    """One model field's value from a spec override (text) or a TOML file (typed), checked against the
    field's type; numbers in text through jaxpar.core.inputs' parsers (ASCII digits only)."""
    if key == "name":
        raise ConfigError(f"{where}: name={raw!r} cannot be set: a model is named by its spec (the preset with "
                          "its overrides) or its TOML file's name")
    if key not in _FIELDS:
        known = [k for k in _FIELDS if k != "name"]
        raise ConfigError(f"{where}: unknown model field {key!r}{did_you_mean(key, known)}; known fields: "
                          f"{', '.join(known)}")
    default = getattr(ModelConfig, key)
    if isinstance(raw, str):
        text = raw.strip()
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return text.lower() in ("true", "1")
            if isinstance(default, int):
                return parse_int(text)
            if isinstance(default, float):
                return parse_real(text)
            return text
        except ValueError:
            raise ConfigError(f"{where}: {key}={raw!r} is not a valid {type(default).__name__}") from None
    if isinstance(default, bool) and not isinstance(raw, bool):
        raise ConfigError(f"{where}: {key}={raw!r} must be true or false")
    if isinstance(default, float) and isinstance(raw, int):
        return float(raw)
    if type(raw) is not type(default):
        kind = {int: "an integer", float: "a number", str: "a string"}[type(default)]
        raise ConfigError(f"{where}: {key}={raw!r} must be {kind}")
    return raw


def _fields(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A preset's fields with the `given` ones; a block sequence given as `pattern` without `layers` sets it."""
    fields = {**base, **given}
    pattern = given.get("pattern")
    if isinstance(pattern, str) and is_sequence(pattern) and "layers" not in given:
        fields["layers"] = sum(r.layers for r in parse_runs(pattern, 0))
    return fields


def from_preset(name: str, /, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"presets: {', '.join(PRESETS)}")
    fields = _fields(PRESETS[name], {k: _coerce(k, v, f"model {name}") for k, v in overrides.items()})
    cfg = ModelConfig(name=name, **fields)
    cfg.validate()
    return cfg


def parse_model(spec: str) -> ModelConfig:
    """`preset`, `preset:key=value,...` or a TOML path (see module docstring)."""
    if spec.endswith(".toml"):
        path = pathlib.Path(spec)
        data = read_toml(path, "model")
        preset = data.pop("preset", None)
        if preset is not None and not isinstance(preset, str):
            raise ConfigError(f"{spec}: preset must be a preset name (a string), got {preset!r}")
        base = dict(PRESETS[preset]) if preset in PRESETS else {}
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"{spec}: unknown model preset {preset!r}{did_you_mean(preset, PRESETS)}; "
                              f"presets: {', '.join(PRESETS)}")
        fields = _fields(base, {k: _coerce(k, v, spec) for k, v in data.items()})
        cfg = ModelConfig(name=path.stem, **fields)
        cfg.validate()
        return cfg
    name, _, rest = spec.partition(":")
    overrides: dict[str, str] = {}
    if rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ConfigError(f"malformed model override {item!r} in {spec!r}: expected key=value")
            if key.strip() in overrides:
                raise ConfigError(f"model spec {spec!r} sets {key.strip()} twice")
            overrides[key.strip()] = value
    cfg = from_preset(name, **overrides)
    return dataclasses.replace(cfg, name=spec)
