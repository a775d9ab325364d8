"""From logical names to NamedShardings, and the layout in force while a step is traced.

Parameters carry their logical names as flax `out_sharding` metadata; activations are annotated by
the model with `constrain(x, names)`. Both go through `spec_for`, which looks each name up in a
rules table (jaxpar/core/rules.py) and drops mesh axes of size 1: a parameter's PartitionSpec is its
names read through the table, nothing else. `Layout` is a mesh with a strategy's tables, `use_layout`
makes one current while the model is traced, and `param_shardings` / `optimizer_shardings` give the
train state's shardings. The places where the model steers XLA's partitioner beyond these names are in
jaxpar/xla_workarounds.py.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.core.rules import Rules, rules_for, spec_entry
from jaxpar.core.schedule import stored_spec
from jaxpar.core.strategy import Strategy

if TYPE_CHECKING:
    from jaxpar.models.config import ModelConfig


def spec_for(names: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
    """PartitionSpec for a tuple of logical names (None = unsharded dim)."""
    used: set[str] = set()
    dims = []
    for name in names:
        axes = tuple(a for a in (rules[name] if name is not None else ()) if mesh.shape[a] > 1 and a not in used)
        used.update(axes)
        dims.append(spec_entry(axes))
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the three rules tables of a strategy (`replicate_kv_heads`: see rules_for); `runs`: the
    model's stacked units per run (ModelConfig.run_units; () = each stacked weight its own run), which a
    pipeline's at-rest layout of the stacked weights depends on (jaxpar/core/schedule.py stored_spec)."""
    mesh: Mesh
    strategy: Strategy
    replicate_kv_heads: bool = False
    runs: tuple[int, ...] = ()

    def rules(self, purpose: str) -> Rules:
        return rules_for(self.strategy, purpose, replicate_kv_heads=self.replicate_kv_heads)

    def axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) an activation's logical name is sharded over."""
        return tuple(a for a in self.rules("activations")[name] if self.mesh.shape[a] > 1)

    def size(self, name: str) -> int:
        """Devices an activation's logical name is split over (`group` of its axes)."""
        return self.group(self.axes(name))

    def group(self, axes) -> int:
        """Devices in a group over mesh `axes` (the product of their sizes)."""
        return math.prod(self.mesh.shape[a] for a in axes)

    def activation(self, *names: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, spec_for(names, self.rules("activations"), self.mesh))


def model_layout(mesh: Mesh, strategy: Strategy, model: ModelConfig) -> Layout:
    """A model's layout: K/V heads replicated across tensor ranks when tensor exceeds the model's
    kv_heads (Megatron's rule; jaxpar.core.rules.rules_for), for training and generation alike."""
    return Layout(mesh, strategy, replicate_kv_heads=model.has_attention and strategy.size("tensor") > model.kv_heads,
                  runs=model.run_units)


_CURRENT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("jaxpar_layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[None]:
    """Make `layout` the one `constrain` and the shard_map kernels see while tracing."""
    token = _CURRENT.set(layout)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_layout() -> Layout | None:
    return _CURRENT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical names; a no-op outside a layout (one device)."""
    layout = _CURRENT.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.activation(*names))


# ---- parameters and optimizer state ------------------------------------------------------------

def param_shardings(abstract_state: Any, layout: Layout, purpose: str = "params") -> Any:
    """NamedSharding per parameter leaf, in the same nnx.State structure as the parameters."""
    rules = layout.rules(purpose)

    def one(v: nnx.Variable) -> nnx.Variable:
        names = tuple(v.get_metadata().get("out_sharding") or ()) or (None,) * len(v.shape)
        spec = spec_for(names, rules, layout.mesh)
        if names[:1] == ("layers",):  # a stacked weight: an uneven pipeline split moves `pipeline` off `layers`
            spec = stored_spec(spec, v.shape, layout.strategy, layout.runs)
        return v.replace(NamedSharding(layout.mesh, spec))

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_shardings(abstract_opt_state: Any, abstract_params: Any, layout: Layout) -> Any:
    """Shardings for an optax state: leaves shaped like a parameter follow the optimizer rules
    for that parameter (matched by the tail of their tree path); everything else is replicated."""
    by_path = {}
    opt_sh = param_shardings(abstract_params, layout, "optimizer")
    for path, sh in jax.tree_util.tree_leaves_with_path(opt_sh):
        by_path[_path_key(path)] = sh
    replicated = NamedSharding(layout.mesh, P())

    def one(path, leaf):
        key = _path_key(path)
        for start in range(len(key)):
            if key[start:] in by_path:
                return by_path[key[start:]]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
