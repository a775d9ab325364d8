"""The question a plan answers -- model, hardware, software, devices, sequence, global batch, HBM headroom --
as one value: printed above a plan or an estimate, and written by `plan --write` as a run file beside
each plan's mesh file, so that `jaxpar estimate --run NAME.run.toml` asks the same question of the same
layout with no other flag.

The strategy and the question stay in separate files: the mesh file (`[mesh]` and `[options]`) is what
`train`, `comm` and `estimate --mesh` take; the run file names it (`mesh`, a path relative to the run
file) and holds the rest:

    # jaxpar plan: the question behind plan-01-fsdp64.toml
    mesh = "plan-01-fsdp64.toml"
    model = "llama3-8b"
    hardware = "h100-sxm"
    software = "jaxpar"
    devices = 64
    seq = 4096
    global_batch = 256
    hbm_headroom = 0.08

A model or hardware given as a TOML path (or a model as hf:DIR) is written as an absolute path, so the run file reads the same
from any directory.
"""
from __future__ import annotations

import dataclasses
import pathlib

from jaxpar.core.inputs import read_toml
from jaxpar.cost import params
from jaxpar.cost.estimate import HBM_HEADROOM
from jaxpar.cost.hardware import Hardware
from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig

# The question estimate, plan, comm and compare ask unless --seq / --batch (--global-batch) say otherwise
DEFAULT_SEQ, DEFAULT_GLOBAL_BATCH = 4096, 256
DEFAULT_SHAPE = (f"{DEFAULT_GLOBAL_BATCH} sequences x {DEFAULT_SEQ:,} tokens, the sequence at most the model's "
                 "max_seq, the batch rounded up to what the layout needs per step")
HF = "hf:"   # a --model naming a Hugging Face checkpoint's directory (jaxpar/serving/hf.py)
FIELDS = ("model", "hardware", "software", "devices", "seq", "global_batch", "hbm_headroom")


@dataclasses.dataclass(frozen=True, slots=True)
class Question:
    model: str          # a --model value: preset[:key=value,...], a TOML path or hf:DIR
    hardware: str       # a --hardware value: a profile name or a TOML path
    software: str       # a name in jaxpar.cost.software.SOFTWARE
    devices: int
    seq: int
    global_batch: int   # sequences per optimizer step
    hbm_headroom: float = HBM_HEADROOM

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq

    def header(self, model: ModelConfig, hw: Hardware) -> str:
        """Two lines: the question, and the memory a plan may use to count as fitting."""
        usable = (1.0 - self.hbm_headroom) * hw.hbm_bytes / 2**30
        return (f"question: {model.name} ({params.total_params(model) / 1e9:,.1f}B parameters) on {self.devices:,} x {hw.name}, "
                f"software {self.software}; seq {self.seq:,}, global batch {self.global_batch:,} sequences "
                f"= {self.tokens:,} tokens\n"
                f"fits: memory per device <= {1 - self.hbm_headroom:.0%} of {hw.hbm_bytes / 2**30:.1f} GiB HBM "
                f"= {usable:.1f} GiB (--hbm-headroom {self.hbm_headroom:g} keeps the rest for the runtime's own "
                f"buffers)")

    def to_toml(self, mesh_file: str) -> str:
        lines = [f"# jaxpar plan: the question behind {mesh_file}; `jaxpar estimate --run THIS_FILE` asks it again",
                 f'mesh = "{mesh_file}"']
        for name in FIELDS:
            value = getattr(self, name)
            lines.append(f"{name} = {value!r}" if not isinstance(value, str) else f'{name} = "{value}"')
        return "\n".join(lines) + "\n"


def default_seq(max_seq: int) -> int:
    """--seq when not given: DEFAULT_SEQ, cut to a model's `max_seq`."""
    return min(DEFAULT_SEQ, max_seq)


def default_batch(multiple: int = 1) -> int:
    """The global batch when not given: DEFAULT_GLOBAL_BATCH sequences, rounded up to a `multiple` (the
    sequences one step of a layout needs: one per data-parallel rank, accumulation step and micro-batch)."""
    return -(-DEFAULT_GLOBAL_BATCH // multiple) * multiple


def portable(spec: str) -> str:
    """A --model or --hardware value as the run file keeps it: an existing TOML path or hf:DIR made absolute."""
    if spec.startswith(HF) and pathlib.Path(spec[len(HF):]).is_dir():
        return HF + str(pathlib.Path(spec[len(HF):]).resolve())
    path = pathlib.Path(spec)
    return str(path.resolve()) if path.suffix == ".toml" and path.is_file() else spec


def written(question: Question) -> Question:
    """The question as a run file records it (paths made absolute: `portable`)."""
    return dataclasses.replace(question, model=portable(question.model), hardware=portable(question.hardware))


def read_run(path: str) -> tuple[Question, str]:
    """(the question, the mesh file's path) of a run file; ConfigError naming the field for a missing,
    unknown or mistyped one."""
    raw = read_toml(path, "run")
    known = {"mesh", *FIELDS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"run file {path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    missing = [k for k in ("mesh", *FIELDS[:-1]) if k not in raw]
    if missing:
        raise ConfigError(f"run file {path}: missing field(s) {', '.join(missing)}")
    text, whole, number = (str, "a string"), (int, "an integer"), ((int, float), "a number")
    types = {"model": text, "hardware": text, "software": text, "mesh": text, "devices": whole, "seq": whole,
             "global_batch": whole, "hbm_headroom": number}
    for key, value in raw.items():
        kind, name = types[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"run file {path}: {key} = {value!r} is not {name}")
    for key in ("devices", "seq", "global_batch"):
        if raw[key] < 1:
            raise ConfigError(f"run file {path}: {key} = {raw[key]} must be >= 1")
    if not 0 <= raw.get("hbm_headroom", 0) < 1:
        raise ConfigError(f"run file {path}: hbm_headroom = {raw['hbm_headroom']} must be in [0, 1)")
    mesh = pathlib.Path(raw.pop("mesh"))
    mesh = mesh if mesh.is_absolute() else pathlib.Path(path).parent / mesh
    return Question(**raw), str(mesh)
