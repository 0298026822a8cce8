"""Byte-level language modelling: a token stream cut into windows, and the text corpus that feeds it.

``TokenStreamDataModule`` holds what every parallelkit datamodule shares (the data-parallel layout,
the GlobalBatchSampler, the resume position); ``TextDataModule`` adds the corpus on disk.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.errors import DataError


class TokenWindows(Dataset):
    """Non-overlapping windows of a 1-D token array; sample ``i`` is ``(x, y)``, ``y`` = ``x`` shifted by one.

    Window ``i`` reads ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; its last token is only a target,
    and is the first input of window ``i + 1``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Pickling an np.memmap copies the whole array into each spawned DataLoader worker; reopen it instead.
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.offset, len(self.tokens))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], tuple):
            filename, offset, length = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


class TokenStreamDataModule(L.LightningDataModule):
    """Base of parallelkit's datamodules: train/val ``TokenWindows`` fed through ``GlobalBatchSampler``.

    Subclasses fill ``self.train_set`` and ``self.val_set`` in ``setup`` and describe their source for
    error messages; this class turns them into dataloaders that keep the global sample order of every
    layout identical, and saves/restores the position in the training epoch through Lightning's
    datamodule checkpoint hooks.

    Args:
        seq_len: tokens per sample (the model's context length).
        batch_size: samples per process per step; the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        seed: seed of the training order (epoch ``e`` shuffles with ``seed + e``).
        num_workers: DataLoader worker processes per rank.
    """

    vocab_size: int = 256

    def __init__(self, seq_len: int, batch_size: int, seed: int, num_workers: int) -> None:
        super().__init__()
        if seq_len < 1:
            raise DataError(f"seq_len is {seq_len}; it must be at least 1. Fix: set data.seq_len >= 1.")
        if batch_size < 1:
            raise DataError(f"batch_size is {batch_size}; it must be at least 1. Fix: set data.batch_size >= 1.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._train_sampler: GlobalBatchSampler | None = None
        self._resume_state: dict[str, int] | None = None

    def describe(self, split: str) -> str:
        """Where ``split``'s tokens come from, as the subject of an error message."""
        return f"The {split} split"

    def more_data_hint(self, split: str) -> str:
        """How to give ``split`` more samples, for the fix in an error message."""
        return "use more data"

    def data_parallel_layout(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the data-parallel group this process reads for.

        Lightning's parallel strategies report it as ``distributed_sampler_kwargs``; a single-device
        strategy has none, and without a trainer there is one process.
        """
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def train_dataloader(self) -> DataLoader:
        self._train_sampler = self._sampler(self.train_set, "train", shuffle=True)
        if self._resume_state:
            self._train_sampler.load_state_dict(self._resume_state)
            # Applied once: a dataloader reloaded in a later epoch must start that epoch from its beginning.
            self._resume_state = None
        return self._loader(self.train_set, self._train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self._sampler(self.val_set, "val", shuffle=False))

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def state_dict(self) -> dict[str, int]:
        """The training position: epoch and global samples consumed in it (empty when not training).

        ``batch_progress.current.processed`` counts this epoch's micro-batches up to and including the
        one whose ``on_train_batch_end`` saves the checkpoint, so resuming starts at the next one.
        """
        if self.trainer is None or self._train_sampler is None:
            return {}
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {**self._train_sampler.state_dict(processed), "epoch": self.trainer.current_epoch}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Remember the saved position; the train dataloader built next starts there."""
        self._resume_state = dict(state_dict) or None

    def _sampler(self, dataset: TokenWindows | None, split: str, shuffle: bool) -> GlobalBatchSampler:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its {split} dataloader is built")
        num_replicas, rank = self.data_parallel_layout()
        global_batch_size = self.batch_size * num_replicas
        if len(dataset) < global_batch_size:
            raise DataError(
                f"{self.describe(split)} holds {len(dataset)} samples of seq_len {self.seq_len}, fewer than "
                f"one global batch of {global_batch_size} (batch_size {self.batch_size} x data-parallel size "
                f"{num_replicas}). Fix: {self.more_data_hint(split)}, or lower data.batch_size or "
                f"data.seq_len."
            )
        return GlobalBatchSampler(len(dataset), self.batch_size, num_replicas, rank, shuffle=shuffle, seed=self.seed)

    def _loader(self, dataset: TokenWindows | None, sampler: GlobalBatchSampler) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)


def default_corpus_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files: several MB of text on every machine, no download."""
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())


class TextDataModule(TokenStreamDataModule):
    """Byte-level language modelling (vocabulary of 256) over text files, split into train and val.

    The files are read once, in sorted path order, into a single byte stream cached under
    ``cache_dir``; the first ``1 - val_fraction`` of the stream is the training split and the rest the
    validation split, so no text is in both. Each sample is a non-overlapping window of ``seq_len``
    bytes and its next-byte targets. The training order is shuffled globally with ``seed`` and each
    data-parallel rank reads its slice of every global batch, so any layout sees the same batches.

    Args:
        paths: files, directories (searched recursively for ``pattern``) or glob patterns; a string or
            a list. ``None`` uses the Python standard library's top-level ``*.py`` sources.
        pattern: file-name pattern for files inside directories given in ``paths``.
        seq_len: bytes per sample (the model's context length).
        batch_size: samples per process per step (the micro-batch); the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        val_fraction: fraction of the byte stream, taken from its end, used for validation and test.
        seed: seed of the training order (epoch ``e`` shuffles with ``seed + e``).
        num_workers: DataLoader worker processes per rank.
        cache_dir: where the concatenated corpus is cached; default ``$PARALLELKIT_CACHE`` or
            ``~/.cache/parallelkit``.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        pattern: str = "*.py",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1). Fix: e.g. data.val_fraction=0.05.")
        self.paths = [paths] if isinstance(paths, str) else paths
        self.pattern = pattern
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.num_bytes = 0

    def files(self) -> list[Path]:
        """The corpus files, resolved, deduplicated and sorted (the order of the byte stream)."""
        if self.paths is None:
            return default_corpus_files()
        found: list[Path] = []
        for entry in self.paths:
            path = Path(entry).expanduser()
            if path.is_dir():
                matches = [p for p in path.rglob(self.pattern) if p.is_file()]
            elif path.is_file():
                matches = [path]
            else:
                matches = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
            if not matches:
                raise DataError(
                    f"data.paths entry {entry!r} matches no file (directories are searched for "
                    f"{self.pattern!r}). Fix: point data.paths at existing files, a directory or a glob, or "
                    f"change data.pattern."
                )
            found.extend(matches)
        return sorted({p.resolve() for p in found})

    def corpus_path(self) -> Path:
        """The cache file for the current corpus, named by a hash of its files' paths, sizes and mtimes."""
        digest = hashlib.sha256()
        for path in self.files():
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        cache_dir = self.cache_dir or os.environ.get("PARALLELKIT_CACHE") or "~/.cache/parallelkit"
        return Path(cache_dir).expanduser() / f"bytes-{digest.hexdigest()[:16]}.bin"

    def describe(self, split: str) -> str:
        source = "the standard library's *.py files" if self.paths is None else f"{self.paths}"
        return f"The {split} split of the corpus {source} ({self.num_bytes} bytes, val_fraction {self.val_fraction})"

    def more_data_hint(self, split: str) -> str:
        return "raise data.val_fraction or add text" if split == "val" else "add text to data.paths"

    def prepare_data(self) -> None:
        """Build the cached byte stream once per node (Lightning calls this on local rank 0 only)."""
        self._build_corpus()

    def setup(self, stage: str | None = None) -> None:
        path = self._build_corpus()
        self.num_bytes = path.stat().st_size
        if self.num_bytes == 0:
            raise DataError(
                f"The corpus {self.paths} is empty (0 bytes in {path}). Fix: point data.paths at non-empty text files."
            )
        split = int(self.num_bytes * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(_open_bytes(path, 0, split), self.seq_len)
        self.val_set = TokenWindows(_open_bytes(path, split, self.num_bytes - split), self.seq_len)

    def _build_corpus(self) -> Path:
        """Write the concatenated corpus unless it is cached; atomic, since several ranks may race."""
        target = self.corpus_path()
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                for path in self.files():
                    out.write(path.read_bytes())
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
        return target


def _open_bytes(path: Path, offset: int, length: int) -> np.ndarray:
    # A memmap of its own per split (not a slice of one) keeps `offset` true for TokenWindows' pickling;
    # numpy refuses to map zero bytes, which a tiny corpus can leave in a split.
    if length == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
