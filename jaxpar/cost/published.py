"""The published runs the cost model is calibrated and banded on, kept in the repository.

jaxpar/cost/published/ holds one TOML file per source: its `[[source]]` table as it arrived (id, title or
system and container, url, provenance, hardware, flops_convention, notes, columns, rows), the model shapes
its rows name (models.toml) and the datasheet table the hardware profiles were first written from
(hardware.toml). index.toml lists each collection's sources in order: a collection is the file of
../shared/reference/ they arrived in (published_runs_stacks, published_runs_blackwell, ...), which is where
new rows arrive and nothing here reads. To bring a file in, split it into this folder:

    python scripts/import_published.py ../shared/reference/published_runs_blackwell.toml

and regenerate the error bands from the data here: `python experiments/study_stacks.py --write-bands`.
"""
from __future__ import annotations

import functools
import pathlib
import tomllib

DIR = pathlib.Path(__file__).resolve().parent / "published"
INDEX = DIR / "index.toml"


@functools.cache
def collections() -> dict[str, tuple[str, ...]]:
    """{collection: its source ids, in the order they arrived}."""
    return {name: tuple(ids) for name, ids in tomllib.loads(INDEX.read_text())["collections"].items()}


@functools.cache
def source(source_id: str) -> dict:
    """One source's table (jaxpar/cost/published/<id>.toml)."""
    (table,) = tomllib.loads((DIR / f"{source_id}.toml").read_text())["source"]
    return table


@functools.cache
def models() -> dict[str, dict]:
    """{model name: its shape table}: the models the sources' rows name."""
    return tomllib.loads((DIR / "models.toml").read_text())["models"]


@functools.cache
def hardware() -> dict[str, dict]:
    """The datasheet table ([hardware]) the profiles of jaxpar/cost/hardware/ were first written from."""
    return tomllib.loads((DIR / "hardware.toml").read_text())["hardware"]


def load(collection: str) -> dict:
    """A collection as its file in ../shared/reference/ read: {"source": [...], "models": ..., "hardware": ...}."""
    known = collections()
    if collection not in known:
        raise KeyError(f"no published collection {collection!r}; known: {', '.join(known)}")
    return {"source": [source(i) for i in known[collection]], "models": models(), "hardware": hardware()}
