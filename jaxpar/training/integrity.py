"""Checksums of checkpointed arrays (written with every save, verified at every restore), and errors
about damaged checkpoints that name the step, the array and, where it can be told, the file.

Scheme: each array is hashed per slice of the layout it was saved under: for every distinct slice of
the global array that some device holds (`sharding.devices_indices_map`), the CRC-32 of the slice's
bytes in C order, keyed "start:stop,..." (one range per dimension; "" for a scalar). The copy with
replica_id 0 is hashed by the process that holds it. In a multi-process run the processes' values are
combined by one small all-gather per save, so process 0 (which writes the `meta` item) has every
slice's checksum. They are stored in the checkpoint's `meta` item, inside the same step directory as
the arrays, which orbax renames into place only when the whole save is complete.

Verification, onto any mesh:
  - one process (it holds every array whole): each saved slice is cut from the restored array and
    hashed, so every byte is checked whatever the new layout;
  - several processes: each checks the restored shards whose slice equals a saved slice (all of them
    when the layout is unchanged; after resharding, slices that match no saved one are not checked),
    and the processes agree on the outcome, so all of them stop together.
A checkpoint that carries no checksums restores with a note that it was not verified.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
import zlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.errors import ConfigError


class DamagedCheckpoint(ConfigError):
    """A checkpoint whose files cannot be read or whose arrays do not match their checksums."""


def slice_key(index: tuple, shape: tuple) -> str:
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape))


def _slices(key: str) -> tuple:
    return tuple(slice(*map(int, r.split(":"))) for r in key.split(",")) if key else ()


def crc(x) -> int:
    x = np.ascontiguousarray(np.asarray(x))
    return zlib.crc32(x.reshape(-1).view(np.uint8))


def _layout(x) -> list[str]:
    if not isinstance(x, jax.Array):
        return [slice_key((slice(None),) * np.ndim(x), np.shape(x))]
    return sorted({slice_key(i, x.shape) for i in x.sharding.devices_indices_map(x.shape).values()})


def checksums(flat: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{state key: {slice key: crc32}} of every array, the same in every process."""
    layouts = {key: _layout(x) for key, x in flat.items()}
    values = []
    for key, x in flat.items():
        v = np.zeros(len(layouts[key]), np.uint32)
        if not isinstance(x, jax.Array):
            v[0] = crc(x)
        else:
            where = {s: n for n, s in enumerate(layouts[key])}
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    v[where[slice_key(shard.index, x.shape)]] = crc(shard.data)
        values.append(v)
    joined = np.concatenate(values) if values else np.zeros(0, np.uint32)
    if jax.process_count() > 1:  # each slice has one owner; the others contribute 0
        gathered = np.asarray(multihost_utils.process_allgather(joined.view(np.int32)))
        joined = np.bitwise_or.reduce(gathered.view(np.uint32), axis=0)
    out, at = {}, 0
    for key, slices in layouts.items():
        out[key] = {s: int(c) for s, c in zip(slices, joined[at:at + len(slices)])}
        at += len(slices)
    return out


def _mismatch(key: str, x, saved: dict[str, int]) -> str | None:
    """Why array `key` does not match its saved checksums, or None."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        host = np.asarray(x)
        pieces = ((s, host[_slices(s)]) for s in saved)
    else:
        pieces = ((k, sh.data) for sh in x.addressable_shards
                  if sh.replica_id == 0 and (k := slice_key(sh.index, x.shape)) in saved)
    for s, piece in pieces:
        got = crc(piece)
        if got != saved[s]:
            where = f" (slice [{s}])" if s and len(saved) > 1 else ""
            return (f"array {key}{where} does not match the checksum written with it: "
                    f"crc32 {saved[s]:#010x} saved, {got:#010x} read")
    return None


def verify(flat: dict[str, Any], saved: dict[str, dict[str, int]], where: str) -> None:
    """Raise DamagedCheckpoint if a restored array differs from what was saved (in every process, if any
    process finds a difference). `where` is "checkpoint step N in DIR"."""
    keys = list(flat)
    bad, why = -1, ""
    for n, key in enumerate(keys):
        if key not in saved:
            bad, why = n, f"array {key} has no checksum in the checkpoint's metadata (damaged metadata?)"
            break
        if (why := _mismatch(key, flat[key], saved[key])) is not None:
            bad = n
            break
    if jax.process_count() > 1:
        found = np.asarray(multihost_utils.process_allgather(np.int32(bad))).reshape(-1)
        if bad < 0 and (found >= 0).any():
            first = int(found[found >= 0].min())
            bad, why = first, f"array {keys[first]} does not match the checksum written with it (found by another process)"
    if bad >= 0:
        raise DamagedCheckpoint(f"{where} is damaged: {why}")


# ---- the `meta` item -----------------------------------------------------------------------------

META_TYPES = {"step": int, "seed": int, "model": dict, "strategy": str, "devices": int, "checksums": dict,
              "data": str}
_KIND = {int: "an integer", str: "a string", dict: "a table"}


def check_meta(meta: Any, where: str) -> dict:
    """The `meta` item read back (JSON): a table whose known items have the types a save writes, and
    checksums of the form {array: {slice: crc32}}; DamagedCheckpoint naming the first item that is not
    (`where`: "checkpoint step N in DIR")."""
    def damaged(item: str, value: Any, kind: type) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{where} is damaged: its metadata {item} is {type(value).__name__} "
                                 f"{shorten(repr(value), 60)}, not {_KIND[kind]}")

    if not isinstance(meta, dict):
        raise damaged("item", meta, dict)
    for key, kind in META_TYPES.items():
        if key in meta and (isinstance(meta[key], bool) or not isinstance(meta[key], kind)):
            raise damaged(repr(key), meta[key], kind)
    for key, sums in meta.get("checksums", {}).items():
        if not isinstance(sums, dict):
            raise damaged(f"checksums of {key}", sums, dict)
        for slice_, value in sums.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise damaged(f"checksum of {key} [{slice_}]", value, int)
    return meta


# ---- errors from orbax / TensorStore -------------------------------------------------------------

def shorten(text: str, limit: int = 300) -> str:
    """`text` on one line, at most about `limit` characters, cut only between words."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit + 1].rsplit(" ", 1)[0].rstrip(",;:(")
    return f"{cut} [...]"


def _chain(e: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 20:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


class _UnretrievedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records of orbax's coroutines: when one array
    of a restore (or a save) fails, orbax abandons its sibling reads (writes), whose errors asyncio logs
    when they are collected (each with TensorStore's whole spec: a page), after jaxpar's one line
    (`read_error`, SaveFailed) has named the first."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Task exception was never retrieved") and f"{os.sep}orbax{os.sep}" in text)


UNRETRIEVED_READS = _UnretrievedReads()


def quiet_failed_reads() -> None:
    """Leave a failed restore's report to its one line (`read_error`); idempotent."""
    log = logging.getLogger("asyncio")
    if UNRETRIEVED_READS not in log.filters:
        log.addFilter(UNRETRIEVED_READS)


def read_error(e: BaseException, keys, step_dir: pathlib.Path) -> str:
    """What went wrong reading a checkpoint, in one line: the array it was reading (TensorStore names
    it as the key of its OCDBT database), the innermost error shortened at a word boundary, and the
    file, where the error gives its size and one file under `step_dir` has that size (a truncated file)."""
    chain = _chain(e)
    text = "\n".join(str(x) for x in chain)
    named = [k for k in keys if any(f"{q}{form}/" in text for q in "\"'"
                                    for form in (k.replace("'", "\\'"), k))]
    innermost = chain[-1]
    first_line = next((line for line in str(innermost).splitlines() if line.strip()), "")
    parts = [f"array {max(named, key=len)} cannot be read" if named else "an array cannot be read",
             f"{type(innermost).__name__}: {shorten(first_line)}"]
    if m := re.search(r"for value of size (\d+)", text):
        size = int(m.group(1))
        files = [p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size == size]
        if len(files) == 1:
            parts.append(f"file {files[0]} ({size} bytes) is shorter than the checkpoint's index says: truncated?")
    return "; ".join(parts)
