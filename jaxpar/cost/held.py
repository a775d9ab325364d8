"""What one device holds of the weights, counted for the collectives that move them: elements and arrays
per pattern unit, per stage and for embedding + final norm + head (jaxpar/cost/comm_data.py and
program_pipeline.py reduce them; floor.py bounds them)."""
from __future__ import annotations

import dataclasses

from jaxpar.cost.params import BLOCKS, LAYER_BLOCKS, block_counts, block_params, block_weights, per_model, zero_split
from jaxpar.core.rules import BASE_RULES
from jaxpar.core.strategy import AXES, Strategy
from jaxpar.models.config import ModelConfig

# axes over which (non-expert) weights are replicated: the batch's and the sequence's, in mesh order
DATA_LIKE = tuple(a for a in AXES if a in BASE_RULES["batch"] + BASE_RULES["seq"])


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """Parameter elements per device (after the tensor and pipeline splits) and arrays of a set of
    weights: one pattern unit (the layer stack is stacked over units, so its arrays are the unit's),
    this stage's layer stack, and embedding + final norm + head."""
    unit: float
    unit_arrays: int
    layers: float
    emb: float
    emb_arrays: int

    @property
    def full(self) -> float:
        return self.layers + self.emb

    @property
    def arrays(self) -> int:
        return self.unit_arrays + self.emb_arrays


@per_model
def _held(m: ModelConfig, part: str, zero: int, tensor: int, stages: int, expert: int = 1,
          experts: bool | None = None) -> Held:
    counts = block_counts(m)
    unit = layers = 0.0
    unit_arrays = 0
    emb = None
    for block in BLOCKS:
        if part == "all" and experts is None:
            p = block_params(m, block)
        else:  # the ZeRO-sharded part of each block, or the rest; ZeRO-1 shards by the optimizer rules
            sharded, kept = zero_split(m, block, zero, "optimizer" if zero == 1 else "params", experts)
            p = sharded if part == "zero" else kept if part == "kept" else sharded + kept
        if block == "embedding":
            emb = p
            continue
        n = counts[LAYER_BLOCKS.index(block)]
        per_unit = n // m.units if n else 0
        unit += per_unit * p.per_device(tensor, expert)
        unit_arrays += per_unit * p.tensors
        layers += n * p.per_device(tensor, expert) / stages
    return Held(unit=unit, unit_arrays=unit_arrays, layers=layers, emb=emb.per_device(tensor), emb_arrays=emb.tensors)


def held(m: ModelConfig, st: Strategy, part: str = "all", experts: bool | None = None) -> Held:
    """What one device holds of `part`: "all" weights, the ones the strategy's ZeRO stage shards over the
    data axes ("zero": every weight with an `embed` dim), or the others ("kept": replicated over them);
    `experts` True / False: only the routed experts' weights / only the others."""
    sz = st.sizes
    return _held(m, part, st.zero, sz["tensor"], sz["pipeline"], sz["expert"], experts)


def equal_buffers(total: float, n: int) -> list[float]:
    """`total` bytes as `n` equal buffers (none when n = 0)."""
    return [total / n] * n if n else []


def norm_vectors(m: ModelConfig, block: str) -> tuple[int, int]:
    """(elements, arrays) of a `block`'s norm weights: those whose only dim is `embed`."""
    vectors = [w for w in block_weights(m, block) if w.names == ("embed",)]
    return sum(w.size for w in vectors), len(vectors)


def unit_norms(m: ModelConfig) -> tuple[int, int]:
    """(elements, arrays) of one pattern unit's norm weights (`norm_vectors` of each of its blocks)."""
    unit = arrays = 0
    for kind in m.pattern:
        elements, n = norm_vectors(m, "mamba" if kind == "M" else "moe" if kind == "E" else "attention")
        unit, arrays = unit + elements, arrays + n
    return unit, arrays


def head_and_norm(m: ModelConfig, tensor: int) -> tuple[float, float]:
    """Elements per device of the LM head (0 when tied to the embedding) and the final norm."""
    return (0.0 if m.tie_embeddings else m.vocab * m.d_model / tensor), float(m.d_model)
