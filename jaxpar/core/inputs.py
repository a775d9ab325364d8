"""The one validation layer for what comes in from outside: command-line values, config files, paths.

Every failure is a ConfigError with one line naming the field, the value and the constraint, raised
before anything compiles or trains. What is checked where:
  - command-line numbers and paths: the parser's argument types below (jaxpar/cli/main.py), and
    `check_outputs` for the files a command will write, before it runs;
  - TOML files (mesh, model, hardware): `read_toml` (unreadable, not UTF-8, not TOML, not a table)
    and `table` / `number` for the shape and type of each value;
  - model fields: `ModelConfig.validate`; strategy options: `jaxpar.core.strategy.make_options`;
    combinations of model, strategy and batch: jaxpar/core/validate.py;
  - what this host can hold: `check_host_memory`, and jaxpar/devices.py for simulated devices.
A name that is not known (a flag, a model field or preset, a mesh axis, a hardware profile) is answered
with the near matches `did_you_mean` finds, the one place suggestions are made.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import pathlib
import re
import tomllib
from typing import Any

from jaxpar.errors import ConfigError

MAX_SEED = 2**31 - 1
MAX_CLUSTER_DEVICES = 2**20  # no cluster has more; the planner's search is sized for this
MAX_GLOBAL_BATCH = 2**24  # sequences per optimizer step: 16,777,216, thousands of times any published run's


def did_you_mean(word: str, known, strip: str = "") -> str:
    """' (did you mean 'layers'?)' for the entries of `known` close to `word` (difflib's similarity ratio
    >= 0.65, which keeps `stpes` -> steps and drops `stpes` -> dtype; at most three), or '' when none is:
    the suffix every unknown-name error appends. `strip` is left off both sides before comparing (the
    dashes of a flag)."""
    names = {str(k).lstrip(strip): str(k) for k in known}
    close = difflib.get_close_matches(word.lstrip(strip), names, n=3, cutoff=0.65)
    return f" (did you mean {' or '.join(repr(names[c]) for c in close)}?)" if close else ""


# ---- numbers written as text ---------------------------------------------------------------------

_INTEGER = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)


def parse_int(text: str) -> int:
    """An integer written in ASCII digits with an optional sign (surrounding spaces allowed): the one
    parser of integers from text (flags, inline mesh specs, model overrides, step ranges, token ids).
    Python's int() also takes `0_8` and other scripts' digits (`٨`), which no config means: ValueError."""
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


def parse_real(text: str) -> float:
    """A number written in ASCII (digits, one point, an exponent; nan and inf, refused by the checks
    that need a finite value): as `parse_int`, float() alone would take `1_0.5` and `١.٥`."""
    if not _REAL.fullmatch(text.strip()):
        raise ValueError(f"{text!r} is not a number")
    return float(text)


# ---- command-line argument types (argparse names the flag in its one-line error) ----------------

def _argument_type(kind: str, convert, lo, hi, open_lo: bool = False):
    """An argparse type: `convert(text)`, finite, in [lo, hi] ((lo, hi] if open_lo). argparse names the
    flag in its error and reads the type's __name__ (tests/test_fuzz.py finds the number flags by it)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            article = "an" if kind == "integer" else "a"
            raise argparse.ArgumentTypeError(f"{text!r} is not {article} {kind}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if lo is not None and (value <= lo if open_lo else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if open_lo else '>='} {lo}, got {value}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {value}")
        return value
    parse.__name__ = kind
    return parse


def integer(lo: int | None = None, hi: int | None = None):
    """An argparse type: an integer in [lo, hi]."""
    return _argument_type("integer", parse_int, lo, hi)


def real(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False):
    """An argparse type: a finite float in [lo, hi] ((lo, hi] if open_lo)."""
    return _argument_type("number", parse_real, lo, hi, open_lo)


POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
SEED = integer(0, MAX_SEED)


def nonempty(text: str) -> str:
    """An argparse type: a non-empty string (an empty path would silently mean 'none')."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def step_range(text: str) -> tuple[int, int]:
    """An argparse type: steps A-B (or one step A), counted from 1, inclusive (checked against the
    run's steps by the train command, which knows them)."""
    first, dash, last = text.partition("-")
    try:
        a, b = parse_int(first), parse_int(last) if dash else parse_int(first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step range A-B (e.g. 2-4)") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r} must be A-B with 1 <= A <= B")
    return a, b


def png_path(text: str) -> str:
    """An argparse type: a .png file to write (matplotlib would append .png to any other name)."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a .png file name")
    return text


def token_ids(text: str) -> list[int]:
    """An argparse type: one prompt as comma-separated token ids (`1,2,3`), at least one, each >= 0
    (their range against the model's vocabulary is checked by jaxpar.core.validate.check_generate)."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty prompt: give at least one token id, e.g. 1,2,3")
    try:
        ids = [parse_int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integer token ids") from None
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {min(ids)}")
    return ids


def read_prompt_file(path: str) -> list[list[int]]:
    """Prompts from a UTF-8 text file, one per line, token ids separated by commas or spaces; blank
    lines are skipped. ConfigError naming the line for anything else, or for a file with no prompt."""
    p = check_readable_file(path, "--prompt-file")
    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read --prompt-file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt-file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append(token_ids(",".join(line.replace(",", " ").split())))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"--prompt-file {path}, line {n}: {e}") from None
    if not prompts:
        raise ConfigError(f"--prompt-file {path} holds no prompt (one line of token ids per prompt)")
    return prompts


# ---- paths ---------------------------------------------------------------------------------------

def check_writable(path: str, what: str, *, directory: bool = False) -> None:
    """`path` (a file, or a directory to create or fill) can be written: its nearest existing ancestor
    is a writable directory, and nothing of the other kind is in the way."""
    p = pathlib.Path(path)
    if directory:
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{what} {path} exists and is not a directory")
    elif p.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file")
    parent = p if directory and p.exists() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} cannot be written: {parent} is not writable")


# flag -> (what it writes is a directory); checked by `check_outputs` before a command runs
OUTPUTS = {"metrics": False, "json": False, "plot": False, "figure": False, "profile": True, "tensorboard": True}


def check_outputs(args: argparse.Namespace) -> None:
    for name, directory in OUTPUTS.items():
        path = getattr(args, name, None)
        if path is not None:
            check_writable(path, "--" + name, directory=directory)


def check_readable_file(path: str, what: str) -> pathlib.Path:
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError(f"{what} {path}: no such file")
    if p.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file")
    if not p.is_file():
        raise ConfigError(f"{what} {path} is not a regular file (a FIFO, socket or device cannot be read as one)")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{what} {path}: permission denied")
    return p


# ---- TOML files ----------------------------------------------------------------------------------

def read_toml(path: str | pathlib.Path, what: str) -> dict[str, Any]:
    """A TOML file's top-level table; ConfigError for a file that is missing, unreadable, not UTF-8
    or not TOML."""
    p = check_readable_file(str(path), f"{what} file")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_toml(text, f"{what} file {path}")


def parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None


def table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """data[key] as a table ({} if absent); ConfigError if it is a scalar, string or array."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table of key = value lines, got {type(value).__name__} "
                          f"{value!r}")
    return value


def number(value: Any, key: str, where: str, *, integer_only: bool = False, positive: bool = False,
           lo: float | None = None, hi: float | None = None) -> float | int:
    """A TOML number: the right type (never a bool), finite, in range."""
    kinds = (int,) if integer_only else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"{where}: {key}={value!r} must be {'an integer' if integer_only else 'a number'}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key}={value!r} must be finite")
    if positive and not value > 0:
        raise ConfigError(f"{where}: {key}={value!r} must be positive")
    if lo is not None and value < lo:
        raise ConfigError(f"{where}: {key}={value!r} must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}: {key}={value!r} must be <= {hi}")
    return value


# ---- this host -----------------------------------------------------------------------------------

def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not POSIX
        return 0


def check_host_memory(need: float, what: str) -> None:
    """Refuse, before allocating, what cannot fit in this host's memory (simulated CPU devices all
    share it)."""
    have = host_memory_bytes()
    if have and need > have:
        raise ConfigError(f"{what} needs at least {need / 2**30:.1f} GiB, more than this host's "
                          f"{have / 2**30:.1f} GiB of memory")
