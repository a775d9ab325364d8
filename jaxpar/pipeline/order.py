"""The stored order of the stacked layer units under a circular pipeline: stage-major, so that no step
moves weights between stages.

The circular schedule (jaxpar/pipeline/gpipe.py) runs chunk c = r*S + s of k units on stage s in repeat r.
In layer order stage s's chunks are scattered over the stacked `layers` dim [U, ...], while a
`pipeline`-sharded dim gives each stage one contiguous block (GSPMD tiles a dim into contiguous
shards), so a step that views the weights as [S, v, k] moves every weight leaf across the stages,
forward and (its gradient) backward: an all-to-all per leaf per step. Stored stage-major instead,
position s*v*k + r*k + j holding unit (r*S + s)*k + j, stage s's block is exactly its chunks and
the view is a reshape.

The permutation is applied where the trainer's state meets the outside, and nowhere inside a step:
  * `Trainer.init_state` and `Trainer.state_from_params` store (once per run or restore);
  * `Checkpointer` saves in layer order (un-stores a copy) and restores into the stored order, so a
    checkpoint is the same under every strategy and moves between them freely;
  * `Trainer.loss_and_grads` hands gradients back in layer order (what the equivalence tests
    compare with one device); `Trainer.stored_loss_and_grads` is the step's own program.
The model itself never sees the stored order: the pipeline is the only code that runs the stacked
units of a training state, and it reads them through the order (a reshape). The numbers are the
same ones in the same places, so loss and gradients are bit-for-bit unchanged.

Only the even circular split is reordered: GPipe's stage-major order is layer order, and an uneven
split cannot shard `layers` evenly over the stages in any order (jaxpar/core/schedule.py, stored_spec).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxpar.core.schedule import Schedule, schedule_of
from jaxpar.core.strategy import Strategy


def stage_major(sched: Schedule) -> np.ndarray | None:
    """order[p] = the layer unit stored at position p (stage-major), or None where that is layer order."""
    S, v, k = sched.stages, sched.repeats, sched.per_chunk
    if S == 1 or v == 1 or not sched.even:
        return None
    return np.array([(r * S + s) * k + j for s in range(S) for r in range(v) for j in range(k)])


def unit_order(strategy: Strategy, runs: tuple[int, ...] | int) -> np.ndarray | None:
    """The stored order of a model's stacked units (`runs`: per run, ModelConfig.run_units) under
    `strategy` (None: layer order; a model of several runs is never split evenly, so it keeps layer order)."""
    if strategy.size("pipeline") == 1:
        return None
    return stage_major(schedule_of(strategy, runs))


def _key(path) -> tuple[str, ...]:
    key = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return key[:-1] if key[-1:] == ("value",) else key


def stacked_paths(abstract_params: Any) -> set[tuple[str, ...]]:
    """Paths of the parameters whose first dim is the stacked `layers` dim (their sharding names say so)."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params, is_leaf=lambda a: hasattr(a, "get_metadata"))
    return {_key(p) for p, v in leaves if tuple(v.get_metadata().get("out_sharding") or ())[:1] == ("layers",)}


def reorder(tree: Any, stacked: set[tuple[str, ...]], order: np.ndarray | None, inverse: bool = False) -> Any:
    """`tree` (parameters, gradients, optimizer state or a whole train state) with every leaf whose path
    ends in a stacked parameter's path taken in `order` along its first dim (`inverse`: back to layer
    order). Under jit with the state's shardings: the one-off permutation across stages."""
    if order is None:
        return tree
    index = np.argsort(order) if inverse else order

    def one(path, leaf):
        key = _key(path)
        if any(key[len(key) - len(p):] == p for p in stacked if len(p) <= len(key)):
            return leaf[index]
        return leaf
    return jax.tree_util.tree_map_with_path(one, tree)
