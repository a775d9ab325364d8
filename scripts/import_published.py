"""Bring a file of published runs into the repository: split it into jaxpar/cost/published/ (jaxpar/cost/published.py).

Each `[[source]]` table becomes <id>.toml, its text as it arrived (a source without an `id` is given one from its
container and system, written as its first field), headed by the comment lines the file opened with (its
conventions). Its `[models.*]` tables join models.toml, its `[hardware]` table hardware.toml; index.toml lists
the file's sources under its name. Importing a file again replaces its collection; a model table that differs
from one already there, or a source id another collection holds, is refused in one line and nothing is written.

    python scripts/import_published.py ../shared/reference/published_runs_stacks.toml [...]
    python experiments/study_stacks.py --write-bands      # then the bands, from the data here
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIR = ROOT / "jaxpar/cost/published"
HEADER = re.compile(r"^\[\[source\]\]$|^\[models\.[A-Za-z0-9_]+\]$|^\[hardware\]$")


def blocks(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the opening comment lines, [(header, the block's lines without its header)]) of a file's text."""
    head, out = [], []
    for line in text.splitlines():
        if HEADER.match(line):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
        elif line.startswith("#"):
            head.append(line)
    return head, [(h, strip_blank(lines)) for h, lines in out]


def strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def source_id(table: dict, taken: set[str]) -> str:
    """The source's `id`, else one from its container and system (nemo_25_09_dgx_b200, then _2, _3 ...)."""
    if "id" in table:
        return table["id"]
    base = re.sub(r"[^a-z0-9]+", "_", f"{table.get('container', '')} {table.get('system', '')}".lower()).strip("_")
    n, name = 1, base
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def plan_import(path: pathlib.Path) -> tuple[str, dict[str, str], dict[str, list[str]], list[str]]:
    """(collection, {file name: text} of its sources, {model header: lines}, the [hardware] lines)."""
    collection = path.stem
    head, found = blocks(path.read_text())
    intro = [f"# Arrived in ../shared/reference/{path.name}, which opens:"] + head
    files, model_blocks, hw, taken = {}, {}, [], set()
    for header, lines in found:
        if header == "[[source]]":
            table = tomllib.loads("\n".join(lines))
            sid = source_id(table, taken)
            taken.add(sid)
            first = [] if "id" in table else [f'id = "{sid}"  # given on import (the source names none)']
            files[f"{sid}.toml"] = "\n".join(intro + ["", header] + first + lines) + "\n"
        elif header == "[hardware]":
            hw = lines
        else:
            model_blocks[header] = lines
    return collection, files, model_blocks, hw


def merged_models(text: str, new: dict[str, list[str]]) -> str:
    """models.toml's `text` with `new` added; a model already there with other fields is refused."""
    have = tomllib.loads(text).get("models", {})
    text = text.rstrip("\n")
    for header, lines in new.items():
        name = header[len("[models."):-1]
        table = tomllib.loads("\n".join(lines))
        if name in have:
            if have[name] != table:
                sys.exit(f"import_published: model {name} differs from the one in models.toml: nothing written")
            continue
        text += "\n\n" + "\n".join([header] + lines)
    return text + "\n"


def index_text(collections: dict[str, list[str]]) -> str:
    body = "".join(f"{name} = [{', '.join(repr(i).replace(chr(39), chr(34)) for i in ids)}]\n"
                   for name, ids in collections.items())
    return ("# Each collection's sources in the order they arrived (jaxpar/cost/published.py); written by\n"
            "# scripts/import_published.py.\n\n[collections]\n" + body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=pathlib.Path, help="TOML files of published runs ([[source]] tables)")
    p.add_argument("--into", type=pathlib.Path, default=DIR, help="the folder to write (default: %(default)s)")
    args = p.parse_args(argv)
    into = args.into
    index = into / "index.toml"
    known = {k: list(v) for k, v in tomllib.loads(index.read_text())["collections"].items()} if index.exists() else {}
    writes: dict[pathlib.Path, str] = {}
    for path in args.files:
        collection, files, model_blocks, hw = plan_import(path)
        ids = [name.removesuffix(".toml") for name in files]
        clash = [i for i in ids for c, held in known.items() if c != collection and i in held]
        if clash:
            sys.exit(f"import_published: source id {clash[0]} is already in another collection: nothing written")
        known[collection] = ids
        writes |= {into / name: text for name, text in files.items()}
        if model_blocks:
            models = into / "models.toml"
            now = writes.get(models) or (models.read_text() if models.exists() else
                                         "# The model shapes the published runs name (scripts/import_published.py).\n")
            writes[models] = merged_models(now, model_blocks)
        if hw:
            writes[into / "hardware.toml"] = "\n".join(["# Datasheet figures, as they arrived in "
                                                       f"../shared/reference/{path.name}.", "[hardware]"] + hw) + "\n"
        print(f"{path}: {len(files)} sources, {sum(len(tomllib.loads(t)['source'][0].get('rows', [])) for t in files.values())} "
              f"rows, {len(model_blocks)} models -> {collection}")
    writes[index] = index_text(known)
    into.mkdir(parents=True, exist_ok=True)
    for path, text in writes.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
