"""Training data: a synthetic stream with learnable structure, memory-mapped raw token files, and
(through jaxpar/training/loader.py) text prepared by `jaxpar data`.

Each is a deterministic function of (seed, step, row): a process asks only for the rows it feeds
(`rows`), so no process reads another's slice, and a resumed run sees exactly the batches it would
have seen. `process_indices` says which rows (and sequence span) a process feeds; `to_global` turns
them into global jax.Arrays with the batch sharding.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.core.inputs import check_readable_file
from jaxpar.training import corpus, loader


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """Token t+1 = (a * token_t + c) mod vocab, except a `noise` fraction drawn at random.

    A model that learns the bigram rule reaches a loss near noise * ln(vocab), far below the
    ln(vocab) it starts from, so "the loss falls" is a meaningful check.
    """
    vocab: int
    seed: int = 0
    noise: float = 0.1

    def rows(self, step: int, rows, seq: int) -> np.ndarray:
        out = np.empty((len(rows), seq + 1), np.int32)
        a, c = 5, 3
        for i, row in enumerate(rows):
            rng = np.random.default_rng((self.seed, step, int(row)))
            toks = np.empty(seq + 1, np.int64)
            toks[0] = rng.integers(self.vocab)
            noise = rng.random(seq) < self.noise
            rand = rng.integers(self.vocab, size=seq)
            for t in range(seq):
                toks[t + 1] = rand[t] if noise[t] else (a * toks[t] + c) % self.vocab
            out[i] = toks
        return out


WIDTHS = {".u16.bin": np.uint16, ".u32.bin": np.uint32}


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A flat file of token ids (nanoGPT's format), memory-mapped; its name states the ids' width
    (`tokens.u16.bin`, `tokens.u32.bin`), never guessed from the model's vocabulary.

    Row `r` of step `k` is the window starting at a pseudo-random offset drawn from (seed, k, r).
    """
    path: str
    vocab: int
    seed: int = 0

    def __post_init__(self):
        size = check_readable_file(self.path, "--data").stat().st_size
        if size == 0:
            raise ConfigError(f"--data {self.path} is empty: it holds no token ids")
        if size % 2:
            raise ConfigError(f"--data {self.path}: {size} bytes is not a whole number of uint16 or uint32 ids")
        if self.dtype is None:
            raise ConfigError(f"--data {self.path} does not state its token width: name it *.u16.bin or *.u32.bin "
                              "(or prepare text with `jaxpar data`, whose manifest states it)")
        if size % np.dtype(self.dtype).itemsize:
            raise ConfigError(f"--data {self.path}: {size} bytes is not a whole number of "
                              f"{np.dtype(self.dtype).name} ids")

    @property
    def dtype(self):
        return next((dt for suffix, dt in WIDTHS.items() if self.path.endswith(suffix)), None)

    @property
    def tokens(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    def rows(self, step: int, rows, seq: int) -> np.ndarray:
        toks = self.tokens
        if len(toks) < seq + 1:
            raise ConfigError(f"--data {self.path}: {len(toks)} tokens, fewer than seq+1={seq + 1}")
        out = np.empty((len(rows), seq + 1), np.int32)
        for i, row in enumerate(rows):
            start = np.random.default_rng((self.seed, step, int(row))).integers(len(toks) - seq)
            out[i] = toks[start:start + seq + 1]
            if (bad := np.flatnonzero(out[i] >= self.vocab)).size:
                raise ConfigError(f"--data {self.path}: token id {out[i, bad[0]]} at position {start + bad[0]} "
                                  f"is not below the model's vocab={self.vocab}")
        return out


def make_source(spec: str, vocab: int, seed: int, batch: int = 1):
    """The training rows `--data` names: 'synthetic', a `jaxpar data` directory (its train split, in
    Grain's shuffled order of `batch`-row steps: jaxpar/training/loader.py) or a raw token file."""
    if spec == "synthetic":
        return Synthetic(vocab, seed)
    if os.path.isdir(spec) or os.path.basename(spec) == corpus.MANIFEST:
        return loader.PreparedSource(loader.Dataset(spec, vocab), "train", seed, batch)
    return TokenFile(spec, vocab, seed)


def local_batch(source, step: int, rows, seq: int, order: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """inputs, labels, positions for `rows` (a sequence of row numbers) of the global batch, tokens laid out in `order`
    (a permutation of range(seq), e.g. zigzag for context parallelism; positions travel along)."""
    toks = source.rows(step, rows, seq)
    batch = {
        "inputs": toks[:, :-1],
        "labels": toks[:, 1:],
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (len(rows), seq)),
    }
    if getattr(source, "document_mask", False):  # attention within documents (jaxpar/training/loader.py)
        batch["segments"], batch["positions"] = loader.document_layout(batch["inputs"], source.data.eot)
    if order is not None:
        batch = {k: v[:, order] for k, v in batch.items()}
    return {k: np.ascontiguousarray(v) for k, v in batch.items()}


def process_indices(sharding, shape: tuple[int, ...], process: int | None = None,
                    process_of=lambda device: device.process_index) -> tuple[np.ndarray, ...]:
    """Per dimension, the sorted global indices that `process`'s devices hold under `sharding`.

    Each process feeds exactly these rows (and, under context parallelism across hosts, these
    sequence positions), no more: rows held by no device of the process are never read by it; rows
    replicated over processes (tensor parallelism across hosts) are read by each of them. The spans
    need not be contiguous (fsdp across hosts with data inside: rows 0-3 and 8-11 on host 0);
    `jax.make_array_from_process_local_data` maps them, in order, onto the local array.
    `process_of(device)` names a device's process (tests pass a stand-in to play several processes).
    """
    process = jax.process_index() if process is None else process
    blocks = [idx for d, idx in sharding.devices_indices_map(shape).items() if process_of(d) == process]
    if not blocks:
        raise ConfigError(f"process {process} holds no device of the batch sharding")
    return tuple(np.unique(np.concatenate([np.arange(n)[b[dim]] for b in blocks])) for dim, n in enumerate(shape))


def to_global(local: dict[str, np.ndarray], sharding, shape: tuple[int, int]) -> dict[str, jax.Array]:
    """Global arrays from this process's part (`process_indices`) of each batch field."""
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}
