"""Reading `jaxpar data` output (jaxpar/training/corpus.py) for training and evaluation, through Grain.

A split's shards are cut into packed sequences: sequence j of a shard is its tokens
[j * seq, j * seq + seq + 1) (inputs and the labels one token on), documents running across sequence
boundaries with the end-of-text id between them, as GPT-2 and nanoGPT pack. `PackedSequences` is a
random-access source over them (`__len__` and `__getitem__`, Grain's `RandomAccessDataSource`
protocol) and the training order is Grain's `MapDataset.source(...).shuffle(seed).repeat()`: a
deterministic permutation per epoch (Grain folds the epoch into the seed), indexed directly.
Row r of step k is element k * batch + r of that dataset, so a batch is a pure function of (seed,
step, row): each process reads only the rows its devices hold (jaxpar/training/data.py
`process_indices`) and a resumed run, on any mesh or process count, reads exactly the batches the
uninterrupted run would have. Grain's DataLoader (an iterator with its own checkpointable state and
worker processes) is not used: indexing the MapDataset by step keeps resume as "go to step N", with
nothing saved but the step, and the reads are memory-mapped slices, far faster than a step.
"""
from __future__ import annotations

import functools
import json
import pathlib

import grain
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.training import corpus


class PackedSequences:
    """The split's shards as `seq + 1`-token sequences, a random-access source (int32 rows)."""

    def __init__(self, shards: list[np.ndarray], seq: int):
        self.shards, self.seq = shards, seq
        self.ends = np.cumsum([(len(s) - 1) // seq if len(s) > seq else 0 for s in shards])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self.ends, i, side="right"))
        j = i - (int(self.ends[shard - 1]) if shard else 0)
        return np.asarray(self.shards[shard][j * self.seq:j * self.seq + self.seq + 1], np.int32)


class Dataset:
    """A prepared directory: its manifest, checked against the files and the model, and its shards."""

    def __init__(self, path: str, vocab: int, verify: bool = True):
        root = pathlib.Path(path)
        root = root.parent if root.name == corpus.MANIFEST else root
        file = root / corpus.MANIFEST
        if not file.is_file():
            raise ConfigError(f"--data {path} is a directory without {corpus.MANIFEST}: not prepared data (make "
                              "it with `jaxpar data`)")
        try:
            self.manifest = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--data {file}: not a JSON manifest ({e})") from None
        if self.manifest.get("format") != corpus.FORMAT:
            raise ConfigError(f"--data {file}: format {self.manifest.get('format')!r}, expected {corpus.FORMAT!r}")
        self.root, self.dtype = root, np.dtype(self.manifest["dtype"])
        if self.manifest["vocab"] > vocab:
            raise ConfigError(f"--data {file}: the tokenizer's vocabulary ({self.manifest['vocab']} ids) exceeds "
                              f"the model's vocab={vocab}")
        for split in self.manifest["splits"].values():
            for shard in split["shards"]:
                self.check_shard(shard, verify)

    def check_shard(self, shard: dict, verify: bool) -> None:
        """A shard exists, holds the manifest's token count and (`verify`) matches its sha256."""
        f = self.root / shard["path"]
        if not f.is_file():
            raise ConfigError(f"--data {f}: a shard the manifest lists is missing")
        if f.stat().st_size != shard["tokens"] * self.dtype.itemsize:
            raise ConfigError(f"--data {f}: {f.stat().st_size} bytes, but the manifest says {shard['tokens']} "
                              f"{self.dtype.name} ids")
        if verify and corpus.sha256(f) != shard["sha256"]:
            raise ConfigError(f"--data {f}: sha256 does not match the manifest's (the shard changed or is damaged)")

    @property
    def eot(self) -> int:
        return self.manifest["eot"]

    @property
    def tokenizer_path(self) -> pathlib.Path:
        return self.root / self.manifest["tokenizer"]

    def shards(self, split: str) -> list[np.ndarray]:
        return [np.memmap(self.root / s["path"], dtype=self.dtype, mode="r")
                for s in self.manifest["splits"][split]["shards"]]

    def tokens(self, split: str) -> int:
        return self.manifest["splits"][split]["tokens"]


class PreparedSource:
    """Rows of a split, as `jaxpar.training.data.local_batch` asks for them: row r of step k is sequence
    k * batch + r of the shuffled, repeated order (`shuffle=False`: of the split's own order, for
    evaluation, so every evaluation reads the same held-out batches)."""

    def __init__(self, data: Dataset, split: str, seed: int, batch: int, shuffle: bool = True):
        self.data, self.split, self.seed, self.batch, self.shuffle = data, split, seed, batch, shuffle
        self.document_mask = False  # True: batches carry segment ids and per-document positions

    @functools.cache
    def dataset(self, seq: int) -> grain.MapDataset:
        source = PackedSequences(self.data.shards(self.split), seq)
        if not len(source):
            raise ConfigError(f"--data {self.data.root}: the {self.split} split holds {self.data.tokens(self.split)} "
                              f"tokens, too few for one sequence of seq+1={seq + 1}")
        ds = grain.MapDataset.source(source)
        return (ds.shuffle(seed=self.seed) if self.shuffle else ds).repeat()

    def rows(self, step: int, rows, seq: int) -> np.ndarray:
        ds = self.dataset(seq)
        return np.stack([ds[step * self.batch + int(r)] for r in rows])


def document_layout(tokens: np.ndarray, eot: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, positions) of packed `tokens` [rows, seq]: a new segment begins after each
    end-of-text id (the separator belongs to the document it ends) and positions restart at 0 in it,
    so that each document is seen as if it were alone."""
    ends = tokens == eot
    segments = np.cumsum(ends, axis=1, dtype=np.int32) - ends
    idx = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    first = np.concatenate([np.ones((tokens.shape[0], 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    starts = np.maximum.accumulate(np.where(first, idx, 0), axis=1)
    return segments, (idx - starts).astype(np.int32)
