"""Parameter counts per block, from the weights as models/ declares them and the rules table.

Each block's weights are listed with their shapes and logical names, as models/ declares them
(`attention_weights`, `mamba_weights`, `embedding_weights`; tests/test_cost_params.py checks the lists
against the models' own parameters, so a new weight cannot be left out). Which mesh axes split a weight
is then read off jaxpar/core/rules.py, the table the runtime shards with, never restated here:
    over `tensor`   weights with a name the base rules map to `tensor` (heads, mlp, vocab, ssm heads
                    and groups); the rest (norm weights over `embed`) are replicated (`BlockParams`);
    ZeRO            weights with a name that the params (ZeRO-3) or optimizer (ZeRO-1) rules of a ZeRO
                    stage map to `data` or `fsdp`: every weight with an `embed` dim. The others (Mamba-2's
                    conv weights and biases, A_log, dt_bias, D, gate norm) stay replicated over the data
                    axes whatever the stage (`zero_split`).

Attention block (LLaMA-style, no biases): q,k,v,o projections d*(hq + 2*hkv) + hq*d with
hq = heads*head_dim, hkv = kv_heads*head_dim (latent attention: `latent_attention_weights`); MLP 3*d*f (SwiGLU: gate, up, down) or 2*d*f (GeLU);
two RMSNorm weights 2*d. For GPT shapes (hq = hkv = d, f = 4d, GeLU) this is Megatron's 12*h^2 per
layer (Narayanan et al. 2021, section 5.1, biases dropped).

Mamba-2 block (Dao & Gu 2024, the reference `Mamba2` module): in_proj d*d_in_proj with
d_in_proj = 2*d_inner + 2*ngroups*d_state + nheads (z, x, B, C, dt: five weights here, packed into one
matmul at run time, so XLA gathers them as one array); depthwise conv (conv_dim*d_conv weights +
conv_dim bias) over conv_dim = d_inner + 2*ngroups*d_state channels; dt_bias, A_log, D (nheads each);
gated-RMSNorm weight d_inner; out_proj d_inner*d; pre-norm d.

Mixture-of-experts block ("E", models/moe.py): the attention half of an attention block (norms, q,k,v,o),
a router d*E (replicated: its expert dim has no logical name), the routed experts stacked as
w_gate, w_up [E, d, f_e] and w_down [E, f_e, d] (`experts` -> the `expert` mesh axis, `mlp` -> `tensor`)
and, with shared experts, one SwiGLU of width shared*f_e. Weights with an `experts` dim are split over
the `expert` axis too (`BlockParams.expert_sharded`), so their gradients are reduced over the data-like
axes other than `expert`.

Only the stacked `layers` dim goes to `pipeline`, so embedding and head are replicated over it.

The functions are pure and memoised on the ModelConfig *object* (`per_model`): a planner asks about
the same model thousands of times, and hashing a 22-field dataclass costs more than the arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

from jaxpar.core.rules import BASE_RULES, Rules, rules_for
from jaxpar.core.strategy import AXES, Options, Strategy
from jaxpar.models.config import ModelConfig

BLOCKS = ("attention", "mamba", "moe", "embedding")


def per_model(fn: Callable) -> Callable:
    """Memoise a pure function of (ModelConfig, *hashable args) on the config's identity (or of any
    first argument that is itself memoised, such as memory.py's inventories). Each object gets a table
    of its own, keyed by the other arguments; the object last seen is checked first (a planner prices
    one model at a time), so a hit costs an identity test and one dict lookup. The memo keeps the
    object alive, so its id cannot be reused while the entry exists; tables and memo are bounded."""
    memo: dict = {}                      # id(object) -> (object, {args: value})
    last: list = [None, {}]              # the object last seen and its table

    @functools.wraps(fn)
    def wrapper(m, *args, **kwargs):
        if m is not last[0]:
            entry = memo.get(id(m))
            if entry is None or entry[0] is not m:
                if len(memo) > 1024:
                    memo.clear()
                entry = memo[id(m)] = (m, {})
            last[0], last[1] = entry
        table = last[1]
        key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
        hit = table.get(key, table)      # the table itself marks a miss (no value is ever the table)
        if hit is not table:
            return hit
        if len(table) > 1024:
            table.clear()
        value = table[key] = fn(m, *args, **kwargs)
        return value

    def cache_clear() -> None:
        memo.clear()
        last[0], last[1] = None, {}
    wrapper.cache_clear = cache_clear
    return wrapper


# ---- the weights ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Weight:
    """One parameter array of a block: shape and logical names as models/ declares them (one layer's,
    without the stacked `layers` dim). Weights concatenated into one matmul operand at run time share
    a `packed` tag; XLA moves such a group as one array."""
    name: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    packed: str = ""

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def mesh_axes(self, rules: Rules) -> set[str]:
        """The mesh axes `rules` shard this weight over (before size-1 axes drop out)."""
        return {axis for name in self.names if name for axis in rules[name]}

    @property
    def expert(self) -> bool:
        """Stacked over the routed experts (split over the `expert` mesh axis)."""
        return "experts" in self.names


@per_model
def attention_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/transformer.py (Attention, pre-norms) and models/layers.py (MLP)."""
    d, f, h, kv, hd = m.d_model, m.mlp_dim, m.heads, m.kv_heads, m.head_dim
    mlp = (Weight("w_gate", (d, f), ("embed", "mlp")),) if m.mlp_type == "swiglu" else ()
    gqa = (Weight("wq", (d, h, hd), ("embed", "q_heads", "head_dim")),
           Weight("wk", (d, kv, hd), ("embed", "kv_heads", "head_dim")),
           Weight("wv", (d, kv, hd), ("embed", "kv_heads", "head_dim")),
           Weight("wo", (h, hd, d), ("q_heads", "head_dim", "embed")),
           *((Weight("q_norm", (hd,), ("head_dim",)), Weight("k_norm", (hd,), ("head_dim",))) if m.qk_norm else ()))
    return (Weight("norm1", (d,), ("embed",)),
            *(latent_attention_weights(m) if m.mla else gqa),
            Weight("norm2", (d,), ("embed",)),
            *mlp,
            Weight("w_up", (d, f), ("embed", "mlp")),
            Weight("w_down", (f, d), ("mlp", "embed")))


def latent_attention_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/mla.py: the query's latent (or one full projection), the K/V latent and its norm, the shared
    RoPE key, the up-projections to every head's k (qk_nope) and v, and the output projection."""
    d, h, hd, c, ql = m.d_model, m.heads, m.head_dim, m.kv_lora_rank, m.q_lora_rank
    head = ("q_heads", "head_dim")
    query = ((Weight("wq_a", (d, ql), ("embed", "latent")), Weight("q_norm", (ql,), ("latent",)),
              Weight("wq_b", (ql, h, hd), ("latent", *head))) if ql else (Weight("wq", (d, h, hd), ("embed", *head)),))
    return (*query,
            Weight("wkv_a", (d, c), ("embed", "latent")), Weight("kv_norm", (c,), ("latent",)),
            Weight("wk_rope", (d, m.qk_rope_head_dim), ("embed", "head_dim")),
            Weight("wk_b", (c, h, m.qk_nope_head_dim), ("latent", *head)),
            Weight("wv_b", (c, h, m.v_head_dim), ("latent", *head)),
            Weight("wo", (h, m.v_head_dim, d), (*head, "embed")))


@per_model
def mamba_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/mamba.py (MambaBlock)."""
    d, h, p, g, n, k = m.d_model, m.ssm_heads, m.ssm_head_dim, m.ngroups, m.d_state, m.d_conv
    heads, groups = ("ssm_heads", "head_dim"), ("ssm_groups", "ssm_state")
    return (Weight("norm", (d,), ("embed",)),
            Weight("w_z", (d, h, p), ("embed", *heads), packed="in_proj"),
            Weight("w_x", (d, h, p), ("embed", *heads), packed="in_proj"),
            Weight("w_B", (d, g, n), ("embed", *groups), packed="in_proj"),
            Weight("w_C", (d, g, n), ("embed", *groups), packed="in_proj"),
            Weight("w_dt", (d, h), ("embed", "ssm_heads"), packed="in_proj"),
            Weight("conv_x", (k, h, p), ("conv", *heads)),
            Weight("conv_x_bias", (h, p), heads),
            Weight("conv_B", (k, g, n), ("conv", *groups)),
            Weight("conv_B_bias", (g, n), groups),
            Weight("conv_C", (k, g, n), ("conv", *groups)),
            Weight("conv_C_bias", (g, n), groups),
            Weight("A_log", (h,), ("ssm_heads",)),
            Weight("dt_bias", (h,), ("ssm_heads",)),
            Weight("D", (h,), ("ssm_heads",)),
            Weight("gate_norm", (h, p), heads),
            Weight("w_out", (h, p, d), (*heads, "embed")))


@per_model
def moe_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/moe.py (MoEBlock: the attention half of models/transformer.py's block, then MoE)."""
    d, e, f = m.d_model, m.experts, m.moe_mlp_dim
    attention_half = tuple(w for w in attention_weights(m) if w.name not in ("w_gate", "w_up", "w_down"))
    shared = m.shared_experts * f
    dense = ((Weight("shared_gate", (d, shared), ("embed", "mlp")), Weight("shared_up", (d, shared), ("embed", "mlp")),
              Weight("shared_down", (shared, d), ("mlp", "embed"))) if shared else ())
    bias = (Weight("router_bias", (e,), (None,)),) if m.router_bias else ()
    return (*attention_half, Weight("router", (d, e), ("embed", None)), *bias,
            Weight("experts_gate", (e, d, f), ("experts", "embed", "mlp")),
            Weight("experts_up", (e, d, f), ("experts", "embed", "mlp")),
            Weight("experts_down", (e, f, d), ("experts", "mlp", "embed")), *dense)


@per_model
def embedding_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/lm.py: the input embedding, the final norm, unless tied the LM head, and the multi-token
    prediction modules (`mtp_weights`): the weights outside the layer stack."""
    head = () if m.tie_embeddings else (Weight("head", (m.d_model, m.vocab), ("embed", "vocab")),)
    return (Weight("embedding", (m.vocab, m.d_model), ("vocab", "embed")),
            Weight("final_norm", (m.d_model,), ("embed",)), *head, *mtp_weights(m) * m.mtp_depth)


def mtp_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """models/mtp.py, one module: its two input norms, W_eh [2, d, d], a block of the last layer's kind,
    its final norm."""
    d = m.d_model
    block = moe_weights(m) if m.mtp_kind == "E" else attention_weights(m)
    return (Weight("mtp_embed_norm", (d,), ("embed",)), Weight("mtp_hidden_norm", (d,), ("embed",)),
            Weight("mtp_w_eh", (2, d, d), (None, "embed", None)), *block, Weight("mtp_norm", (d,), ("embed",)))


def block_weights(m: ModelConfig, block: str) -> tuple[Weight, ...]:
    """The weights of one `block` in BLOCKS."""
    return {"attention": attention_weights, "mamba": mamba_weights, "moe": moe_weights,
            "embedding": embedding_weights}[block](m)


# ---- counts and splits ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class BlockParams:
    sharded: int      # elements split over the tensor axis (not over `expert`)
    replicated: int   # elements replicated over the tensor axis (not over `expert`)
    tensors: int      # parameter arrays (one per weight; stacked over layers under scan)
    moved: int = 0    # arrays as XLA moves them (gathers them): a packed group counts once
    expert_sharded: int = 0     # routed experts' elements: split over `expert` and over `tensor`
    expert_replicated: int = 0  # split over `expert`, replicated over `tensor`

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.expert_sharded + self.expert_replicated

    def __add__(self, o: "BlockParams") -> "BlockParams":
        return BlockParams(*(getattr(self, f.name) + getattr(o, f.name) for f in dataclasses.fields(self)))

    def per_device(self, tensor: int, expert: int = 1) -> float:
        return (self.sharded / tensor + self.replicated
                + (self.expert_sharded / tensor + self.expert_replicated) / expert)


def count(weights: tuple[Weight, ...]) -> BlockParams:
    """Elements split over `tensor` and replicated over it (BASE_RULES), each apart for the routed
    experts' weights (split over `expert` too); arrays; arrays moved."""
    def size(expert: bool, split: bool) -> int:
        return sum(w.size for w in weights if w.expert == expert and ("tensor" in w.mesh_axes(BASE_RULES)) == split)
    packs = {w.packed for w in weights if w.packed}
    return BlockParams(sharded=size(False, True), replicated=size(False, False), tensors=len(weights),
                       moved=sum(1 for w in weights if not w.packed) + len(packs),
                       expert_sharded=size(True, True), expert_replicated=size(True, False))


@functools.cache
def zero_rules(zero: int, purpose: str) -> Rules:
    """The rules table jaxpar/core/rules.py gives a strategy of ZeRO stage `zero` for `purpose` ("params" or
    "optimizer"; those two tables depend on the stage alone)."""
    return rules_for(Strategy(name=f"zero{zero}", mesh=(), options=Options(zero=zero)), purpose)


# the mesh axes ZeRO shards model state over: `embed`'s under ZeRO-3's params and ZeRO-1's optimizer rules
ZERO_AXES = tuple(a for a in AXES if a in zero_rules(3, "params")["embed"] + zero_rules(1, "optimizer")["embed"])


@per_model
def zero_split(m: ModelConfig, block: str, zero: int, purpose: str = "params",
               experts: bool | None = None) -> tuple[BlockParams, BlockParams]:
    """(the weights of `block` that ZeRO stage `zero` shards over the data axes under the `purpose`
    rules, the weights it leaves replicated over them); `experts` True / False keeps only the routed
    experts' weights / only the others."""
    rules = zero_rules(zero, purpose)
    weights = tuple(w for w in block_weights(m, block) if experts is None or w.expert == experts)
    sharded = tuple(w for w in weights if w.mesh_axes(rules) & set(ZERO_AXES))
    return count(sharded), count(tuple(w for w in weights if w not in sharded))


@per_model
def block_params(m: ModelConfig, block: str) -> BlockParams:
    """The weights of one `block` in BLOCKS, counted."""
    return count(block_weights(m, block))


@per_model
def zero_axes(m: ModelConfig, zero: int, purpose: str = "params") -> tuple[str, ...]:
    """The data axes ZeRO stage `zero` shards the model's weights over under the `purpose` rules
    (ZeRO-3 params: fsdp; ZeRO-1 optimizer state: data x fsdp; otherwise none)."""
    rules = zero_rules(zero, purpose)
    used = {a for block in BLOCKS for w in block_weights(m, block) for a in w.mesh_axes(rules)}
    return tuple(a for a in ZERO_AXES if a in used)


@per_model
def attention_block_params(m: ModelConfig) -> BlockParams:
    return block_params(m, "attention")


@per_model
def mamba_dims(m: ModelConfig) -> tuple[int, int, int]:
    """(d_in_proj, conv_dim, nheads) of a Mamba-2 mixer."""
    gn = m.ngroups * m.d_state
    return 2 * m.d_inner + 2 * gn + m.ssm_heads, m.d_inner + 2 * gn, m.ssm_heads


@per_model
def mamba_block_params(m: ModelConfig) -> BlockParams:
    return block_params(m, "mamba")


@per_model
def embedding_params(m: ModelConfig) -> BlockParams:
    """Input embedding (vocab-sharded) and, unless tied, the LM head; final norm replicated."""
    return block_params(m, "embedding")


@per_model
def layer_params(m: ModelConfig) -> BlockParams:
    """All `layers` blocks together (the part that the pipeline axis splits)."""
    blocks = [(block_params(m, b), n) for b, n in zip(LAYER_BLOCKS, block_counts(m)) if n]
    return BlockParams(**{f.name: (sum(n * getattr(p, f.name) for p, n in blocks) if f.name not in ("tensors", "moved")
                                   else sum(getattr(p, f.name) for p, _ in blocks))
                          for f in dataclasses.fields(BlockParams)})


LAYER_BLOCKS = ("attention", "mamba", "moe")  # the blocks of the scanned stack, as `block_counts` counts them


@per_model
def layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(attention layers, Mamba layers): `pattern` repeated to fill `layers` (MoE layers apart)."""
    return m.attention_layers, m.mamba_layers


@per_model
def block_counts(m: ModelConfig) -> tuple[int, int, int]:
    """Layers of each of LAYER_BLOCKS: (attention "A", Mamba-2 "M", mixture of experts "E")."""
    return m.attention_layers, m.mamba_layers, m.moe_layers


def total_params(m: ModelConfig) -> int:
    return layer_params(m).total + embedding_params(m).total
