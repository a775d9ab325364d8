"""What one device holds of the weights, counted for the collectives that move them: elements and arrays
per unit of each run, per stage and for embedding + final norm + head (jaxpar/cost/comm_data.py and
program_pipeline.py reduce them; floor.py bounds them)."""
from __future__ import annotations

from typing import NamedTuple

from jaxpar.cost.params import BLOCKS, LAYER_BLOCKS, block_counts, block_params, block_weights, per_model, zero_split
from jaxpar.core.rules import BASE_RULES
from jaxpar.core.strategy import AXES, Strategy
from jaxpar.models.config import ModelConfig

LAYER_BLOCK = {"A": "attention", "M": "mamba", "E": "moe"}   # the params block of each block letter
# axes over which (non-expert) weights are replicated: the batch's and the sequence's, in mesh order
DATA_LIKE = tuple(a for a in AXES if a in BASE_RULES["batch"] + BASE_RULES["seq"])


class Held(NamedTuple):
    """Parameter elements per device (after the tensor and pipeline splits) and arrays of a set of
    weights: one unit of each run (`runs`: (elements, arrays) per run, in layer order; a run is stacked over
    its units, so its arrays are the unit's), this stage's layer stack, and embedding + final norm + head.
    Build one with `of` (which counts the stack's arrays)."""
    runs: tuple[tuple[float, int], ...]
    layers: float
    emb: float
    emb_arrays: int
    stack_arrays: int   # arrays of the layer stack: every run's stacked arrays

    @classmethod
    def of(cls, runs: tuple[tuple[float, int], ...], layers: float, emb: float, emb_arrays: int) -> Held:
        return cls(runs, layers, emb, emb_arrays, sum(n for _, n in runs))

    @property
    def unit(self) -> float:
        """Elements of a one-run model's unit (a model of several runs has one per run: `runs`)."""
        (elements, _), = self.runs
        return elements

    def slots(self, shape) -> float:
        """Elements of a pipeline stage's v chunks of unit slots (`shape`: a StepShape): sum_j (v k_j) x unit_j."""
        return sum(u * (shape.repeats * k) for (u, _), k in zip(self.runs, shape.run_slots))

    @property
    def full(self) -> float:
        return self.layers + self.emb

    @property
    def arrays(self) -> int:
        return self.stack_arrays + self.emb_arrays


@per_model
def _held(m: ModelConfig, part: str, zero: int, tensor: int, stages: int, expert: int = 1,
          experts: bool | None = None) -> Held:
    per_block = {}
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
        per_block[block] = p
    runs, layers = [], 0.0
    for r in m.runs:
        unit, arrays = 0.0, 0
        for block, letter in zip(LAYER_BLOCKS, "AME"):
            unit += r.unit.count(letter) * per_block[block].per_device(tensor, expert)
            arrays += r.unit.count(letter) * per_block[block].tensors
        runs.append((unit, arrays))
    for block, n in zip(LAYER_BLOCKS, block_counts(m)):
        layers += n * per_block[block].per_device(tensor, expert) / stages
    return Held.of(tuple(runs), layers, emb.per_device(tensor, expert), emb.tensors)  # (a MoE MTP block's experts)


@per_model   # (memoised on the strategy: the data-parallel sites ask for it several times per estimate)
def data_axes(st: Strategy) -> tuple[str, ...]:
    """The data-like axes (DATA_LIKE) of size > 1, in mesh order: what replicated weights are summed over."""
    return tuple(a for a in DATA_LIKE if st.sizes[a] > 1)


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


@per_model
def unit_norms(m: ModelConfig) -> tuple[tuple[int, int], ...]:
    """Per run, (elements, arrays) of one unit's norm weights (`norm_vectors` of each of its blocks)."""
    out = []
    for r in m.runs:
        vectors = [norm_vectors(m, LAYER_BLOCK[kind]) for kind in r.unit]
        out.append((sum(e for e, _ in vectors), sum(n for _, n in vectors)))
    return tuple(out)


def head_and_norm(m: ModelConfig, tensor: int) -> tuple[float, float]:
    """Elements per device of the LM head (0 when tied to the embedding) and the final norm."""
    return (0.0 if m.tie_embeddings else m.vocab * m.d_model / tensor), float(m.d_model)
