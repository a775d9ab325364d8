"""`jaxpar data`: text in, tokenized and packed shards out, with the manifest that describes them.

Input: plain text files (one document each), JSON lines (one document per line, its `text` field) and
Parquet files (one document per row of the `text` column, read through pyarrow); files or folders
(searched recursively for those suffixes). Output, written to a temporary directory beside DIR and
renamed to DIR at the end, so a failed run leaves nothing:

    DIR/manifest.json               what follows, and the sha256 of every shard (MANIFEST)
    DIR/tokenizer.json              the tokenizer (Hugging Face format)
    DIR/train-00000.u16.bin, ...    token ids, each document followed by the end-of-text id
    DIR/train-00000.idx.npy, ...    each document's end offset in its shard (int64), after its separator
    DIR/val-00000.u16.bin, ...      the validation split, the same way

Documents go to the validation split whole (a seeded choice of round(val_fraction * documents) of them,
at least one when val_fraction > 0), so no held-out text is seen in training. Ids are uint16 when the
vocabulary fits 65,536, else uint32, and the shard names say which (`.u16.bin` / `.u32.bin`). The
reader is jaxpar/training/loader.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from jaxpar.errors import ConfigError
from jaxpar.training import tokenizer as tokenizers

MANIFEST = "manifest.json"
FORMAT = "jaxpar-tokens/1"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
SHARD_TOKENS = 1 << 26  # a shard closes at the first document end past this many tokens
ENCODE_CHUNK = 512      # documents per encode_batch call (one progress-bar tick)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` wrote, for its report."""
    path: str
    manifest: dict
    seconds: float


def input_files(paths: list[str]) -> list[pathlib.Path]:
    """The files named, and those under the folders named with a known suffix (sorted, hidden skipped)."""
    files = []
    for name in paths:
        p = pathlib.Path(name)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise ConfigError(f"--input {name}: an empty folder (no {'/'.join(SUFFIXES)} files in it)")
            files += found
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise ConfigError(f"--input {name}: not a regular file or folder")
        else:
            raise ConfigError(f"--input {name}: no such file or folder")
    return files


def read_text(path: pathlib.Path) -> str:
    """A file's text, refused when unreadable or binary (a NUL byte, or not UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--input {path}: unreadable ({e.strerror})") from None
    if b"\0" in data[:65536]:
        raise ConfigError(f"--input {path}: a binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--input {path}: not UTF-8 text (byte {e.start}): a binary file?") from None


def documents(path: pathlib.Path, field: str) -> list[str]:
    """The documents of one input file (`field`: the JSON lines' and the Parquet column's text field)."""
    if path.suffix in PARQUET_SUFFIXES:
        try:
            table = pq.read_table(path)
        except OSError as e:
            raise ConfigError(f"--input {path}: unreadable as Parquet ({str(e).splitlines()[0]})") from None
        if field not in table.column_names:
            raise ConfigError(f"--input {path}: no '{field}' column (columns: {', '.join(table.column_names)})")
        column = table.column(field).to_pylist()
        bad = next((i for i, t in enumerate(column) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            raise ConfigError(f"--input {path} row {bad}: the '{field}' column holds {type(column[bad]).__name__}, "
                              "not text")
        return [t for t in column if t]
    text = read_text(path)
    if path.suffix not in JSONL_SUFFIXES:
        return [text] if text else []
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--input {path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ConfigError(f"--input {path} line {n}: no '{field}' string field (JSON lines need one per line)")
        if record[field]:
            docs.append(record[field])
    return docs


def split_documents(count: int, val_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the documents held out for validation."""
    n_val = 0 if val_fraction == 0 else max(1, round(val_fraction * count))
    if n_val >= count:
        raise ConfigError(f"--val-fraction {val_fraction} of {count} documents leaves none to train on")
    held = np.zeros(count, bool)
    held[np.random.default_rng(seed).permutation(count)[:n_val]] = True
    return held


def write_split(out: pathlib.Path, name: str, ids: list[list[int]], eot: int, dtype) -> dict:
    """Shards of one split: each document's ids then the end-of-text id; returns the split's manifest."""
    suffix = {np.uint16: "u16", np.uint32: "u32"}[dtype]
    shards, start = [], 0
    while start < len(ids):
        stop, tokens = start, 0
        while stop < len(ids) and (stop == start or tokens < SHARD_TOKENS):
            tokens += len(ids[stop]) + 1
            stop += 1
        docs = ids[start:stop]
        ends = np.cumsum([len(d) + 1 for d in docs], dtype=np.int64)
        flat = np.empty(int(ends[-1]), dtype)
        for d, end in zip(docs, ends):
            flat[end - len(d) - 1:end - 1] = d
            flat[end - 1] = eot
        stem = f"{name}-{len(shards):05d}"
        flat.tofile(out / f"{stem}.{suffix}.bin")
        np.save(out / f"{stem}.idx.npy", ends)
        shards.append({"path": f"{stem}.{suffix}.bin", "index": f"{stem}.idx.npy", "documents": len(docs),
                       "tokens": int(ends[-1]), "sha256": sha256(out / f"{stem}.{suffix}.bin")})
        start = stop
    return {"documents": len(ids), "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def encode_all(tok: tokenizers.Tokenizer, docs: list[str], progress: bool) -> list[list[int]]:
    """Every document's ids, ENCODE_CHUNK documents per parallel `encode_batch` call, with a progress bar."""
    ids = []
    with tqdm(total=len(docs), unit="doc", desc="tokenizing", disable=not progress) as bar:
        for i in range(0, len(docs), ENCODE_CHUNK):
            ids += tok.encode_batch(docs[i:i + ENCODE_CHUNK])
            bar.update(min(ENCODE_CHUNK, len(docs) - i))
    return ids


def prepare(inputs: list[str], output: str, *, tokenizer: str | None = None, vocab: int | None = None,
            val_fraction: float = 0.05, field: str = "text", seed: int = 0, progress: bool = True) -> Prepared:
    """Read, tokenize, split and pack `inputs` into `output` (see the module docstring)."""
    began = time.perf_counter()
    out = pathlib.Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not an empty folder: choose a new one")
    files = input_files(inputs)
    docs = []
    for f in tqdm(files, unit="file", desc="reading", disable=not progress):
        docs += documents(f, field)
    if not docs:
        raise ConfigError(f"--input {' '.join(inputs)}: no text (every file is empty)")
    held = split_documents(len(docs), val_fraction, seed)
    tok = tokenizers.load(tokenizer) if tokenizer is not None else tokenizers.train(docs, vocab)
    ids = encode_all(tok, docs, progress)
    dtype = np.uint16 if tok.vocab <= 65536 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tok.save(tmp / "tokenizer.json")
        manifest = {"format": FORMAT, "tokenizer": "tokenizer.json", "tokenizer_source": tok.source,
                    "vocab": tok.vocab, "eot": tok.eot, "eot_token": tok.eot_token,
                    "dtype": np.dtype(dtype).name, "val_fraction": val_fraction, "seed": seed,
                    "inputs": [str(f) for f in files],
                    "splits": {"train": write_split(tmp, "train", [d for d, h in zip(ids, held) if not h], tok.eot, dtype),
                               "val": write_split(tmp, "val", [d for d, h in zip(ids, held) if h], tok.eot, dtype)}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(str(out), manifest, time.perf_counter() - began)
