"""The files behind `TokenizedDataModule`'s token stream: token arrays other tools wrote (nanoGPT's ``.bin``,
numpy's ``.npy``), mapped and scanned without being read whole; the writer that tokenizes documents and copies arrays
into one cache file; and the cache read back (its description, and each split's tokens mapped from it)."""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.errors import DataError

CACHE_FORMAT = 1
"""Part of every cache name: raised when the cache layout or the way documents are joined changes, so an older
cache is never read as a newer one."""

PRETOKENIZED = (".bin", ".npy")
"""Suffixes of token arrays taken as they are: ``.bin`` raw uint16 ids (nanoGPT's ``train.bin``), ``.npy`` a 1-D
integer array."""

SCAN_CHUNK = 1 << 24
"""Token ids read at a time when scanning or copying an array, so a memmap is never loaded whole."""

DOCUMENTS_PER_BATCH = 1024
CHARACTERS_PER_BATCH = 1 << 24
"""Documents are handed to the tokenizer in batches (it encodes a batch on several threads), flushed at whichever
bound comes first: memory stays bounded by one batch, whatever the corpus size."""


def max_token_id(tokens: np.ndarray, chunk: int = SCAN_CHUNK) -> int:
    """The largest id in ``tokens`` (-1 when empty), read ``chunk`` ids at a time so a memmap stays on disk."""
    return max((int(tokens[start : start + chunk].max()) for start in range(0, len(tokens), chunk)), default=-1)


def min_token_id(tokens: np.ndarray, chunk: int = SCAN_CHUNK) -> int:
    """The smallest id in ``tokens`` (0 when empty or unsigned), read ``chunk`` ids at a time."""
    if tokens.dtype.kind == "u":
        return 0
    return min((int(tokens[start : start + chunk].min()) for start in range(0, len(tokens), chunk)), default=0)


def open_pretokenized(path: Path) -> np.ndarray:
    """Map a token array without reading it: ``.bin`` as raw uint16 ids, ``.npy`` as the 1-D integer array it holds."""
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise DataError(
                f"{path} is {size} bytes, an odd number: a .bin file is read as raw uint16 token ids (nanoGPT's "
                f"train.bin), 2 bytes each. Fix: write the ids with np.asarray(ids, dtype=np.uint16).tofile(path), "
                f"or save them with np.save as a .npy file (any integer dtype)."
            )
        return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, dtype=np.uint16)
    try:
        array = np.load(path, mmap_mode="r")
    except ValueError as err:
        raise DataError(
            f"{path} cannot be mapped as a numpy array ({err}). Fix: save the token ids with np.save(path, ids) "
            f"as a 1-D integer array."
        ) from err
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(
            f"{path} holds a {array.dtype} array of shape {array.shape}; a .npy token file must be a 1-D integer "
            f"array of token ids. Fix: save np.asarray(ids, dtype=np.uint16 or np.uint32).reshape(-1)."
        )
    return array


def _open_tokens(path: Path, dtype: np.dtype, offset: int, start: int, length: int) -> np.ndarray:
    # A memmap of its own per split (not a slice of one) keeps `offset` true for TokenWindows' pickling;
    # numpy refuses to map zero bytes, which a tiny corpus can leave in a split.
    if length == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset + start * dtype.itemsize, shape=(length,))


class _CacheWriter:
    """Appends documents and arrays to an open cache file, counting tokens and the largest id per source."""

    def __init__(self, out: Any, dtype: np.dtype, num_sources: int, tokenizer: Any, eos_id: int | None) -> None:
        self.out = out
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.counts = [0] * num_sources
        self.maxima = [-1] * num_sources
        self.texts: list[str] = []
        self.owners: list[int] = []
        self.characters = 0

    def add_document(self, text: str, source: int) -> None:
        self.texts.append(text)
        self.owners.append(source)
        self.characters += len(text)
        if len(self.texts) >= DOCUMENTS_PER_BATCH or self.characters >= CHARACTERS_PER_BATCH:
            self.flush()

    def add_array(self, array: np.ndarray, source: int) -> None:
        self.flush()  # documents read before this array come before it in the stream
        for start in range(0, len(array), SCAN_CHUNK):
            self.out.write(np.asarray(array[start : start + SCAN_CHUNK]).astype(self.dtype).tobytes())
        self.counts[source] += len(array)
        self.maxima[source] = max(self.maxima[source], max_token_id(array))

    def flush(self) -> None:
        if not self.texts:
            return
        encodings = self.tokenizer.encode_batch_fast(self.texts)
        total = sum(len(encoding.ids) + 1 for encoding in encodings)
        tokens = chain.from_iterable((*encoding.ids, self.eos_id) for encoding in encodings)
        self.out.write(np.fromiter(tokens, dtype=self.dtype, count=total).tobytes())
        for encoding, source in zip(encodings, self.owners):
            self.counts[source] += len(encoding.ids) + 1
            self.maxima[source] = max(self.maxima[source], self.eos_id, max(encoding.ids, default=-1))
        self.texts, self.owners, self.characters = [], [], 0


def _read_meta(target: Path) -> dict[str, Any]:
    meta = json.loads(target.read_text())
    meta["tokens"] = str(target.parent / meta["tokens"])  # an absolute path (a source mapped in place) stays as is
    return meta
