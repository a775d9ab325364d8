"""A strategy = mesh axis sizes + options. Loaded from a mesh_configs TOML or an inline spec.

    data=2,fsdp=2,tensor=2                      inline (every other axis is 1; -1 fills the rest)
    mesh_configs/dp2-fsdp2-tp2.toml             a file with [mesh] sizes and [options]
    dp2-fsdp2-tp2                               the same, by name (looked up in mesh_configs/)

The options are the variants of a strategy (docs/design.md, "Options: one schema"): they change *how* the same mesh is used,
never which code path a model takes. Command-line STRATEGY FLAGS override a file's [options].
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import pathlib
import types
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.core.inputs import did_you_mean, parse_int, read_toml, table
from jaxpar.xla_presets import NAMES as XLA_PRESETS

# Canonical order, outermost (slowest links) to innermost (fastest links).
AXES: tuple[str, ...] = ("data", "fsdp", "pipeline", "context", "expert", "tensor")



def _mesh_config_dir() -> pathlib.Path:
    """The strategy catalogue: the top-level mesh_configs/ folder, installed as jaxpar.mesh_configs."""
    spec = importlib.util.find_spec("jaxpar.mesh_configs")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("jaxpar.mesh_configs is not installed: reinstall jaxpar (pip install -e . in a checkout)")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


MESH_CONFIG_DIR = _mesh_config_dir()


# The concerns an option belongs to (`--help` groups the strategy flags by them), and the commands that read it
GROUPS = {"layout": "how the mesh is used: ZeRO stage, sequence and pipeline splits, micro-batches",
          "kernels": "what computes each part of a step: recompute, attention and MoE kernels, collective matmul",
          "precision": "the compute and gradient dtypes", "compiler": "XLA's scheduling of the collectives"}
TRAINING = ("train", "comm", "compare", "estimate")   # the commands that build or price a training step
FORWARD = ("generate", "eval")                         # the commands that run the model forward only
EVERY = TRAINING + ("explain",) + FORWARD


def _option(default: Any, help: str, choices: tuple | None = None, *, group: str, commands: tuple = TRAINING,
            estimate_only: tuple = ()) -> Any:
    """An Options field: its help, choices, concern (`GROUPS`), the commands that read it, and the values only
    `estimate` takes (another stack's, which jaxpar's program does not run)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                                        "commands": commands, "estimate_only": estimate_only})


@dataclasses.dataclass(frozen=True)
class Options:
    """The one schema of strategy options: a mesh file's [options] table, the command line's strategy flags
    (generated from these fields, each command offering those it reads: jaxpar/cli/main.py), and what the
    run reads. Grouped by concern (`GROUPS`). To add an option, add a field here and use it."""
    zero: int | None = _option(None, "0 replicated data parallelism, 1 sharded optimizer state, 3 FSDP "
                                     "(default: 3 if the mesh has fsdp > 1, else 0)", (0, 1, 3), group="layout",
                               commands=EVERY)
    sequence_parallel: bool = _option(False, "shard the residual stream's sequence (norms, residuals) over tensor",
                                      group="layout", commands=TRAINING + ("explain",))
    remat: str = _option("none", "rematerialise activations in the backward pass: full keeps only each layer's "
                                 "input; selective recomputes the attention core only (Korthikanti et al. 2022); "
                                 "offload keeps the named activations in host memory; dots / dots_no_batch are "
                                 "JAX's matmul-saving policies",
                         ("none", "full", "selective", "offload", "dots", "dots_no_batch"), group="kernels",
                         commands=TRAINING + ("explain",))
    dtype: str = _option("float32", "compute dtype (master weights stay float32); float8: the projections "
                                    "(attention, MLP, experts) as scaled float8 GEMMs by --fp8-recipe, the "
                                    "rest in bfloat16 (jaxpar/ops/fp8.py)",
                         ("float32", "bfloat16", "float8"), group="precision", commands=EVERY)
    fp8_recipe: str = _option("tensorwise", "how dtype=float8 scales each GEMM's operands: tensorwise (one scale "
                                            "per tensor, e5m2 gradients), rowwise (per row, powers of two), "
                                            "blockwise (DeepSeek-V3's 1x128 tiles and 128x128 weight blocks)",
                              ("tensorwise", "rowwise", "blockwise"), group="precision",
                              commands=TRAINING + ("explain", "eval"))
    fp8_gather: bool = _option(False, "dtype=float8 under FSDP: quantize each projection weight on its shards and "
                                      "all-gather it in float8 with its scales (half bfloat16's bytes; "
                                      "torchtitan's float8 all-gather), forward and again for the input gradient",
                               group="precision", commands=TRAINING + ("explain",))
    fp8_sp_gather: bool = _option(False, "dtype=float8 tensorwise under sequence parallelism: quantize the column-"
                                         "parallel projections' input on its sequence shards and all-gather it "
                                         "over tensor in float8 (half the compute dtype's bytes)",
                                  group="precision", commands=TRAINING + ("explain",))
    grad_dtype: str = _option("float32", "the dtype gradients accumulate and are reduced in: float32 (jaxpar's "
                                         "program; Megatron under bf16; FSDP2's reduce_dtype in torchtitan); "
                                         "bfloat16 for other stacks' runs (NeMo's optim.grad_sync_dtype bf16, "
                                         "Megatron-Core with grad_reduce_in_fp32 off)",
                              ("float32", "bfloat16"), group="precision", commands=("estimate",),
                              estimate_only=("bfloat16",))
    attention: str = _option("dense", "how the sequence is split for attention: dense keeps it whole on each "
                                      "device; ring and allgather split it over context (not the kernel: "
                                      "--attention-kernel)", ("dense", "ring", "allgather"), group="layout",
                             commands=EVERY)
    attention_kernel: str = _option("dense", "what computes attention on a device (jaxpar/ops/attention.py): dense "
                                             "keeps the score matrix for the backward pass; blockwise (pure JAX, "
                                             "online softmax, recomputed backward) keeps memory linear in the "
                                             "sequence; cudnn is cuDNN's fused flash kernel (NVIDIA GPU, bfloat16); "
                                             "splash is the Pallas splash-attention kernel (TPU; Pallas interpret "
                                             "mode elsewhere); auto: cudnn on a GPU in bfloat16, splash on a TPU, "
                                             "else blockwise (not the sequence's split: --attention)",
                                    ("dense", "auto", "blockwise", "cudnn", "splash"), group="kernels",
                                    commands=TRAINING + FORWARD)
    moe_kernel: str = _option("grouped", "how the routed experts compute (jaxpar/ops/moe.py): grouped sorts the "
                                         "token copies by expert and multiplies only the routed copies "
                                         "(ragged_dot; under expert parallelism a ragged all-to-all on GPU and "
                                         "TPU, a fixed-capacity bucketed all-to-all on CPU); padded fills static "
                                         "per-expert buffers (dropless: E/k times the copies)",
                              ("grouped", "padded"), group="kernels", commands=TRAINING + FORWARD)
    cp_layout: str = _option("contiguous", "token layout under context parallelism (zigzag balances causal work)",
                             ("contiguous", "zigzag"), group="layout", commands=TRAINING + FORWARD)
    microbatches: int = _option(1, "pipeline micro-batches (pipeline > 1)", group="layout",
                                commands=TRAINING + ("explain",))
    pp_schedule: str = _option("gpipe", "pipeline schedule (zb-h1, zb-v, dualpipe-v: priced for the stacks that run "
                               "them; jaxpar/core/timetable.py)", ("gpipe", "circular", "1f1b", "zb-h1", "zb-v",
                                                                   "dualpipe-v"), group="layout",
                               commands=TRAINING + ("explain",))
    pp_repeats: int = _option(1, "circular or 1f1b schedule: layer chunks per stage (v; 1f1b: interleaved)",
                              group="layout", commands=TRAINING + ("explain",))
    grad_accum: int = _option(1, "gradient-accumulation steps per optimizer step", group="layout",
                              commands=TRAINING + ("explain",))
    overlap: str = _option("none", "hide tensor parallelism's collectives behind matmuls: collective_matmul "
                                   "splits the all-gather before each column-parallel projection and the "
                                   "reduce-scatter after each row-parallel one into ring steps (ppermute) "
                                   "interleaved with partial matmuls; _bidir uses both ring directions "
                                   "(needs tensor > 1 and sequence_parallel)",
                           ("none", "collective_matmul", "collective_matmul_bidir"), group="kernels")
    fsdp_prefetch: bool = _option(False, "FSDP: gather the next layer's weights while this layer computes, "
                                         "forward and backward (jaxpar/ops/fsdp_prefetch.py; needs zero=3 and "
                                         "remat=full; holds two layers' gathered weights at a time)", group="kernels")
    xla_preset: str = _option("none", "compiler scheduling preset (jaxpar/xla_presets.py): XLA options that let "
                                      "collectives run asynchronously behind compute on GPU or TPU; the "
                                      "partitioning and the bytes are unchanged", XLA_PRESETS, group="compiler")

    pp_stages: str = _option("", "pipeline: layer units per stage chunk, comma-separated in execution order "
                                 "(S values for gpipe, S*v for circular or 1f1b; default: even, or the first and last "
                                 "chunks one unit lighter when S*v does not divide the units)", group="layout",
                             commands=TRAINING + ("explain",))

    @property
    def program_dtype(self) -> str:
        """What jaxpar's program computes in outside its float8 GEMMs (float8: bfloat16, as the recipes keep
        it; jaxpar/ops/fp8.py), and so the dtype of its activations and gathered weights."""
        return "bfloat16" if self.dtype == "float8" else self.dtype

def resolve_kernel(kernel: str, dtype: Any = "float32", platform: str | None = None) -> str:
    """The kernel `attention_kernel = auto` stands for on `platform` (cpu | gpu | tpu; default this process's
    backend): cudnn on a GPU in a 16-bit dtype (the only ones cuDNN's flash kernel takes), splash on a TPU,
    blockwise elsewhere. Any other name is itself. The run asks it (jaxpar/ops/attention.py) and so does the
    cost model for the hardware it prices (cost.software), which gives the platform and so loads no JAX."""
    if kernel != "auto":
        return kernel
    if platform is None:
        import jax  # deferred: the process's backend, asked only by a run (the cost model names its platform)
        platform = jax.default_backend()
    if platform == "tpu":
        return "splash"
    sixteen_bit = str(getattr(getattr(dtype, "dtype", dtype), "name", dtype)) in ("bfloat16", "float16")
    return "cudnn" if platform == "gpu" and sixteen_bit else "blockwise"


def options_of(command: str) -> tuple[dataclasses.Field, ...]:
    """The Options fields `command` reads, in schema order."""
    return tuple(f for f in OPTION_FIELDS if command in f.metadata["commands"])


def takes(command: str, option: str) -> tuple[str, ...]:
    """The commands that read `option` ("" where `command` is one of them)."""
    field = next(f for f in OPTION_FIELDS if f.name == option)
    return () if command in field.metadata["commands"] else field.metadata["commands"]


OPTION_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(Options)
CHOICES: dict[str, tuple] = {f.name: f.metadata["choices"] for f in OPTION_FIELDS if f.metadata["choices"]}


def toml_value(value: Any) -> str:
    """A value as a TOML file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    mesh: tuple[tuple[str, int], ...]   # ((axis, size), ...) in canonical order; may hold one -1
    options: Options = Options()
    description: str = ""
    dcn: tuple[tuple[str, int], ...] = ()  # across-host part of each axis (multi-host layouts)
    # generate's own layouts for its two phases, (("prefill", Strategy), ("decode", Strategy)): a mesh
    # file's [prefill] / [decode] tables; a phase not given runs on this strategy (`phase`)
    phases: tuple[tuple[str, "Strategy"], ...] = ()

    # Derived once per instance (the cost model reads them a few dozen times per estimate); a frozen
    # dataclass's fields never change, and dataclasses.replace makes a new instance.
    @functools.cached_property
    def sizes(self) -> Mapping[str, int]:
        """{axis: size}, read-only (copy it with dict() to edit)."""
        return types.MappingProxyType(dict(self.mesh))

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def group(self, axes: tuple[str, ...]) -> int:
        """Devices in a group over `axes` (the product of their sizes)."""
        return math.prod(self.sizes[a] for a in axes)

    @functools.cached_property
    def zero(self) -> int:
        if self.options.zero is not None:
            return self.options.zero
        return 3 if self.size("fsdp") > 1 else 0

    @functools.cached_property
    def num_devices(self) -> int:
        return math.prod(s for _, s in self.mesh)

    def resolved(self, num_devices: int) -> "Strategy":
        """Replace a -1 axis by what fills `num_devices`; check the product."""
        sizes = dict(self.mesh)
        free = [a for a, s in sizes.items() if s == -1]
        known = math.prod(s for s in sizes.values() if s != -1)
        if len(free) > 1:
            raise ConfigError(f"mesh {self.name}: only one axis may be -1, got {', '.join(free)}")
        if free:
            if num_devices % known:
                raise ConfigError(f"mesh {self.name}: the fixed axes' product {known} does not divide "
                                  f"{num_devices} devices, so -1 for {free[0]} cannot be filled")
            sizes[free[0]] = num_devices // known
        product = math.prod(sizes.values())
        if product != num_devices:
            desc = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
            simulate = f" (on CPU, --devices {product} simulates {product} devices)" if product > num_devices else ""
            raise ConfigError(f"mesh {self.name}: axis product {product} ({desc}) != device count {num_devices}"
                              + simulate)
        check_dcn(self.name, tuple(sizes.items()), self.dcn)
        return dataclasses.replace(self, mesh=tuple(sizes.items()),
                                   phases=tuple((p, st.resolved(num_devices)) for p, st in self.phases))

    def phase(self, name: str) -> "Strategy":
        """The layout generate uses for `name` (prefill | decode): its own table's, else this one."""
        return dict(self.phases).get(name, self)

    def with_options(self, **overrides: Any) -> "Strategy":
        """These options changed (None: unchanged), in the phases' layouts too (a flag wins over a file)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, options=make_options(dataclasses.asdict(self.options) | overrides,
                                                              self.name),
                                   phases=tuple((p, st.with_options(**overrides)) for p, st in self.phases))

    def describe(self) -> str:
        axes = " x ".join(f"{a}={s}" for a, s in self.mesh if s != 1) or "1 device"
        return f"{self.name} [{axes}]"

    def describe_options(self, zero: int | None = None) -> str:
        """The options in force, in a mesh file's words: every option set to other than its default
        (by the file or a flag), and the ZeRO stage as resolved from the mesh, or `zero` where the
        caller prices another (a stack whose FSDP spans the context ranks: jaxpar.cost.defaults)."""
        items = [f"zero = {self.zero if zero is None else zero}"]
        for f in OPTION_FIELDS:
            value = getattr(self.options, f.name)
            if f.name != "zero" and value != f.default:
                items.append(f"{f.name} = {toml_value(value)}")
        return ", ".join(items)


def make_options(raw: dict[str, Any], where: str) -> Options:
    known = {f.name: f for f in OPTION_FIELDS}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key not in known:
            raise ConfigError(f"{where}: unknown option {key!r}{did_you_mean(key, known)}; options: {', '.join(known)}")
        default = known[key].default
        if key == "zero":
            value = None if value is None else _as_int(key, value, where)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: option {key}={value!r} must be true or false")
        elif isinstance(default, int):
            value = _as_int(key, value, where)
            if value < 1:
                raise ConfigError(f"{where}: option {key}={value} must be >= 1")
        if key in CHOICES and value is not None and value not in CHOICES[key]:
            allowed = " | ".join(str(c) for c in CHOICES[key])
            raise ConfigError(f"{where}: option {key}={value!r} is not one of {allowed}")
        out[key] = value
    return Options(**out)


def _as_int(key: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: option {key}={value!r} must be an integer")
    return value


def _mesh_sizes(raw: dict[str, Any], where: str, *, fill: bool = True) -> tuple[tuple[str, int], ...]:
    """The axis sizes of a [mesh] table or an inline spec, every axis in AXES order (1 if not named):
    positive integers, and at most one -1 (`fill`: the axis that takes the remaining devices)."""
    for axis, size in raw.items():
        if axis not in AXES:
            raise ConfigError(f"{where}: unknown mesh axis {axis!r}{did_you_mean(axis, AXES)}; "
                              f"axes are {', '.join(AXES)}")
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and (size != -1 or not fill)):
            raise ConfigError(f"{where}: mesh axis {axis}={size!r} must be a positive integer"
                              + (" or -1" if fill else ""))
    free = [a for a, s in raw.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"{where}: only one axis may be -1, got {', '.join(free)}")
    return tuple((a, int(raw.get(a, 1))) for a in AXES)


def check_dcn(name: str, mesh: tuple[tuple[str, int], ...], dcn: tuple[tuple[str, int], ...]) -> None:
    """A [mesh.dcn] table against its mesh: axis a = dcn[a] host groups x the devices inside one host
    (jaxpar/core/mesh.py), so each across-host factor divides its axis (an axis still -1 is checked
    once `resolved` fills it)."""
    sizes = dict(mesh)
    for axis, n in dcn:
        if sizes[axis] != -1 and sizes[axis] % n:
            how = "is larger than" if n > sizes[axis] else "does not divide"
            raise ConfigError(f"mesh {name}: [mesh.dcn] {axis}={n} {how} the mesh axis {axis}={sizes[axis]} (the "
                              "axis is dcn host groups x the devices inside one host: dcn must divide it)")


def parse_inline(spec: str) -> Strategy:
    raw: dict[str, Any] = {}
    for item in spec.split(","):
        axis, eq, value = item.partition("=")
        axis = axis.strip()
        if not eq:
            raise ConfigError(f"malformed mesh spec {spec!r}: expected axis=size items like data=2,tensor=4")
        if axis in raw:
            raise ConfigError(f"mesh spec {spec!r} gives axis {axis} twice ({raw[axis]} and {value.strip()})")
        try:
            raw[axis] = parse_int(value)
        except ValueError:
            raise ConfigError(f"malformed mesh spec {spec!r}: size {value!r} of {axis} is not an integer") from None
    return Strategy(name=spec, mesh=_mesh_sizes(raw, f"mesh {spec!r}"))


PHASES = ("prefill", "decode")  # generate's phases, each of which a mesh file may lay out itself


def load_toml(path: pathlib.Path) -> Strategy:
    """A mesh file: [mesh] (with an optional [mesh.dcn]), [options], a description, and optionally
    [prefill] / [decode] tables for `jaxpar generate`, each with its own [<phase>.mesh] (replacing the
    top-level mesh: axes it does not name are 1) and/or [<phase>.options] (over the top-level
    options). jaxpar.core.validate.check_phases checks the phases against each other."""
    data = read_toml(path, "mesh")
    where = str(path)
    unknown = set(data) - {"description", "mesh", "options", *PHASES}
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {', '.join(sorted(unknown))}; expected description, [mesh], "
                          "[options], [prefill], [decode]")
    if not isinstance(data.get("description", ""), str):
        raise ConfigError(f"{where}: description must be a string, got {data['description']!r}")
    top = _from_tables(path.stem, data, where)
    phases = []
    for phase in PHASES:
        if phase not in data:
            continue
        raw = table(data, phase, where)
        extra = set(raw) - {"mesh", "options"}
        if extra or not raw:
            raise ConfigError(f"{where}: [{phase}] takes a [{phase}.mesh] and/or a [{phase}.options] table"
                              + (f", not {', '.join(sorted(extra))}" if extra else ""))
        merged = {"mesh": raw.get("mesh", data.get("mesh", {})),
                  "options": dict(table(data, "options", where)) | dict(table(raw, "options", f"{where} [{phase}]"))}
        phases.append((phase, _from_tables(f"{path.stem}[{phase}]", merged, f"{where} [{phase}]")))
    return dataclasses.replace(top, description=str(data.get("description", "")), phases=tuple(phases))


def _from_tables(name: str, data: dict, where: str) -> Strategy:
    """A Strategy from a [mesh] table (with an optional [mesh.dcn]) and an [options] table."""
    mesh = dict(table(data, "mesh", where))
    if not mesh:
        raise ConfigError(f"{where}: needs a [mesh] table with axis sizes")
    dcn = table(mesh, "dcn", where) if "dcn" in mesh else {}
    mesh.pop("dcn", None)
    sizes = _mesh_sizes(mesh, where)
    across = tuple((a, s) for a, s in _mesh_sizes(dcn, where + " [mesh.dcn]", fill=False) if s != 1)
    check_dcn(name, sizes, across)
    return Strategy(name=name, mesh=sizes, options=make_options(dict(table(data, "options", where)), where),
                    dcn=across)


def parse_strategy(spec: str) -> Strategy:
    """Inline `axis=size,...`, a TOML path, or the name of a file in mesh_configs/."""
    if "=" in spec:
        return parse_inline(spec)
    path = pathlib.Path(spec)
    if path.suffix == ".toml" or path.exists():
        return load_toml(path)
    candidate = MESH_CONFIG_DIR / f"{spec}.toml"
    if candidate.exists():
        return load_toml(candidate)
    names = sorted(p.stem for p in MESH_CONFIG_DIR.glob("*.toml"))
    raise ConfigError(f"unknown mesh {spec!r}{did_you_mean(spec, names)}: not an inline spec (data=2,tensor=4), "
                      f"a TOML path, or a name in mesh_configs/ ({', '.join(names)})")


def catalogue() -> list[Strategy]:
    """Every strategy in mesh_configs/, by name."""
    return [load_toml(p) for p in sorted(MESH_CONFIG_DIR.glob("*.toml"))]
