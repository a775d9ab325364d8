"""One parameter's path through jaxpar, from its declaration to its PartitionSpec and to the collectives a
training step issues for it (`jaxpar explain PARAM --model M --mesh S`): the README's tour, runnable.

The chain, each step with the file:line it happens at:
    declared     models/: `param(rngs, shape, names)` records the logical names as flax `out_sharding`
                 metadata (the stacked units add `layers` in front: models/lm.py's nnx.vmap);
    rules        jaxpar/core/rules.py: each logical name's mesh axes in `BASE_RULES`, adjusted by
                 `rules_for` for the strategy's options (ZeRO stage, replicated K/V heads);
    spec         jaxpar/core/sharding.py `spec_for`: the axes of size > 1 that survive on this mesh, one
                 PartitionSpec for the parameter (and one for its Adam moments, by the optimizer rules);
    per device   the shard each device holds and its bytes: parameter, gradient, Adam moments;
    collectives  what the step moves for the parameter, by the cost model's own per-weight rules
                 (jaxpar/cost/weight_moves.py), each pointing at the function that predicts it for the
                 whole step; tests/test_explain.py finds each one in the compiled step's HLO.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import pathlib

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

import jaxpar
from jaxpar.core import rules as rules_module
from jaxpar.core import sharding as sharding_module
from jaxpar.core.sharding import Layout, model_layout, param_shardings, spec_for
from jaxpar.core.strategy import AXES, Strategy
from jaxpar.cost import comm_data, comm_tensor
from jaxpar.cost.weight_moves import Move, Reads, View, moves
from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.models import lm as lm_module
from jaxpar.models.lm import LM

PARAM_BYTES = 4   # float32 master weights, gradients and Adam moments
COST_MODULES = {"comm_data": comm_data, "comm_tensor": comm_tensor}   # where the rules' step-wide forms live
ROOT = pathlib.Path(jaxpar.__file__).resolve().parent.parent   # the checkout (or site-packages)
STACK = ("runs", "blocks", "layers")   # path parts a query may leave out: the stacked runs' containers


# ---- where things are written ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    """A line of jaxpar's source: `file:line` and the line's text."""
    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


def _relative(path: str) -> str:
    p = pathlib.Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


@functools.cache
def _tree(path: str) -> tuple[ast.Module, tuple[str, ...]]:
    text = pathlib.Path(path).read_text()
    return ast.parse(text), tuple(text.splitlines())


def _at(path: str, node: ast.AST) -> Source:
    return Source(_relative(path), node.lineno, _tree(path)[1][node.lineno - 1].strip())


def definition(module, name: str) -> Source:
    """Where `module` defines function or class `name` (the file alone if it does not)."""
    path = inspect.getsourcefile(module)
    for node in ast.walk(_tree(path)[0]):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return _at(path, node)
    return Source(_relative(path), 0)


def line_with(module, text: str) -> Source:
    """The first line of `module` that holds `text` (the file alone if none does)."""
    path = inspect.getsourcefile(module)
    lines = _tree(path)[1]
    n = next((i + 1 for i, line in enumerate(lines) if text in line), 0)
    return Source(_relative(path), n, lines[n - 1].strip() if n else "")


def declaration(cls: type, attribute: str) -> Source:
    """Where class `cls` (or a base) assigns `self.<attribute>`: a parameter's declaration."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins" or not klass.__module__.startswith(("jaxpar.models", "models")):
            continue
        path = inspect.getsourcefile(klass)
        for node in ast.walk(_tree(path)[0]):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Assign) and any(
                            isinstance(t, ast.Attribute) and t.attr == attribute and
                            isinstance(t.value, ast.Name) and t.value.id == "self" for t in sub.targets):
                        return _at(path, sub)
    return Source(_relative(inspect.getsourcefile(cls)), 0)


def rule_lines(name: str) -> tuple[Source, ...]:
    """The `BASE_RULES` entry of logical `name` and each line of `rules_for` that sets it, with the
    condition it is under."""
    path = inspect.getsourcefile(rules_module)
    out = []

    def sets(node: ast.AST, condition: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Assign) and any(isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                                                     and t.slice.value == name for t in child.targets):
                line = _at(path, child)
                out.append(dataclasses.replace(line, text=f"{line.text}   (if {condition})" if condition else line.text))
            sets(child, ast.unparse(child.test) if isinstance(child, ast.If) else condition)

    for node in ast.walk(_tree(path)[0]):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "BASE_RULES":
            out += [_at(path, k) for k in node.value.keys if isinstance(k, ast.Constant) and k.value == name]
        if isinstance(node, ast.FunctionDef) and node.name == "rules_for":
            sets(node, "")
    return tuple(out)


# ---- the parameter ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Found:
    """A parameter of the abstract model: dotted path, shape, dtype, logical names, its declaration."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...]
    declared: Source
    variable: nnx.Variable = dataclasses.field(repr=False, compare=False, default=None)


def abstract_model(model: ModelConfig) -> LM:
    """The model from shapes alone (nothing allocated). Shapes and logical names do not depend on how
    the model executes (RunConfig), so the default one serves every strategy."""
    return nnx.eval_shape(lambda: LM(model, rngs=nnx.Rngs(0)))


def parameters(lm: LM) -> dict[str, Found]:
    """Every parameter by dotted path (`runs.0.blocks.0.attn.wq`)."""
    _, state = nnx.split(lm)
    out = {}
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, v in leaves:
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        owner = lm
        for k in keys[:-1]:
            owner = owner[k] if isinstance(k, int) else getattr(owner, k)
        names = tuple(v.get_metadata().get("out_sharding") or ()) or (None,) * len(v.shape)
        dotted = ".".join(map(str, keys))
        out[dotted] = Found(dotted, tuple(v.shape), str(v.dtype), names, declaration(type(owner), str(keys[-1])), v)
    return out


def _short(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split(".") if p not in STACK and not p.isdigit())


def find(params: dict[str, Found], query: str, model_name: str) -> Found:
    """The parameter `query` names: a full path, or its tail (`attn.wq`; the stack's `runs`,
    `blocks`, `layers` and block numbers may be left out). ConfigError on none or several."""
    exact = [p for p in params if p == query or p.endswith("." + query)]
    if not exact:
        tail = _short(query)
        exact = [p for p in params if tail and _short(p)[-len(tail):] == tail]
    if len(exact) == 1:
        return params[exact[0]]
    if exact:
        raise ConfigError(f"parameter {query!r} is ambiguous in {model_name}: it names {', '.join(exact)}")
    shorts = {".".join(_short(p)): p for p in params}
    close = difflib.get_close_matches(".".join(_short(query)), shorts, n=4, cutoff=0.4)
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"its parameters: {', '.join(sorted(shorts))}")
    raise ConfigError(f"no parameter {query!r} in {model_name}; {hint}")


def spec_dims(spec: PartitionSpec, rank: int) -> tuple[tuple[str, ...], ...]:
    dims = tuple(spec) + (None,) * (rank - len(spec))
    return tuple(() if d is None else (d,) if isinstance(d, str) else tuple(d) for d in dims)


def where(move: Move) -> Source:
    """Where the cost model states the rule of `move` (its `rule`, module.name in jaxpar/cost/)."""
    module, _, name = move.rule.partition(".")
    return definition(COST_MODULES[module], name)


# ---- the explanation -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NameRule:
    """One logical name: its mesh axes by the params and optimizer rules, those kept on this mesh."""
    name: str | None
    params: tuple[str, ...]
    optimizer: tuple[str, ...]
    kept: tuple[str, ...]
    where: tuple[Source, ...]


@dataclasses.dataclass(frozen=True)
class Explanation:
    query: str
    model: str
    strategy: Strategy
    param: Found
    rules: tuple[NameRule, ...]
    spec: PartitionSpec
    optimizer_spec: PartitionSpec
    spec_source: Source
    shard: tuple[int, ...]
    optimizer_shard: tuple[int, ...]
    bytes: dict[str, int]    # per device: parameter, gradient, adam moments
    batch: int
    seq: int
    moves: tuple[Move, ...]
    notes: tuple[str, ...]


def abstract_layout(model: ModelConfig, strategy: Strategy) -> Layout:
    """The model's layout on an abstract mesh of the strategy's sizes (no devices needed)."""
    mesh = AbstractMesh(tuple(strategy.size(a) for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return model_layout(mesh, strategy, model)


def explain(model: ModelConfig, model_name: str, strategy: Strategy, query: str, *, batch: int, seq: int,
            lm: LM | None = None) -> Explanation:
    """The chain for the parameter `query` of `model` under a resolved `strategy`, for a step of `batch`
    sequences of `seq` tokens (`lm`: the abstract model, when the caller has built it)."""
    found = find(parameters(abstract_model(model) if lm is None else lm), query, model_name)
    layout = abstract_layout(model, strategy)
    one = nnx.State({"p": found.variable})   # the shardings the trainer gives it
    stored, optimizer = (param_shardings(one, layout, purpose)["p"].get_value() for purpose in ("params", "optimizer"))
    rank = len(found.shape)
    rules = tuple(NameRule(n, layout.rules("params")[n] if n else (), layout.rules("optimizer")[n] if n else (),
                           kept, rule_lines(n) if n else ())
                  for n, kept in zip(found.names, spec_dims(stored.spec, rank)))
    shard, opt_shard = stored.shard_shape(found.shape), optimizer.shard_shape(found.shape)
    grad = opt_shard if strategy.zero == 1 else shard   # ZeRO-1 scatters the gradient like the moments
    nbytes = {"parameter": math.prod(shard) * PARAM_BYTES, "gradient": math.prod(grad) * PARAM_BYTES,
              "adam moments": 2 * math.prod(opt_shard) * PARAM_BYTES}
    listed = moves(view_of(found, layout, stored, optimizer), reads(model, layout, batch, seq))
    return Explanation(query, model_name, strategy, found, rules, stored.spec, optimizer.spec,
                       definition(sharding_module, "spec_for"), shard, opt_shard, nbytes, batch, seq,
                       tuple(listed), _notes(found, model, strategy))


def view_of(found: Found, layout: Layout, stored, optimizer) -> View:
    """One layer's slice of the parameter, with the mesh axes of each dim by the params, optimizer and
    compute rules (`stored`, `optimizer`: its NamedShardings)."""
    rank, drop = len(found.shape), 1 if found.names[:1] == ("layers",) else 0
    compute = spec_for(found.names, layout.rules("compute"), layout.mesh)
    return View(found.names[drop:], spec_dims(stored.spec, rank)[drop:], spec_dims(optimizer.spec, rank)[drop:],
                spec_dims(compute, rank)[drop:], found.shape[drop:], found.dtype,
                stored.shard_shape(found.shape)[0] if drop else 1, stacked=bool(drop))


def reads(model: ModelConfig, layout: Layout, batch: int, seq: int) -> Reads:
    """Per device and micro-batch: `batch` split over the batch axes and the micro-batches, `seq` over
    the sequence axes, with the layout's activation axes."""
    o, mesh = layout.strategy.options, layout.mesh
    micro = o.grad_accum * (o.microbatches if mesh.shape["pipeline"] > 1 else 1)
    sizes = tuple((a, mesh.shape[a]) for a in AXES)
    return Reads(sizes, layout.axes("batch"), layout.axes("seq"), layout.axes("res_seq"),
                 batch // (micro * math.prod(mesh.shape[a] for a in layout.axes("batch"))),
                 seq // math.prod(mesh.shape[a] for a in layout.axes("seq")), model.d_model, o.program_dtype, micro,
                 o.remat)


def _notes(found: Found, model: ModelConfig, strategy: Strategy) -> tuple[str, ...]:
    notes = []
    if "experts" in found.names:
        notes.append("routed experts: the tokens' dispatch and return all-to-alls over `expert` are the MoE "
                     "layer's (jaxpar/cost/comm_expert.py expert_parallel), not listed here")
    if found.names[0] == "vocab" and model.tie_embeddings:
        notes.append("tied embeddings: the table is also read as the LM head, with a head's collectives "
                     "(see `head` of an untied model)")
    if strategy.size("pipeline") > 1:
        notes.append("pipeline: jaxpar's schedules gather a stage's weights once per step for all its "
                     "micro-batches (jaxpar/pipeline/gpipe.py); the counts above are those of the plain loop")
    return tuple(notes)


# ---- the report ------------------------------------------------------------------------------------

def _axes(axes) -> str:
    return " x ".join(axes) if axes else "-"


def _dims(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _spec(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(d) if d is not None else "None" for d in spec) + ")"


def render(e: Explanation) -> str:
    """The chain as text: one section per step, each with its file:line, then the collectives."""
    p, st, lines = e.param, e.strategy, []
    mesh = " ".join(f"{a}={n}" for a, n in st.mesh if n > 1) or "one device"
    lines.append(f"{p.path} of {e.model} on {st.name} ({mesh}; zero={st.zero}"
                 f"{', sequence parallel' if st.options.sequence_parallel else ''})")
    lines += ["", f"1. declared     {p.declared}", f"   {p.declared.text}",
              f"   shape {_dims(p.shape)} {p.dtype}, logical names ({', '.join(str(n) for n in p.names)})"]
    if p.names[:1] == ("layers",):
        stack = line_with(lm_module, "PARTITION_NAME")
        lines += [f"   `layers`: the units stacked by nnx.vmap  {stack}  {stack.text}"]
    lines += ["", f"2. rules        {definition(rules_module, 'rules_for')}  rules_for(strategy, \"params\" | \"optimizer\")"]
    width = max(len(str(r.name)) for r in e.rules)
    for r in e.rules:
        on_mesh = " ".join(f"{a}={st.size(a)}" for a in r.params)
        opt = "" if r.optimizer == r.params else f"; optimizer rules: ({', '.join(r.optimizer)})"
        lines.append(f"   {str(r.name):<{width}}  -> ({', '.join(r.params)})"
                     f"{f' [{on_mesh}]' if on_mesh else ''}, kept on this mesh: {_axes(r.kept)}{opt}")
        lines += [f"   {'':<{width}}     {w}  {w.text}" for w in r.where]
    lines += ["", f"3. spec         {e.spec_source}  spec_for: the rules' axes of size > 1, each used once",
              f"   parameter, gradient  {_spec(e.spec)}", f"   Adam moments         {_spec(e.optimizer_spec)}"]
    total = sum(e.bytes.values())
    lines += ["", f"4. per device   shard {_dims(e.shard)} of {_dims(p.shape)} "
                  f"(1/{math.prod(p.shape) // max(1, math.prod(e.shard))})",
              "   " + ", ".join(f"{k} {human(v)}" for k, v in e.bytes.items()) + f"; {human(total)} in all"]
    lines += ["", f"5. collectives  per step of {e.batch} sequences x {e.seq} tokens; bytes per device per "
                  "execution (the full buffer)"]
    if not e.moves:
        lines.append("   none: the parameter is not moved, nor its gradient summed, on this mesh")
    rows = [(m.phase, m.kind, _axes(m.axes), f"x{m.times}", human(m.nbytes), f"{m.dtype}{_dims(m.shape)}",
             m.why + (" [shared]" if m.shared else ""), str(where(m))) for m in e.moves]
    widths = [max(len(r[i]) for r in rows) for i in range(6)] if rows else []
    for r in rows:
        lines.append("   " + "  ".join(c.ljust(w) for c, w in zip(r[:6], widths)).rstrip())
        lines.append(f"       {r[6]}  ({r[7]})")
    if e.moves:
        lines.append(f"   in all {human(sum(m.nbytes * m.times for m in e.moves))} per device per step")
    lines += [f"   note: {n}" for n in e.notes]
    return "\n".join(lines)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def as_json(e: Explanation) -> dict:
    """The explanation as plain data (`--json`)."""
    return {"param": e.param.path, "model": e.model, "mesh": e.strategy.name, "shape": list(e.param.shape),
            "names": list(e.param.names), "declared": str(e.param.declared),
            "rules": [{"name": r.name, "params": list(r.params), "optimizer": list(r.optimizer),
                       "kept": list(r.kept), "where": [str(w) for w in r.where]} for r in e.rules],
            "spec": [d if d is None or isinstance(d, str) else list(d) for d in e.spec],
            "optimizer_spec": [d if d is None or isinstance(d, str) else list(d) for d in e.optimizer_spec],
            "shard": list(e.shard), "bytes": e.bytes, "batch": e.batch, "seq": e.seq,
            "collectives": [{"phase": m.phase, "kind": m.kind, "axes": list(m.axes), "times": m.times,
                             "bytes": m.nbytes, "shape": list(m.shape), "dtype": m.dtype, "why": m.why,
                             "shared": m.shared, "where": str(where(m))} for m in e.moves],
            "notes": list(e.notes)}
